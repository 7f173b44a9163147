"""One thread owns the engine and drains a bounded queue of requests into the continuous-batching
scheduler (runtime/scheduler.py): up to the plan's max_num_seqs requests share every forward pass (DSpark
plans too: each sequence's drafts are verified in the same pass), the rest wait. Each request's tokens go
back to its HTTP handler as events on the handler's event loop; a handler whose client went away sets
`cancelled`, and the worker drops that request before the next step (or skips it while still queued),
so a disconnect frees its slot."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from runtime.scheduler import Scheduler, Sequence
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
    seq: Sequence | None = None        # its sequence in the scheduler
    started: float | None = None       # when a step first ran it
    first: float | None = None         # its first token
    last: float | None = None          # its latest token

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
        self.active: dict = {}             # sequence id -> Job, in the scheduler (queued there or running)
        self.sched = Scheduler(engine)
        self.alive = True
        self.thread = threading.Thread(target=self._loop, name="dsv41-engine", daemon=True)
        self.thread.start()

    @property
    def running(self) -> int:
        """Requests being generated now."""
        return len(self.sched.running)

    @property
    def queued(self) -> int:
        """Requests waiting: in the queue, or admitted to the scheduler but not yet running."""
        return self.q.qsize() + len(self.sched.waiting)

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
        sched = self.sched
        while self.alive:
            if not sched.busy and not self._take(sched, block=True):
                return
            while len(sched.running) + len(sched.waiting) < sched.max_seqs and self._take(sched, block=False):
                pass                                   # the rest stay in the bounded queue (429 beyond it)
            self._drop_cancelled(sched)
            if sched.busy:
                self._step(sched)
            self._gauges(sched)

    def _gauges(self, sched: Scheduler) -> None:
        """Requests running and waiting now."""
        self.metrics.running.set(len(sched.running))
        self.metrics.waiting.set(self.q.qsize() + len(sched.waiting))

    def _end(self, sched: Scheduler, job: Job, kind: str, value, t: float | None = None) -> None:
        """A request's last event ("done", "error", "cancelled"), emitted after the gauges stop counting it:
        a client that reads /metrics after its response never finds itself still running or waiting."""
        self._gauges(sched)
        job.emit(kind, value, time.perf_counter() if t is None else t)

    def _take(self, sched: Scheduler, block: bool) -> bool:
        """Move one queued job into the scheduler. -> False when none was there (or on stop)."""
        try:
            job = self.q.get() if block else self.q.get_nowait()
        except queue.Empty:
            return False
        if job is None:
            self.alive = False
            return False
        if job.cancelled.is_set():
            self.metrics.success("abort")
            self._end(sched, job, "cancelled", None)
            return True
        try:
            job.seq = sched.add(Sequence(job.prompt, job.max_tokens, job.temperature, job.seed, frozenset(job.stop_ids)))
        except ValueError as e:
            self.metrics.error(400)
            self._end(sched, job, "error", str(e))
            return True
        self.active[job.seq.rid] = job
        return True

    def _drop_cancelled(self, sched: Scheduler) -> None:
        for rid, job in list(self.active.items()):
            if job.cancelled.is_set():
                sched.cancel(job.seq)
                del self.active[rid]
                self._account(job)
                self.metrics.success("stop" if job.stop_hit else "abort")
                self._end(sched, job, "cancelled", None)

    def _step(self, sched: Scheduler) -> None:
        m, cache, engram = self.metrics, getattr(self.engine.experts, "cache", None), self.engine.engram
        hm0 = (cache.hits, cache.misses) if cache is not None else (0, 0)
        w0 = engram.counters.get("wait_s", 0.0) if engram is not None else 0.0
        t0 = time.perf_counter()
        try:
            out = sched.step()
        except Exception as e:                       # a failed step fails the requests in it, never the server
            for rid, job in list(self.active.items()):
                if job.seq in sched.running:
                    sched.cancel(job.seq)
                    del self.active[rid]
                    m.error(500)
                    self._end(sched, job, "error", f"{type(e).__name__}: {e}")
            return
        now = time.perf_counter()
        if cache is not None:
            m.lookups(cache.hits - hm0[0], cache.misses - hm0[1])
        if engram is not None:
            m.engram_wait.inc(engram.counters.get("wait_s", 0.0) - w0)
        for job in self.active.values():
            if job.started is None and job.seq.prefilled:          # it ran in this step for the first time
                job.started = t0
                m.queue_time.observe(t0 - job.enqueued)
        for seq, tok in out:
            job = self.active[seq.rid]
            if job.first is None:
                job.first = now
                m.ttft.observe(now - job.arrival)
                m.prefill_time.observe(now - job.started)
            else:
                m.itl.observe(now - job.last)
            job.last = now
            job.emit("token", tok, now)
        for rid, job in list(self.active.items()):
            if job.seq.finished:
                del self.active[rid]
                self._account(job)
                seq = job.seq
                m.success("stop" if seq.tokens and seq.tokens[-1] in seq.stop_ids else "length")
                self._end(sched, job, "done", SimpleNamespace(tokens=list(seq.tokens)), now)

    def _account(self, job: Job) -> None:
        m = self.metrics
        n = len(job.seq.tokens) if job.seq else 0
        m.prompt_tokens.inc(len(job.prompt))
        m.generated.inc(n)
        m.prompt_len.observe(len(job.prompt))
        m.gen_len.observe(n)
        if job.first is not None:
            m.decode_time.observe(job.last - job.first)
            m.e2e.observe(job.last - job.arrival)
        if job.seq is not None and job.seq.spec["steps"]:
            m.speculative(job.seq.spec)
