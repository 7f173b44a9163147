"""Prometheus metrics for one served engine, on their own registry (GET /metrics), named and meant as
vLLM's (docs/design/metrics.md there) under the `dsv41:` prefix, every series labelled `model_name`:

  time_to_first_token_seconds   HTTP arrival -> first token (tokenization and queue included)
  e2e_request_latency_seconds   HTTP arrival -> last token
  inter_token_latency_seconds   between consecutive tokens of a request
  request_queue_time_seconds    queued -> the engine takes it
  request_prefill_time_seconds  taken -> first token;  request_decode_time_seconds  first -> last token
  request_prompt_tokens, request_generation_tokens   length histograms per request
  request_success_total{finished_reason}   stop | length | abort (the client went away)
  request_errors_total{status}  every 4xx / 5xx answered (429 included)
  prompt_tokens_total, generation_tokens_total, num_requests_running, num_requests_waiting
dsv41's own, as totals (never "last request" gauges): expert slot lookups by result, Engram wait
seconds, DSpark drafted / accepted tokens and verify steps; memory per tier as the plan budgets it
(`source="plan"`, runtime/budget.py) and as measured (`source="measured"`: the resident set; CUDA's
allocated bytes on a GPU). No `*_created` series."""
from __future__ import annotations

import psutil
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()
LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
LENGTHS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
P = "dsv41:"


class Metrics:
    def __init__(self, planned: dict[str, int], model_name: str = "dsv41"):
        r = self.registry = CollectorRegistry()
        self.model = model_name
        lab = ["model_name"]

        def hist(name, doc, buckets=LAT):
            return Histogram(P + name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        def count(name, doc, extra=()):
            c = Counter(P + name, doc, lab + list(extra), registry=r)
            return c if extra else c.labels(model_name)

        def gauge(name, doc, extra=()):
            g = Gauge(P + name, doc, lab + list(extra), registry=r)
            return g if extra else g.labels(model_name)
        self.ttft = hist("time_to_first_token_seconds", "Time from the request's arrival to its first token")
        self.e2e = hist("e2e_request_latency_seconds", "Time from the request's arrival to its last token")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a request")
        self.queue_time = hist("request_queue_time_seconds", "Time a request waited in the queue")
        self.prefill_time = hist("request_prefill_time_seconds", "Time from the engine taking a request to its first token")
        self.decode_time = hist("request_decode_time_seconds", "Time from a request's first token to its last")
        self.prompt_len = hist("request_prompt_tokens", "Prompt length per request", LENGTHS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per request", LENGTHS)
        self._success = count("request_success", "Finished requests by finish reason", ["finished_reason"])
        self._errors = count("request_errors", "Requests answered with an error status", ["status"])
        self.prompt_tokens = count("prompt_tokens", "Prompt tokens processed")
        self.generated = count("generation_tokens", "Tokens generated")
        self.running = gauge("num_requests_running", "Requests being generated")
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the queue")
        self._lookups = count("expert_slot_lookups", "Expert slot-cache lookups in decode steps, by result", ["result"])
        self.engram_wait = count("engram_wait_seconds", "Time the forward pass waited for Engram rows")
        self.drafted = count("dspark_draft_tokens", "Tokens drafted by DSpark")
        self.accepted = count("dspark_accepted_tokens", "Drafted tokens the target accepted")
        self.verify_steps = count("dspark_verify_steps", "DSpark verify steps")
        self._memory = gauge("memory_bytes", "Memory per tier", ["tier", "source"])
        for tier, n in planned.items():
            self._memory.labels(model_name, tier, "plan").set(n)

    def success(self, reason: str) -> None:
        self._success.labels(self.model, reason).inc()

    def error(self, status: int) -> None:
        self._errors.labels(self.model, str(status)).inc()

    def lookups(self, hits: int, misses: int) -> None:
        self._lookups.labels(self.model, "hit").inc(hits)
        self._lookups.labels(self.model, "miss").inc(misses)

    def speculative(self, spec: dict) -> None:
        """A finished (or dropped) request's DSpark counters: steps, drafted, accepted."""
        self.drafted.inc(spec["drafted"])
        self.accepted.inc(spec["accepted"])
        self.verify_steps.inc(spec["steps"])

    def render(self) -> bytes:
        self._memory.labels(self.model, "host", "measured").set(psutil.Process().memory_info().rss)
        if torch.cuda.is_available():
            self._memory.labels(self.model, "device", "measured").set(torch.cuda.memory_allocated())
        return generate_latest(self.registry)
