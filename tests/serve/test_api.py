"""The OpenAI-compatible API against a real server process, with the official `openai` client."""
import json
import threading
import time

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from runtime.checkpoint.reader import Checkpoint
from runtime.engine import Engine
from runtime.plan import Plan
from runtime.tokenizer import special_ids
from runtime.workload import make_prompt


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def _health(url):
    return httpx.get(url + "/health", timeout=5).json()


def _metric(url, name):
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_completions_stream_and_non_stream_match_the_engine(server, client, tiny_dir):
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    prompt = make_prompt(tok, 48, seed=3)
    expect = Engine(Checkpoint(tiny_dir), Plan(max_context=512)).generate(prompt, 12, stop_ids=(special_ids(tok)["eos"],))
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == tok.decode(expect.tokens, skip_special_tokens=True)
    assert r.usage.prompt_tokens == 48 and r.usage.completion_tokens == len(expect.tokens)
    assert r.choices[0].finish_reason == ("length" if len(expect.tokens) == 12 else "stop")
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == len(expect.tokens)
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.model_extra["dsv41"]["ttft_s"] > 0


def test_chat_stream_and_non_stream(client, server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does a queue do?"}]
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert float(raw.headers["x-dsv41-ttft-s"]) > 0 and float(raw.headers["x-dsv41-decode-tok-s"]) > 0
    r = raw.parse()
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    s = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True))
    assert s[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in s) == r.choices[0].message.content
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert _metric(server, 'dsv41:time_to_first_token_seconds_count{model_name="tiny"}') >= 2
    assert _metric(server, 'dsv41:request_success_total{finished_reason="length",model_name="tiny"}') >= 2


@pytest.mark.parametrize("body,status,words", [
    (b"{not json", 400, "JSON"),
    ({"model": "nope", "prompt": "hi"}, 404, "nope"),
    ({"model": "tiny", "prompt": "hi", "temperature": 5}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0.5}, 400, "top_p"),
    ({"model": "tiny", "prompt": "hi", "n": 2}, 400, "n"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": [5] * 600}, 400, "context"),
    ({"model": "tiny", "prompt": [10 ** 6]}, 400, "vocabulary"),
    ({"model": "tiny", "prompt": ""}, 400, "empty"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "hi", "echo": True}, 400, "echo"),
    ({"model": "tiny", "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"model": "tiny", "prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ({"model": "tiny", "prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"model": "tiny", "prompt": "hi", "seed": 2 ** 70}, 400, "seed"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, 400,
     "response_format"),
])
def test_bad_requests_get_their_status(server, body, status, words):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"]
    if isinstance(body, dict) and words in body and status == 400:
        assert err["param"] == words                                   # the parameter is named
    assert _health(server)["status"] == "ok"


def test_defaults_of_unsupported_parameters_are_accepted(client):
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0, logprobs=None, echo=False,
                                  presence_penalty=0, frequency_penalty=0, best_of=1)
    assert r.choices[0].text is not None


def test_every_error_has_openai_s_shape_routes_methods_and_size_included(server, client):
    for r, status in ((httpx.get(server + "/v1/nothing"), 404), (httpx.get(server + "/v1/completions"), 405),
                      (httpx.post(server + "/v1/completions", content=b"x" * (9 << 20),
                                  headers={"content-type": "application/json"}, timeout=60), 413)):
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as e:                      # the official client reads it
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, logprobs=3)
    assert e.value.body["param"] == "logprobs" and e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")


VLLM_NAMES = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "inter_token_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_prompt_tokens", "request_generation_tokens", "request_success_total", "prompt_tokens_total",
              "generation_tokens_total", "num_requests_running", "num_requests_waiting")


def test_metrics_are_named_and_labelled_as_vllm_s_with_no_last_request_gauges(server, client):
    client.completions.create(model="tiny", prompt="hello there", max_tokens=3, temperature=0)
    httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "hi", "echo": True}, timeout=30)
    text = httpx.get(server + "/metrics", timeout=5).text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for n in VLLM_NAMES:
        assert any(x == "dsv41:" + n or x.startswith("dsv41:" + n + "_") for x in names), n
    assert not any(x.endswith("_created") for x in names)                        # no stray created series
    assert all('model_name="tiny"' in line for line in text.splitlines() if line.startswith("dsv41:"))
    assert _metric(server, 'dsv41:request_errors_total{model_name="tiny",status="400"}') >= 1   # 4xx counted
    gauges = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE") and line.endswith(" gauge")]
    assert set(gauges) == {"dsv41:num_requests_running", "dsv41:num_requests_waiting", "dsv41:memory_bytes"}
    assert _metric(server, 'dsv41:request_prompt_tokens_count{model_name="tiny"}') >= 1


def test_a_template_that_fails_on_the_messages_is_a_400_in_shape(tiny_dir, tmp_path):
    from fastapi.testclient import TestClient
    from runtime.serve.app import create_app
    from runtime.serve.chat import ChatTemplate
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[3].content }}")                       # StrictUndefined: fails with one message
    e = Engine(tiny_dir, Plan(max_context=256, cpu_threads=1))
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    try:
        with TestClient(create_app(e, tok, ChatTemplate(f), "tiny", {})) as c:
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "template_error"
            assert r.json()["error"]["param"] == "messages" and "chat template" in r.json()["error"]["message"]
    finally:
        e.close()


def _wait_idle(url, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = _health(url)
        if h["running"] == 0 and h["queued"] == 0:
            return h
        time.sleep(0.2)
    raise AssertionError(f"the server did not go idle: {h}")


def test_a_disconnect_mid_stream_frees_the_slot(server, client):
    _wait_idle(server)
    before = _metric(server, 'dsv41:request_success_total{finished_reason="abort",model_name="tiny"}') or 0
    with httpx.stream("POST", server + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "Return a list", "max_tokens": 480, "stream": True,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        got = []
        for line in lines:
            if line.startswith("data:"):
                got.append(line)
            if len(got) == 3:
                break
    assert len(got) == 3
    _wait_idle(server)                       # well before 480 tokens could have been generated
    assert (_metric(server, 'dsv41:request_success_total{finished_reason="abort",model_name="tiny"}') or 0) >= before + 1
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_a_full_queue_gets_429_and_loses_nothing(server):
    _wait_idle(server)
    n = 400                                              # each stream runs for a second or more: the queue stays full
    body = {"model": "tiny", "prompt": "Return a list", "max_tokens": n, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    results = {}

    def long_stream(name):
        with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            results[name] = (r.status_code, chunks[-1]["usage"]["completion_tokens"])

    threads = []
    for k in range(3):                                   # one running, two queued: the queue holds 2
        threads.append(threading.Thread(target=long_stream, args=(k,)))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while (lambda h: h["running"] + h["queued"])(_health(server)) < k + 1:
            assert time.monotonic() < deadline and len(results) == 0, f"stream {k} never queued: {results}"
            time.sleep(0.05)
    r = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 429 and "queue" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"
    for t in threads:
        t.join()
    assert [results[k] for k in range(3)] == [(200, n)] * 3                      # the queued ones lost nothing
    assert json.loads(httpx.get(server + "/dsv41/info").text)["plan"]["max_context"] == 512


def test_sampling_is_seeded_when_asked_and_fresh_otherwise(client):
    kw = dict(model="tiny", prompt="The queue", max_tokens=12, temperature=1.5)
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert a == client.completions.create(seed=7, **kw).choices[0].text
    unseeded = {client.completions.create(**kw).choices[0].text for _ in range(4)}
    assert len(unseeded) > 1


def test_metrics_show_the_plans_bytes_from_the_one_accounting(server, tiny_dir):
    from runtime.budget import planned_bytes
    planned = planned_bytes(Plan(max_context=512), Checkpoint(tiny_dir).footprint(), on_cpu=True)
    assert _metric(server, 'dsv41:memory_bytes{model_name="tiny",source="plan",tier="host"}') == planned["anon"]
    assert _metric(server, 'dsv41:memory_bytes{model_name="tiny",source="plan",tier="mapped"}') == planned["file"]
    assert _metric(server, 'dsv41:memory_bytes{model_name="tiny",source="measured",tier="host"}') > planned["anon"]


@pytest.fixture(scope="module")
def batching_server(tiny_dir, tmp_path_factory, host_profile):
    from tests.conftest import start_server, stop_server
    prof = host_profile(tiny_dir, tmp_path_factory.mktemp("batch") / "host.json", max_context=512)
    proc, url, log = start_server(tiny_dir, prof, "--max-num-seqs", "4")
    yield url
    stop_server(proc, log)


def test_concurrent_streams_share_steps_and_each_gets_its_own_output(batching_server, tiny_dir):
    """4 greedy streams at once on a --max-num-seqs 4 server: they run together (health shows it) and
    each returns the tokens its prompt gives alone."""
    url = batching_server
    prompts = ["Return a list of", "The module provides", "Parse the", "If the value"]
    alone = {}
    for p in prompts:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0,
                                                      "ignore_eos": True}, timeout=60).json()
        alone[p] = r["choices"][0]["text"]
    together, peak = {}, [0]

    def one(p):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0,
                                                      "ignore_eos": True}, timeout=120).json()
        together[p] = r["choices"][0]["text"]
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak[0] = max(peak[0], _health(url)["running"])
        time.sleep(0.02)
    assert together == alone and peak[0] >= 2
    assert _metric(url, 'dsv41:num_requests_running{model_name="tiny"}') == 0


def test_a_request_s_end_is_emitted_after_the_gauges_no_longer_count_it(tiny_dir, monkeypatch):
    """The worker sets num_requests_running / waiting before it emits a request's end (done, or refused
    when taken), so a client that reads /metrics after its response never finds itself still counted
    (it raced before)."""
    import asyncio

    from runtime.serve.metrics import Metrics
    from runtime.serve.worker import Job, Worker
    metrics, seen, ended = Metrics({}, "tiny"), [], threading.Event()

    def gauge(name):
        return metrics.registry.get_sample_value(f"dsv41:{name}", {"model_name": "tiny"})

    def emit(job, kind, value, t):
        if kind != "token":
            seen.append((kind, gauge("num_requests_running"), gauge("num_requests_waiting")))
            if len(seen) == 4:
                ended.set()
    monkeypatch.setattr(Job, "emit", emit)
    engine = Engine(Checkpoint(tiny_dir), Plan(max_context=256, max_num_seqs=2))
    worker = Worker(engine, metrics, max_queue=8)
    loop = asyncio.new_event_loop()
    try:                                   # max_tokens 0: refused when the worker takes it
        jobs = [Job([5] * n, m, 0.0, 0, (), loop) for n, m in ((3, 2), (4, 5), (6, 3), (3, 0))]
        for j in jobs:
            worker.submit(j)
        assert ended.wait(120), f"only {seen} ended"
    finally:
        worker.stop()
        engine.close()
        loop.close()
    assert sorted(kind for kind, *_ in seen) == ["done"] * 3 + ["error"]
    # the k-th end sees at most the 4 - k requests not yet ended: never itself
    assert all(running + waiting <= 4 - k for k, (_, running, waiting) in enumerate(seen, 1)), seen
    assert seen[-1][1:] == (0.0, 0.0)
