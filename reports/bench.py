"""`dsv41-bench`: load-test an OpenAI-compatible server, one JSONL row per phase.

  dsv41-bench --url URL [--requests N] [--concurrency C | --rate R] [--prompt-tokens P --output-tokens O]
              [--spread F] [--warmup W] [--seed S] [--out FILE.jsonl] [--label L]

Prompts are natural text from the workload generator, fresh per request (a new seed each; the run's
seed is drawn at random unless given and is recorded), sent as token ids so their lengths are exact;
lengths are uniform in [mean * (1 - spread), mean * (1 + spread)]. Outputs ask for exactly their
length (`ignore_eos`). Phase `cold`: the first W requests one at a time, straight after the server
came up or the caches were cold; phase `warm`: the N requests at the given concurrency (or Poisson
arrivals at R requests/s). Per request: TTFT (send -> first token), TPOT ((latency - TTFT) / (tokens
- 1)), ITL (gaps between streamed chunks), end-to-end latency; per phase: percentiles, request and
token throughput, failures with their reasons, and every raw sample (per request its start and end
time from the phase's start and its ITL gaps). In rate mode the client never limits its connections
(an open-loop client must not queue requests itself); the limit used is recorded. Provenance: the
server's host fingerprint, plan and commit (from /dsv41/info when the server is dsv41), this client's
commit and whether its tree was dirty, the local time with its timezone. Against another server
(vLLM, SGLang, llama.cpp) give `--tokenizer` its model's tokenizer.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np

SCHEMA = "dsv41-bench/1"
PCTS = (50, 90, 99)


def _stats(xs) -> dict:
    if not len(xs):
        return {}
    a = np.asarray(xs, dtype=float)
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PCTS}, "n": int(a.size)}


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion; -> its timings and token count (or the error)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, usage = [], None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    return {"error": d["error"].get("message", str(d["error"]))}
                if d.get("usage"):
                    usage = d["usage"]
                if d.get("choices") and d["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    if usage is None or not stamps:
        return {"error": "the stream ended without tokens or usage"}
    n = usage["completion_tokens"]
    return {"ttft_s": stamps[0] - t0, "e2e_s": end - t0, "output_tokens": n, "prompt_tokens": usage["prompt_tokens"],
            "tpot_s": (end - stamps[0]) / (n - 1) if n > 1 else None, "itl_s": list(np.diff(stamps)),
            "start_s": t0, "end_s": end}


def connection_limit(concurrency: int, rate) -> int | None:
    """The client's connection pool: none in rate mode (an open-loop client must never queue requests
    itself), the concurrency plus a few otherwise."""
    return None if rate else max(concurrency, 1) + 4


async def run_phase(url, model, jobs, concurrency=1, rate=None, seed=0, progress=None) -> tuple[list[dict], float]:
    """jobs: [(prompt ids, max_tokens)] -> (per-request results in job order, wall seconds). Start and
    end times are relative to the phase's start."""
    sem = asyncio.Semaphore(concurrency if rate is None else len(jobs))
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(jobs)) if rate else np.zeros(len(jobs))
    n = connection_limit(concurrency, rate)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
        async def go(prompt, n):
            async with sem:
                r = await one_request(client, url, model, prompt, n)
            if progress:
                progress()
            return r
        t0 = time.perf_counter()
        tasks = []
        for gap, (prompt, n) in zip(gaps, jobs):
            if rate:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(go(prompt, n)))
        out = await asyncio.gather(*tasks)
    for r in out:
        if "start_s" in r:
            r["start_s"], r["end_s"] = r["start_s"] - t0, r["end_s"] - t0
    return out, time.perf_counter() - t0


def summarize(results: list[dict], wall_s: float) -> dict:
    ok = [r for r in results if "error" not in r]
    out_tok = sum(r["output_tokens"] for r in ok)
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"]]
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": wall_s,
            "request_per_s": len(ok) / wall_s, "output_tok_s": out_tok / wall_s,
            "total_tok_s": (out_tok + sum(r["prompt_tokens"] for r in ok)) / wall_s,
            "decode_tok_s": float(np.median([1 / t for t in tpot])) if tpot else 0.0,
            "ttft_s": _stats([r["ttft_s"] for r in ok]), "tpot_s": _stats(tpot),
            "itl_s": _stats([x for r in ok for x in r["itl_s"]]), "e2e_s": _stats([r["e2e_s"] for r in ok]),
            "errors": sorted({r["error"] for r in results if "error" in r})}


def _lengths(rng, mean, spread, n):
    lo, hi = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return rng.integers(lo, hi + 1, n)


def _tokenizer(url, path):
    from tokenizers import Tokenizer
    if path:
        return Tokenizer.from_file(path)
    r = httpx.get(url + "/dsv41/tokenizer.json", timeout=30)
    if r.status_code != 200:
        raise ValueError(f"{url} does not serve /dsv41/tokenizer.json (not a dsv41 server?): give --tokenizer FILE")
    return Tokenizer.from_str(r.text)


def bench(args) -> list[dict]:
    from hostinfo.fingerprint import commit, dirty
    from runtime.workload import make_prompt
    url = args.url.rstrip("/")
    try:
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        raise ValueError(f"{url}: no OpenAI-compatible server answers there ({e})") from None
    model = args.model or models[0]["id"]
    info = httpx.get(url + "/dsv41/info", timeout=30)
    info = info.json() if info.status_code == 200 else {}
    tok = _tokenizer(url, args.tokenizer)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    n_all = args.warmup + args.requests
    plens, olens = _lengths(rng, args.prompt_tokens, args.spread, n_all), _lengths(rng, args.output_tokens, args.spread, n_all)
    jobs = [(make_prompt(tok, int(p), seed=seed * 7919 + k), int(o)) for k, (p, o) in enumerate(zip(plens, olens))]
    phases = ((("cold", jobs[:args.warmup], 1, None),) if args.warmup else ()) + (("warm", jobs[args.warmup:], args.concurrency, args.rate),)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    rows = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=args.quiet) as bar:
        for phase, js, conc, rate in phases:
            task = bar.add_task(f"{phase} ({'rate %.2g/s' % rate if rate else 'concurrency %d' % conc})", total=len(js))
            results, wall = asyncio.run(run_phase(url, model, js, conc, rate, seed, lambda: bar.advance(task)))
            rows.append({
                "schema": SCHEMA, "kind": "bench", "phase": phase, "label": args.label, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "timezone": time.strftime("%z"),
                "url": url, "model": model, "host": info.get("host"), "profile": info.get("profile"), "plan": info.get("plan"),
                "server_commit": info.get("commit"), "client_commit": commit(), "client_dirty": dirty(),
                "config": {"requests": len(js), "concurrency": conc, "rate": rate, "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens, "spread": args.spread, "seed": seed,
                           "client_connection_limit": connection_limit(conc, rate)},
                "results": summarize(results, wall),
                "samples": {k: [r.get(k) for r in results] for k in ("ttft_s", "tpot_s", "e2e_s", "output_tokens", "prompt_tokens",
                                                                     "start_s", "end_s", "itl_s", "error")},
            })
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:                  # append: a results file collects runs
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


def _print(rows):
    from rich.table import Table

    from runtime.cli.common import console
    t = Table(title=f"{rows[0]['model']} at {rows[0]['url']}")
    for c in ("phase", "reqs", "failed", "req/s", "out tok/s", "decode tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p99"):
        t.add_column(c, justify="right")
    for r in rows:
        s = r["results"]
        g = lambda k, p: f"{s[k][p] * 1e3:.1f} ms" if s[k] else "-"
        t.add_row(r["phase"], str(s["completed"]), str(s["failed"]), f"{s['request_per_s']:.2f}", f"{s['output_tok_s']:.1f}",
                  f"{s['decode_tok_s']:.1f}", g("ttft_s", "p50"), g("ttft_s", "p99"), g("tpot_s", "p50"), g("itl_s", "p99"))
    c = console()
    c.print(t)
    for r in rows:
        for e in r["results"]["errors"]:
            c.print(f"[red]{r['phase']} error:[/] {e}")


def build_parser():
    p = argparse.ArgumentParser(prog="dsv41-bench", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model id (default: the server's first)")
    p.add_argument("--requests", type=int, default=16)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--concurrency", type=int, default=1)
    g.add_argument("--rate", type=float, help="Poisson arrivals, requests per second (instead of --concurrency)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--spread", type=float, default=0.25, help="lengths uniform in mean*(1 +- spread)")
    p.add_argument("--warmup", type=int, default=2, help="cold-phase requests, one at a time, before the run")
    p.add_argument("--seed", type=int, help="prompt seed (default: random, recorded)")
    p.add_argument("--tokenizer", help="the served model's tokenizer.json: needed against a server that is not dsv41 "
                                       "(vLLM, SGLang, llama.cpp), so prompts are exact token counts in its vocabulary "
                                       "(default: the server's /dsv41/tokenizer.json)")
    p.add_argument("--out", help="append the phases' rows to this JSONL file")
    p.add_argument("--label", default="")
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_bench)
    return p


def cmd_bench(args) -> int:
    if args.requests < 1 or args.warmup < 0 or args.concurrency < 1 or (args.rate is not None and args.rate <= 0) \
            or not 0 <= args.spread < 1 or args.prompt_tokens < 1 or args.output_tokens < 1:
        raise ValueError("--requests, --concurrency, --prompt-tokens and --output-tokens must be >= 1, --warmup >= 0, "
                         "--rate > 0, --spread in [0, 1)")
    rows = bench(args)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        _print(rows)
    return 0 if all(r["results"]["failed"] == 0 for r in rows) else 1


def main(argv=None) -> int:
    from runtime.cli.common import run_main
    return run_main(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
