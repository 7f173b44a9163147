"""Prometheus metrics for one served engine, on their own registry (GET /metrics).

Latencies are measured in the worker, at the moment each token is decided; per-request figures
(expert hit rate, DSpark acceptance, Engram wait) come from the engine's Result. Memory per tier is
given twice: as the plan budgets it (`source="plan"`, from runtime/budget.py) and as measured
(`source="measured"`: the process's resident set; CUDA's allocated bytes where there is a GPU)."""
from __future__ import annotations

import psutil
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, planned: dict[str, int]):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("dsv41_ttft_seconds", "Time from dequeue to the first token", buckets=LAT, registry=r)
        self.queue_wait = Histogram("dsv41_queue_wait_seconds", "Time a request waited in the queue", buckets=LAT, registry=r)
        self.itl = Histogram("dsv41_inter_token_seconds", "Time between consecutive tokens", buckets=LAT, registry=r)
        self.decode_tok_s = Gauge("dsv41_decode_tokens_per_second", "Decode tok/s of the last finished request", registry=r)
        self.requests = Counter("dsv41_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("dsv41_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated = Counter("dsv41_generation_tokens", "Tokens generated", registry=r)
        self.hit_rate = Gauge("dsv41_expert_slot_hit_rate", "Expert slot-cache hit rate over the last request's decode steps", registry=r)
        self.engram_wait = Counter("dsv41_engram_wait_seconds", "Time the forward pass waited for Engram rows", registry=r)
        self.dspark = Gauge("dsv41_dspark_acceptance_rate", "Accepted / drafted tokens over the last request (DSpark on)", registry=r)
        self.dspark_len = Gauge("dsv41_dspark_mean_accepted", "Mean accepted drafts per verify step, last request", registry=r)
        self.queued = Gauge("dsv41_queue_depth", "Requests waiting", registry=r)
        self.inflight = Gauge("dsv41_requests_running", "Requests being generated", registry=r)
        mem = self.memory = Gauge("dsv41_memory_bytes", "Memory per tier", ["tier", "source"], registry=r)
        for tier, n in planned.items():
            mem.labels(tier, "plan").set(n)

    def finished(self, result) -> None:
        self.decode_tok_s.set(result.decode_tok_s)
        self.hit_rate.set(result.hit_rate)
        self.engram_wait.inc(result.engram.get("wait_s", 0.0))
        if result.dspark:
            self.dspark.set(result.dspark["acceptance_rate"])
            self.dspark_len.set(result.dspark["mean_accepted"])

    def render(self) -> bytes:
        self.memory.labels("host", "measured").set(psutil.Process().memory_info().rss)
        if torch.cuda.is_available():
            self.memory.labels("device", "measured").set(torch.cuda.memory_allocated())
        return generate_latest(self.registry)
