"""The OpenAI-compatible HTTP API over one engine.

  POST /v1/completions, /v1/chat/completions   (stream: SSE `data: {chunk}` ... `data: [DONE]`)
  GET  /v1/models, /health, /metrics (Prometheus), /dsv41/info (plan + host), /dsv41/tokenizer.json

Errors use OpenAI's shape {"error": {message, type, param, code}} everywhere (unknown routes and methods,
template failures and unexpected errors included): 400 for a malformed body, bad sampling values, a
parameter this server does not implement set to a non-default value (named), a prompt past the context
or max_tokens out of range; 404 for an unknown model or route; 405 for a wrong method; 413 for a body
over MAX_BODY_BYTES; 429 with Retry-After when the queue is full; 503 when the engine is gone.
Tokenization and chat templating run off the event loop. Each response carries the request's TTFT and
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
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.serve.text import TextStream
from runtime.tokenizer import special_ids
from runtime.serve.worker import Job, QueueFull, Worker


class ClientGone(Exception):
    pass


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code, self.headers = status, message, param, kind, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


MAX_BODY_BYTES = 8 << 20          # a request body above this is refused (413) before it is parsed
RETRY_AFTER_S = 1
# OpenAI parameters this server does not implement -> the values that mean "not used"
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "repetition_penalty": (None, 1), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None,),
               "response_format": (None, {"type": "text"}), "min_tokens": (None, 0), "top_k": (None, -1, 0),
               "min_p": (None, 0), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
               "reasoning_effort": (None,), "service_level": (None,), "metadata": (None, {}), "store": (None, False)}


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")         # extras are checked against UNSUPPORTED, else ignored
    model: str
    max_tokens: StrictInt | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: StrictInt | None = Field(None, ge=-(1 << 63), lt=1 << 63)
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
    max_completion_tokens: StrictInt | None = None


def _error(status, message, param=None, kind="invalid_request_error", code=None, headers=None):
    return JSONResponse(ApiError(status, message, param, kind, code).body(), status_code=status, headers=headers)


def unsupported(req: BaseModel) -> None:
    """A parameter this server does not implement, set to a value that would change the output: 400."""
    for k, v in (req.model_extra or {}).items():
        if k in UNSUPPORTED and v not in UNSUPPORTED[k]:
            raise ApiError(400, f"{k} is not supported by this server (got {json.dumps(v)[:80]}); leave it unset",
                           k, code="unsupported_parameter")


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 in OpenAI's shape, unread."""

    def __init__(self, app, limit: int, on_refuse=None):
        self.app, self.limit, self.on_refuse = app, limit, on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.perf_counter()    # TTFT counts from here
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return msg
        try:
            return await self.app(scope, counted, send)
        except _TooLarge:
            return await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        if self.on_refuse:
            self.on_refuse(413)
        resp = _error(413, f"the request body is over {self.limit} bytes", kind="invalid_request_error", code="body_too_large")
        await resp(scope, receive, send)


class _TooLarge(Exception):
    pass


def create_app(engine, tokenizer, template, model_id: str, info: dict, max_queue: int = 16, metrics=None) -> FastAPI:
    from runtime.serve.metrics import Metrics
    from runtime.budget import planned_bytes
    fp, plan = engine.footprint, engine.plan
    planned = planned_bytes(plan, fp, on_cpu=engine.device == "cpu")       # the same accounting as admission
    metrics = metrics or Metrics({"host": planned["anon"], "mapped": planned["file"], "device": planned["device"]}, model_id)
    worker = Worker(engine, metrics, max_queue)
    eos = special_ids(tokenizer)["eos"]
    vocab = engine.cfg.vocab_size
    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        worker.stop()

    app = FastAPI(title="dsv41", version="0.1.0", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES, on_refuse=metrics.error)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        metrics.error(e.status)
        return _error(e.status, e.message, e.param, e.kind, e.code, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        metrics.error(e.status_code)
        if e.status_code == 404:
            return _error(404, f"no route {request.method} {request.url.path}", kind="not_found_error", code="unknown_url")
        if e.status_code == 405:
            return _error(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed",
                          headers=getattr(e, "headers", None))
        return _error(e.status_code, str(e.detail), kind="invalid_request_error" if e.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):
        metrics.error(500)
        return _error(500, f"internal error: {type(e).__name__}", kind="server_error", code="internal_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        metrics.error(400)
        err = e.errors()[0]
        if err.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if not where:
            return _error(400, f"the body must be a JSON object (Content-Type: application/json): {err.get('msg')}")
        return _error(400, f"{where}: {err.get('msg')}", where)

    def _check(req: Sampling, prompt: list[int], max_tokens: int | None, default_max: int) -> int:
        unsupported(req)
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

    async def _submit(req: Sampling, prompt: list[int], max_tokens: int, arrival: float) -> Job:
        if not worker.thread.is_alive():
            raise ApiError(503, "the engine is not running", kind="server_error")
        seed = req.seed if req.seed is not None else secrets.randbits(31)    # no seed: a fresh sample each time
        job = Job(prompt, max_tokens, req.temperature, seed, () if req.ignore_eos or eos is None else (eos,),
                  asyncio.get_running_loop(), arrival=arrival)
        try:
            worker.submit(job)
        except QueueFull as e:
            raise ApiError(429, str(e), kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
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
                reason = "stop" if ts.stopped or (value.tokens and value.tokens[-1] in job.stop_ids) else "length"
                break
        stats = {"ttft_s": (t_first or t) - job.arrival,
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
                    yield f"data: {json.dumps(e.body())}\n\n"
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

    async def _encode(text: str) -> list[int]:
        return (await asyncio.to_thread(tokenizer.encode, text)).ids         # off the event loop

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        arrival = getattr(request.state, "arrival", time.perf_counter())
        unsupported(req)
        prompt = req.prompt if isinstance(req.prompt, list) else await _encode(req.prompt)
        n = _check(req, prompt, req.max_tokens, 16)
        return await _respond(request, req, await _submit(req, prompt, n, arrival), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        arrival = getattr(request.state, "arrival", time.perf_counter())
        unsupported(req)
        try:                                         # off the event loop; content can never forge a marker
            prompt = await asyncio.to_thread(template.encode, [m.model_dump() for m in req.messages], tokenizer)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        except Exception as e:                       # the template itself failed on these messages
            raise ApiError(400, f"the chat template could not render these messages: {type(e).__name__}: {e}",
                           "messages", code="template_error") from None
        n = _check(req, prompt, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens, 256)
        return await _respond(request, req, await _submit(req, prompt, n, arrival), chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "dsv41",
                                            "max_model_len": plan.max_context}]}

    @app.get("/health")
    async def health():
        ok = worker.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped", "model": model_id,
                             "queued": worker.queued, "running": worker.running}, status_code=200 if ok else 503)

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
