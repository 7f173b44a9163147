"""One thread owns the engine and drains a bounded queue of requests, one at a time (the runtime
decodes a single stream). Each request's tokens go back to its HTTP handler as events on the
handler's event loop; a handler whose client went away sets `cancelled`, and the worker stops that
request at its next token (or skips it if it is still queued), so a disconnect frees the slot."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from runtime.serve.metrics import Metrics


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    temperature: float
    seed: int
    stop_ids: tuple
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)   # when the HTTP request arrived (set by the handler)
    enqueued: float = field(default_factory=time.perf_counter)
    stop_hit: bool = False             # the handler found a stop string and ended the request itself

    def emit(self, *event) -> None:
        """From the worker thread: ("token", id, t) | ("done", Result, t) | ("error", message, t) |
        ("cancelled", None, t)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class QueueFull(Exception):
    pass


class Worker:
    def __init__(self, engine, metrics: Metrics, max_queue: int):
        self.engine, self.metrics = engine, metrics
        self.q: queue.Queue = queue.Queue(maxsize=max_queue)
        self.running = 0
        self.alive = True
        self.thread = threading.Thread(target=self._loop, name="dsv41-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        job.enqueued = time.perf_counter()
        try:
            self.q.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the request queue is full ({self.q.maxsize} waiting); retry later") from None
        self.metrics.waiting.set(self.q.qsize())

    def stop(self) -> None:
        self.alive = False
        try:
            self.q.put_nowait(None)
        except queue.Full:
            pass

    def _loop(self) -> None:
        while self.alive:
            job = self.q.get()
            self.metrics.waiting.set(self.q.qsize())
            if job is None:
                return
            if job.cancelled.is_set():
                self.metrics.success("abort")
                job.emit("cancelled", None, time.perf_counter())
                continue
            self.running = 1
            self.metrics.running.set(1)
            try:
                self._generate(job)
            except Exception as e:                       # a bad request never takes the server down
                self.metrics.error(500)
                job.emit("error", f"{type(e).__name__}: {e}", time.perf_counter())
            finally:
                self.running = 0
                self.metrics.running.set(0)

    def _generate(self, job: Job) -> None:
        m = self.metrics
        t0 = last = time.perf_counter()
        m.queue_time.observe(t0 - job.enqueued)
        it = self.engine.stream(job.prompt, job.max_tokens, job.temperature, job.seed, stop_ids=job.stop_ids)
        n, result, first = 0, None, None
        try:
            while not job.cancelled.is_set():
                try:
                    tok = next(it)
                except StopIteration as done:
                    result = done.value
                    break
                now = time.perf_counter()
                if n == 0:
                    first = now
                    m.ttft.observe(now - job.arrival)
                    m.prefill_time.observe(now - t0)
                else:
                    m.itl.observe(now - last)
                last, n = now, n + 1
                job.emit("token", tok, now)
        finally:
            it.close()
        m.prompt_tokens.inc(len(job.prompt))
        m.generated.inc(n)
        m.prompt_len.observe(len(job.prompt))
        m.gen_len.observe(n)
        if first is not None:
            m.decode_time.observe(last - first)
            m.e2e.observe(last - job.arrival)
        if result is None:
            m.success("stop" if job.stop_hit else "abort")
            job.emit("cancelled", None, time.perf_counter())
            return
        m.finished(result, result.slot_lookups)
        m.success("stop" if result.tokens and result.tokens[-1] in job.stop_ids else "length")
        job.emit("done", result, time.perf_counter())
