"""The engine: a checkpoint + a Plan -> generate(prompt) with TTFT, tok/s and a phase table.

Prefill runs the prompt in chunks of `plan.prefill_chunk` (mode `full`: every layer over every
token; `bounded_replay`: the decoder only over the last window_size prompt tokens, inexact, opt-in);
decode runs one token per step. Sampling is greedy (temperature 0) or temperature sampling from a
seeded generator. `Engine(..., reference=True)` is the ground truth: float64, every expert
dequantized with plain torch, the whole prompt in one chunk (DSpark still runs when the plan asks:
greedy verification is lossless, and in float64 tests can check its bookkeeping bit for bit).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from hostinfo import cuda_available
from kernels.threads import blas_keeps_buffers
from runtime import budget
from runtime.budget import check_plan, check_request
from runtime.checkpoint.reader import Checkpoint
from runtime.engram_store import EngramStore
from runtime.memwatch import keep_freed_memory
from runtime.experts import PlacedExperts, ReferenceExperts
from runtime.model.transformer import Model
from runtime.model.weights import load_dense
from runtime.plan import Plan
from runtime.tokenizer import compressed_vocab


# The phases that do not nest in another (runtime/experts.py's cpu_moe, gather, ... run inside moe_layer_total).
TOP_PHASES = ("attention", "dense", "moe_layer_total", "shared_moe", "engram_wait", "dspark_draft")


def outside_phases(phases: dict, wall_s: float, layer_calls: int) -> dict:
    """The wall time no phase covers: per-layer Python (dispatch between the kernels, the layer loop),
    sampling, the residual stream. -> {"outside_phases": s, "outside_phases_per_layer_us": us}."""
    rest = max(0.0, wall_s - sum(phases.get(p, 0.0) for p in TOP_PHASES))
    return {"outside_phases": rest, "outside_phases_per_layer_us": rest / max(1, layer_calls) * 1e6}


@dataclass
class Result:
    tokens: list
    ttft_s: float
    decode_tok_s: float
    prefill_tok_s: float
    phases: dict                 # seconds per phase during decode (after the first token)
    prefill_phases: dict         # seconds per phase until the first token
    hit_rate: float              # the slot cache's, over the decode steps
    indexer_peak_bytes: int
    indexer_peak_formula_bytes: int
    logits: list = field(default_factory=list, repr=False)
    dspark: dict = field(default_factory=dict)    # steps, drafted, accepted, mean_accepted, ... (DSpark on)
    engram: dict = field(default_factory=dict)    # Engram counters over the request: rows, hits, reads, bytes
    slot_lookups: tuple = (0, 0)                  # the slot cache's (hits, misses) over the decode steps

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("logits")
        return d


def load_cmap(ck: Checkpoint) -> np.ndarray | None:
    cfg = ck.config
    if not cfg.engram_layer_ids:
        return None
    path = Path(ck.root) / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"{path}: missing; the Engram compressed vocabulary is derived from the tokenizer")
    cmap = compressed_vocab(Tokenizer.from_file(str(path)))
    if int(cmap.max()) + 1 != cfg.engram_compressed_vocab_size:
        raise ValueError(f"{path}: the tokenizer's compressed vocabulary has {int(cmap.max()) + 1} entries, the config's "
                         f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size}: tokenizer and tables disagree")
    return cmap


def draft_block(model, tok: int, hidden: list, d: int, temperature: float, gen) -> tuple[list, list]:
    """DSpark: d drafts from the last token and the target layers' hidden states at its position (each
    later step feeds the drafter its own output). -> (draft tokens, the drafter's distributions, None
    when greedy)."""
    drafts, qs, h = [], [], hidden
    for _ in range(d):
        dl, hx = model.draft(tok, h)
        q = torch.softmax(dl.to(torch.float64) / temperature, -1) if temperature > 0 else None
        tok = int(torch.multinomial(q, 1, generator=gen)) if q is not None else int(torch.argmax(dl))
        drafts.append(tok)
        qs.append(q)
        h = [hx] * len(hidden)
    return drafts, qs


def verify_drafts(V, drafts, qs, temperature, gen) -> tuple[int, int]:
    """The target's verdict on a draft block. V [d+1, vocab]: V[j] is the target's logits for the token
    after the j-th verified input; drafts [d]; qs: the drafter's distributions (temperature > 0).
    -> (accepted drafts a, the next token z). Greedy: keep while the draft is the target's argmax, z =
    the target's argmax after them (lossless). Sampling: accept y_j with probability min(1, p(y)/q(y)),
    else z ~ max(0, p - q) normalized; all accepted: z ~ p (the output distribution is exactly p)."""
    a = 0
    for j, y in enumerate(drafts):
        if temperature <= 0:
            if int(torch.argmax(V[j])) != y:
                return a, int(torch.argmax(V[j]))
        else:
            p = torch.softmax(V[j].to(torch.float64) / temperature, -1)
            if float(torch.rand((), generator=gen, dtype=torch.float64)) >= min(1.0, float(p[y] / qs[j][y])):
                resid = torch.clamp(p - qs[j], min=0)
                return a, int(torch.multinomial(resid / resid.sum(), 1, generator=gen))
        a += 1
    return a, Engine._sample(V[a], temperature, gen)


class Engine:
    def __init__(self, checkpoint, plan: Plan | None = None, reference: bool = False, device: str | None = None,
                 dense_kernel: str | None = None):
        self.ck = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        self.cfg = self.ck.config
        if self.cfg.expert_dtype != "fp4":
            raise ValueError(f"{self.ck.root}/config.json: expert_dtype '{self.cfg.expert_dtype}': the dsv41 runtime runs ds_fp4 "
                             "(fp4) experts only; plan it with `dsv41-tune plan --config`, serve it with another engine "
                             "(`dsv41-tune export`)")
        self.plan = plan or Plan()
        self.reference = reference
        self.footprint = self.ck.footprint()                # once: it walks every tensor's header entry
        dtype = torch.float64 if reference else torch.float32
        # dense weights and attention on the device (CUDA when present, else the CPU)
        self.device = "cpu" if reference else (device or ("cuda" if cuda_available() else "cpu"))
        # freed temporaries kept for the next layer, up to what the plan counts of them
        keep_freed_memory(budget.transient_bytes(self.plan, self.footprint, "cpu" if self.device == "cpu" else "host"))
        if blas_keeps_buffers():
            warnings.warn("torch was imported before dsv41 (kernels/__init__.py), so MKL keeps its GEMM buffers: a forward "
                          "holds some MB the plan does not count (they are handed back after it); import dsv41 first or "
                          "set MKL_DISABLE_FAST_MM=1", RuntimeWarning, stacklevel=2)
        if not reference:
            check_plan(self.plan, self.footprint, dense_on_host=self.device == "cpu")
        t0 = time.perf_counter()
        # fp8 linears as stored: numba on the CPU, Triton on CUDA (dense_kernel="triton" forces it: tests
        # run it on CPU tensors under TRITON_INTERPRET=1)
        kernel = dense_kernel or ("numba" if self.device == "cpu" else "triton")
        dense = load_dense(self.ck, dtype, self.device, keep_fp8=not reference, fp8_kernel=kernel)
        self.experts = ReferenceExperts(self.ck) if reference else PlacedExperts(self.ck, self.plan, device=self.device)
        p = self.plan
        self.engram = (EngramStore(self.ck) if reference else
                       EngramStore(self.ck, p.engram_placement, p.engram_io_depth, p.engram_row_cache_mib, p.engram_scales_in_ram,
                                   p.engram_io_engine)
                       ) if self.cfg.engram_layer_ids else None
        engram = self.engram
        self.model = Model(self.cfg, dense, self.experts, engram, load_cmap(self.ck), dtype, self.device)
        self.load_s = time.perf_counter() - t0

    def record_routing(self):
        """From now on every routed call is appended to the returned trace (runtime/routing.py), each
        request's prompt as `prefill`, its generated tokens as `decode`."""
        from runtime.routing import RoutingTrace
        c = self.cfg
        self.experts.trace = RoutingTrace(c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok, self.footprint.geometry_hash)
        return self.experts.trace

    def io_paths(self) -> dict:
        """How each NVMe tier reads here: 'o_direct', or 'buffered (why O_DIRECT was refused)', and the
        engine serving its reads ('uring', 'aio', 'threads'; 'auto' before its first read opens one)."""
        readers = {"experts": getattr(self.experts, "reader", None), "engram": getattr(self.engram, "reader", None)}
        return {k: r.path + (f" ({r.fallback_reason})" if r.fallback_reason else "") + f", {r.engine_shown}"
                for k, r in readers.items() if r is not None}

    def generate(self, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0,
                 keep_logits: bool = False, stop_ids=()) -> Result:
        """The whole request at once: `stream` run to its end."""
        it = self.stream(prompt, max_tokens, temperature, seed, keep_logits, stop_ids)
        while True:
            try:
                next(it)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0,
               keep_logits: bool = False, stop_ids=()):
        """Yield each token id as it is decided; return the Result (StopIteration.value). Generation ends
        after max_tokens or on a token in stop_ids (kept). Closing the generator frees the request."""
        plan, cfg, model = self.plan, self.cfg, self.model
        if max_tokens < 1 or not prompt:
            raise ValueError(f"a request needs a prompt and max_tokens >= 1 (got {len(prompt)} prompt tokens, max_tokens {max_tokens})")
        check_request(plan, len(prompt), max_tokens)
        self._phases(reset=True)
        if self.engram is not None:
            self.engram.counters.clear()
        gen = torch.Generator().manual_seed(seed)
        stop_ids = frozenset(stop_ids)
        if getattr(self.experts, "trace", None) is not None:
            self.experts.trace.phase = "prefill"
        st = model.new_state(len(prompt) + max_tokens, budget.spare(plan))
        chunk = len(prompt) if self.reference else plan.prefill_chunk
        replay = plan.prefill_mode == "bounded_replay" and not self.reference and cfg.num_encoder_layers
        dec_start = max(0, len(prompt) - cfg.window_size) if replay else 0
        out, logits_kept, spec = [], [], {}
        keep = logits_kept if keep_logits else None
        t0 = time.perf_counter()
        with torch.inference_mode():
            for c in range(0, len(prompt), chunk):
                logits = model.forward(st, prompt[c:c + chunk], decoder_start=dec_start)
            prefill_phases = self._phases(reset=True)
            prefill_phases.update(outside_phases(prefill_phases, time.perf_counter() - t0, cfg.num_hidden_layers * -(-len(prompt) // chunk)))
            t_dec0 = time.perf_counter()
            if getattr(self.experts, "trace", None) is not None:
                self.experts.trace.phase = "decode"
            cache = getattr(self.experts, "cache", None)
            hm0 = (cache.hits, cache.misses) if cache is not None else (0, 0)
            steps = (self._speculative(st, logits[-1], max_tokens, temperature, gen, keep, spec)
                     if plan.dspark and cfg.dspark_num_layers else
                     self._plain(st, logits[-1], max_tokens, temperature, gen, keep))
            for tok in steps:
                if not out:
                    t_first = time.perf_counter()
                out.append(tok)
                yield tok
                if tok in stop_ids:
                    break
            steps.close()
        t_end = time.perf_counter()
        decode_s, n = t_end - t_first, len(out)
        phases = self._phases(reset=True)
        phases.update(outside_phases(phases, t_end - t_dec0, cfg.num_hidden_layers * max(1, spec.get("steps", n - 1) if spec else n - 1)))
        return Result(out, t_first - t0, (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
                      len(prompt) / (t_first - t0), phases, prefill_phases,
                      self._decode_hit_rate(hm0),
                      st.indexer_peak_bytes,
                      budget.indexer_peak_bytes(self.footprint, chunk, len(prompt), torch.finfo(model.dtype).bits // 8),
                      logits_kept[:n], spec, dict(self.engram.counters) if self.engram is not None else {},
                      self._decode_lookups(hm0))

    def _plain(self, st, last, max_tokens, temperature, gen, keep):
        """One target pass per token."""
        for step in range(max_tokens):
            if keep is not None:
                keep.append(last.detach().clone())
            tok = self._sample(last, temperature, gen)
            yield tok
            if step + 1 < max_tokens:
                last = self.model.forward(st, [tok])[-1]

    def _speculative(self, st, last, max_tokens, temperature, gen, keep, stats):
        """DSpark: draft up to draft_length tokens, verify them in one target pass, keep the accepted
        prefix. Greedy: a draft is kept iff it is the target's argmax (lossless). Temperature > 0:
        standard speculative sampling (accept with min(1, p/q), else resample from max(0, p - q)), so
        the output distribution is the target's. Fills `stats` as it goes."""
        model, cfg, d_max = self.model, self.cfg, self.plan.draft_length
        targets = cfg.dspark_target_layer_ids
        x1 = self._sample(last, temperature, gen)
        if keep is not None:
            keep.append(last.detach().clone())
        stats.update(steps=0, drafted=0, accepted=0, verify_s=0.0, draft_s=0.0, mean_accepted=0.0, acceptance_rate=0.0)
        yield x1
        n = 1
        hid = [st.target_hidden[layer][-1] for layer in targets]
        self.state = st                                          # the live sequence (drafters may look)
        while n < max_tokens:
            d = min(d_max, max_tokens - n)
            t0 = time.perf_counter()
            drafts, qs = draft_block(model, x1, hid, d, temperature, gen)
            t1 = time.perf_counter()
            base = st.pos
            V = model.forward(st, [x1] + drafts, verify=True)      # [d+1, vocab]: V[j] predicts the token after
            t2 = time.perf_counter()
            a, z = verify_drafts(V, drafts, qs, temperature, gen)
            if keep is not None:
                keep.extend(V[j].detach().clone() for j in range(a + 1))
            st.rollback(base + 1 + a)
            hid = [st.target_hidden[layer][a] for layer in targets]
            x1 = z
            stats["steps"] += 1
            stats["drafted"] += d
            stats["accepted"] += a
            stats["draft_s"] += t1 - t0
            stats["verify_s"] += t2 - t1
            stats["mean_accepted"] = stats["accepted"] / stats["steps"]
            stats["acceptance_rate"] = stats["accepted"] / max(stats["drafted"], 1)
            for tok in (drafts[:a] + [z])[:max_tokens - n]:
                n += 1
                yield tok

    def _decode_lookups(self, hm0) -> tuple[int, int]:
        """The slot cache's (hits, misses) over this request's decode steps (experts looked up per layer call)."""
        cache = getattr(self.experts, "cache", None)
        return (0, 0) if cache is None else (cache.hits - hm0[0], cache.misses - hm0[1])

    def _decode_hit_rate(self, hm0) -> float:
        h, m = self._decode_lookups(hm0)
        return h / (h + m) if h + m else 0.0

    def _phases(self, reset: bool) -> dict:
        out = dict(self.model.phases.seconds)
        out.update(getattr(self.experts, "seconds", {}))
        if self.engram is not None and "wait_s" in self.engram.counters:
            out["engram_io_wait"] = self.engram.counters["wait_s"]
        if reset:
            self.model.phases.seconds.clear()
            if hasattr(self.experts, "seconds"):
                self.experts.seconds.clear()

        return out

    @staticmethod
    def _sample(logits, temperature, gen) -> int:
        if temperature <= 0:
            return int(torch.argmax(logits))
        p = torch.softmax(logits.to(device="cpu", dtype=torch.float64) / temperature, -1)   # the CPU's generator:
        return int(torch.multinomial(p, 1, generator=gen))                                  # one seed, one sample, any device

    def close(self):
        if hasattr(self.experts, "close"):
            self.experts.close()
        if self.engram is not None:
            self.engram.close()
