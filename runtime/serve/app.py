"""The OpenAI-compatible HTTP API over one engine.

  POST /v1/completions, /v1/chat/completions   (stream: SSE `data: {chunk}` ... `data: [DONE]`)
  GET  /v1/models, /health, /metrics (Prometheus), /dsv41/info (plan + host), /dsv41/tokenizer.json

Errors use OpenAI's shape {"error": {message, type, param, code}}: 400 for a malformed body, bad
sampling values, a prompt past the context or max_tokens out of range; 404 for an unknown model; 429
when the queue is full; 503 when the engine is gone. Each response carries the request's TTFT and
decode tok/s: headers x-dsv41-ttft-s / x-dsv41-decode-tok-s (non-streaming) and a `dsv41` member
(both; in a stream, on the chunk that carries finish_reason)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, Field, field_validator

from runtime.serve.text import TextStream
from runtime.serve.worker import Job, QueueFull, Worker


class ClientGone(Exception):
    pass


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = None
    ignore_eos: bool = False           # generate exactly max_tokens (load generators use it)
    user: str | None = None

    @field_validator("top_p")
    @classmethod
    def _full_distribution(cls, v):
        if v != 1.0:
            raise ValueError("top_p < 1 is not supported: this runtime samples from the full distribution")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        v = [v] if isinstance(v, str) else (v or [])
        if len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v


class CompletionRequest(Sampling):
    prompt: str | list[int]


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None


def _error(status, message, param=None, kind="invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def create_app(engine, tokenizer, template, model_id: str, info: dict, max_queue: int = 16, metrics=None) -> FastAPI:
    from runtime.serve.metrics import Metrics
    from runtime.budget import planned_bytes
    fp, plan = engine.footprint, engine.plan
    planned = planned_bytes(plan, fp, on_cpu=engine.device == "cpu")       # the same accounting as admission
    metrics = metrics or Metrics({"host": planned["anon"], "mapped": planned["file"], "device": planned["device"]})
    worker = Worker(engine, metrics, max_queue)
    eos = tokenizer.token_to_id("<eos>")
    vocab = engine.cfg.vocab_size
    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        worker.stop()

    app = FastAPI(title="dsv41", version="0.1.0", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return _error(e.status, e.message, e.param, e.kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        err = e.errors()[0]
        if err.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if not where:
            return _error(400, f"the body must be a JSON object (Content-Type: application/json): {err.get('msg')}")
        return _error(400, f"{where}: {err.get('msg')}", where)

    def _check(req: Sampling, prompt: list[int], max_tokens: int | None, default_max: int) -> int:
        if req.model != model_id:
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {model_id!r}", "model", "not_found_error")
        room = plan.max_context - len(prompt)
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        if room < 1:
            raise ApiError(400, f"the prompt is {len(prompt)} tokens; the plan's context is {plan.max_context} tokens", "prompt")
        if bad := [t for t in prompt if not 0 <= t < vocab]:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")
        n = min(default_max, room) if max_tokens is None else max_tokens
        if not 1 <= n <= room:
            raise ApiError(400, f"max_tokens must be in [1, {room}] for a {len(prompt)}-token prompt in a "
                                f"{plan.max_context}-token context, got {n}", "max_tokens")
        return n

    async def _submit(req: Sampling, prompt: list[int], max_tokens: int) -> Job:
        if not worker.thread.is_alive():
            raise ApiError(503, "the engine is not running", kind="server_error")
        seed = req.seed if req.seed is not None else secrets.randbits(31)    # no seed: a fresh sample each time
        job = Job(prompt, max_tokens, req.temperature, seed, () if req.ignore_eos or eos is None else (eos,),
                  asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFull as e:
            raise ApiError(429, str(e), kind="rate_limit_error") from None
        return job

    async def _run(job: Job, stops: list[str]):
        """-> async stream of ("text", delta) then ("end", finish_reason, stats)."""
        ts, n, t_first, t_last = TextStream(tokenizer, stops), 0, None, None
        while True:
            kind, value, t = await job.events.get()
            if kind == "cancelled":
                raise ClientGone()
            if kind == "error":
                raise ApiError(500, f"generation failed: {value}", kind="server_error")
            if kind == "token":
                n, t_last = n + 1, t
                t_first = t_first or t
                delta = ts.push(value)
                if delta:
                    yield "text", delta
                if ts.stopped:
                    job.stop_hit = True
                    job.cancelled.set()
                    reason = "stop"
                    break
            else:                                        # done: the engine's Result
                tail = ts.flush()
                if tail:
                    yield "text", tail
                reason = "stop" if value.tokens and value.tokens[-1] in job.stop_ids else "length"
                break
        stats = {"ttft_s": (t_first or t) - job.enqueued,
                 "decode_tok_s": (n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else 0.0,
                 "prompt_tokens": len(job.prompt), "completion_tokens": n}
        yield "end", reason, stats

    def _usage(stats):
        return {"prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["completion_tokens"],
                "total_tokens": stats["prompt_tokens"] + stats["completion_tokens"]}

    async def _respond(request: Request, req: Sampling, job: Job, chat: bool):
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def chunk(text, reason, **extra):
            choice = ({"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": reason} if chat
                      else {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason})
            return {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created, "model": model_id,
                    "choices": [choice], **extra}

        if req.stream:
            async def sse():
                try:
                    if chat:
                        first = chunk(None, None)
                        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                        yield f"data: {json.dumps(first)}\n\n"
                    async for ev in _run(job, req.stop):
                        if ev[0] == "text":
                            yield f"data: {json.dumps(chunk(ev[1], None))}\n\n"
                        else:
                            yield f"data: {json.dumps(chunk(None if chat else '', ev[1], dsv41=ev[2]))}\n\n"
                            if req.stream_options and req.stream_options.include_usage:
                                yield f"data: {json.dumps({**chunk(None, None), 'choices': [], 'usage': _usage(ev[2])})}\n\n"
                    yield "data: [DONE]\n\n"
                except ClientGone:
                    return
                except ApiError as e:
                    yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind}})}\n\n"
                finally:                                 # the client went away or we are done: free the slot
                    job.cancelled.set()
            return StreamingResponse(sse(), media_type="text/event-stream")

        async def watch():                               # a client that hangs up frees its slot
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)
            job.cancelled.set()

        parts, reason, stats = [], None, None
        watcher = asyncio.create_task(watch())
        try:
            async for ev in _run(job, req.stop):
                if ev[0] == "text":
                    parts.append(ev[1])
                else:
                    reason, stats = ev[1], ev[2]
        except ClientGone:
            return PlainTextResponse("client closed the request", status_code=499)
        finally:
            watcher.cancel()
            job.cancelled.set()
        text = "".join(parts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason} if chat
                  else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
        body = {"id": rid, "object": obj, "created": created, "model": model_id, "choices": [choice],
                "usage": _usage(stats), "dsv41": stats}
        return JSONResponse(body, headers={"x-dsv41-ttft-s": f"{stats['ttft_s']:.6f}",
                                           "x-dsv41-decode-tok-s": f"{stats['decode_tok_s']:.3f}"})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompt = req.prompt if isinstance(req.prompt, list) else tokenizer.encode(req.prompt).ids
        n = _check(req, prompt, req.max_tokens, 16)
        return await _respond(request, req, await _submit(req, prompt, n), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        try:
            text = template.render([m.model_dump() for m in req.messages])
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        prompt = tokenizer.encode(text).ids
        n = _check(req, prompt, req.max_completion_tokens or req.max_tokens, 256)
        return await _respond(request, req, await _submit(req, prompt, n), chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "dsv41",
                                            "max_model_len": plan.max_context}]}

    @app.get("/health")
    async def health():
        ok = worker.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped", "model": model_id,
                             "queued": worker.q.qsize(), "running": worker.running}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/dsv41/info")
    async def about():
        return {**info, "model": model_id, "plan": plan.to_dict(), "chat_template": template.name,
                "nvme_io_paths": engine.io_paths()}

    @app.get("/dsv41/tokenizer.json")
    async def tokenizer_json():
        return PlainTextResponse(tokenizer.to_str(), media_type="application/json")

    return app
