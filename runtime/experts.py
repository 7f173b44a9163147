"""Expert placement under a Plan: host banks, the device slot cache, the hybrid split, the NVMe tier.

Backends implement routed(layer, m [T, H], ids [T, K], wts [T, K], shared) -> [T, H] (`shared`: the
layer's shared expert added).
  ReferenceExperts  every expert dequantized with plain torch (the ground truth, float64 by default), its
                    inputs quantized per 32-block to int8 as every path's are (kernels/formats.py)
  PlacedExperts     the plan's placement:
    host bank     per layer, the first experts up to host_expert_budget_gib (all by default), as ds_fp4
                  banks computed by the numba kernel; experts beyond it live on NVMe and are read on
                  demand: `expert_nvme_path` nvme_direct through the runtime's BatchedReader (one span
                  per expert, each tensor sliced at its own header offset), nvme_mmap through the page
                  cache (the checkpoint's mapping)
    prefill       `prefill_moe_path` device: wide calls stream through a staging buffer (staging.py)
    NVMe batches  a call's NVMe-tier experts are read and computed NVME_BATCH at a time (bounded buffers)
    slot cache    `slot_cache_experts` experts on the device, LRU over all layers, hit/miss counters;
                  filled at load with each layer's lowest expert ids (no routing statistics yet),
                  then by gathers. On a CPU-only host the device is the CPU and the cache still works.
    per layer     hits -> device; misses -> cpu: CPU kernel | offload: gather to the cache, device
                  | hybrid: the first round(f * misses) (ascending ids) gathered, the rest on the CPU,
                  overlapped (the CPU kernel runs in a worker thread; it releases the GIL)
Timing per phase: cpu_moe, gather, device_moe, nvme_read (seconds), and the per-layer dispatch cost.
"""
from __future__ import annotations

import time
import warnings
from collections import OrderedDict, defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from hostinfo import clamp_threads
from runtime.budget import NVME_BATCH
from kernels.cpu_moe import GROUP, Fp4Bank, expert_ffn
from kernels.router import with_row
from kernels.threads import concurrent_ok
from kernels.formats import dequantize_mxfp4, quantize_act
from runtime.checkpoint.reader import Checkpoint
from runtime.io_reader import BatchedReader
from runtime.model.weights import expert_from_span, expert_raw, expert_span
from runtime.plan import Plan
from runtime.staging import PrefillStream


class ReferenceExperts:
    """Plain torch over dequantized weights: y = sum_k w * down(silu(gate x) * up x)."""

    def __init__(self, ck: Checkpoint, dtype=torch.float64):
        self.ck, self.dtype, self._cache = ck, dtype, {}

    def _w(self, prefix):
        if prefix not in self._cache:
            raw = expert_raw(self.ck, prefix)
            self._cache[prefix] = [dequantize_mxfp4(torch.from_numpy(np.array(c)), torch.from_numpy(np.array(s)), self.dtype)
                                   for c, s in (raw["w1"], raw["w3"], raw["w2"])]
        return self._cache[prefix]

    def _ffn(self, prefix, x):
        w1, w3, w2 = self._w(prefix)
        x = quantize_act(x)                          # the int8-per-32 expert inputs every path uses
        return quantize_act(torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T

    def routed(self, layer, m, ids, wts, shared: bool = False):
        y = torch.zeros_like(m)
        for e in torch.unique(ids).tolist():
            t, k = (ids == e).nonzero(as_tuple=True)
            y.index_add_(0, t, self._ffn(f"layers.{layer}.ffn.experts.{e}", m[t]) * wts[t, k][:, None])
        return y + self._ffn(f"layers.{layer}.ffn.shared_experts", m) if shared else y

    def drafter_moe(self, k, m, ids, wts):
        y = self._ffn(f"mtp.{k}.ffn.shared_experts", m)
        for e in torch.unique(ids).tolist():
            t, j = (ids == e).nonzero(as_tuple=True)
            y.index_add_(0, t, self._ffn(f"mtp.{k}.ffn.experts.{e}", m[t]) * wts[t, j][:, None])
        return y


class NumbaSlots:
    """Slot memory on the CPU 'device': ds_fp4 arrays computed by the numba kernel."""

    def __init__(self, n, hidden, inter, kernel=None):
        z = np.zeros
        self.bank = Fp4Bank(z((n, 2 * inter, hidden // 2), np.uint8), z((n, 2 * inter, hidden // 32), np.uint8),
                            z((n, hidden, inter // 2), np.uint8), z((n, hidden, inter // 32), np.uint8), GROUP)
        self.kernel = kernel or {}            # expert_ffn's keywords: the plan's threads and kernel choices

    def put(self, slot, src: Fp4Bank, row):
        _same_layout(src, self.bank.group)
        for name in ("w13_codes", "w13_scales", "w2_codes", "w2_scales"):
            getattr(self.bank, name)[slot] = getattr(src, name)[row]

    def compute(self, x, ids, wts) -> np.ndarray:
        return expert_ffn(x, ids, wts, self.bank, **self.kernel)


def _same_layout(src: Fp4Bank, group: int) -> None:
    if src.group != group:
        raise ValueError(f"slot cache: an expert bank in layout group {src.group}, the slots hold group {group}")


class TritonSlots:
    """Slot memory as device tensors, computed by the Triton ds_fp4 kernel (kernels/triton_gpu.py):
    gate/up for every routed (slot, token), SwiGLU, down, router-weighted sum. On CUDA this is the
    GPU slot cache; on a CPU tensor it runs under TRITON_INTERPRET=1 (how it is tested here). The slots
    hold the host banks' bytes as they are (a gather is a copy): the kernel reads their layout (GROUP)."""

    def __init__(self, n, hidden, inter, device, group: int = GROUP):
        self.device, self.H, self.I, self.group = device, hidden, inter, group
        z = lambda *s: torch.zeros(*s, dtype=torch.uint8, device=device)  # noqa: E731
        self.w13c, self.w13s = z(n, 2 * inter, hidden // 2), z(n, 2 * inter, hidden // 32)
        self.w2c, self.w2s = z(n, hidden, inter // 2), z(n, hidden, inter // 32)

    def put(self, slot, src: Fp4Bank, row):
        _same_layout(src, self.group)
        for dst, a in ((self.w13c, src.w13_codes), (self.w13s, src.w13_scales), (self.w2c, src.w2_codes), (self.w2s, src.w2_scales)):
            dst[slot].copy_(torch.from_numpy(np.ascontiguousarray(a[row])), non_blocking=True)

    def compute(self, x, ids, wts) -> np.ndarray:
        from kernels.triton_gpu import fp4_slot_matmul
        xt = torch.as_tensor(x, device=self.device)
        y = torch.zeros_like(xt)
        pairs = [(int(ids[t, k]), t, k) for t, k in zip(*np.nonzero(ids >= 0))]
        slots = sorted({s for s, _, _ in pairs})
        groups = {s: [(t, k) for s2, t, k in pairs if s2 == s] for s in slots}
        Tm = max(len(g) for g in groups.values())
        xs = torch.zeros(len(slots), Tm, self.H, device=self.device)
        for m, s in enumerate(slots):
            for j, (t, _) in enumerate(groups[s]):
                xs[m, j] = xt[t]
        sl = torch.tensor(slots, device=self.device)
        h = fp4_slot_matmul(xs, self.w13c, self.w13s, sl, group=self.group)       # [M, Tm, 2I], inputs quantized
        g = h[..., :self.I]
        a = g / (1.0 + torch.exp(-g)) * h[..., self.I:]                          # SwiGLU as the CPU kernel writes it
        d = fp4_slot_matmul(a.contiguous(), self.w2c, self.w2s, sl, group=self.group)   # [M, Tm, H]
        for m, s in enumerate(slots):
            for j, (t, k) in enumerate(groups[s]):
                y[t] += float(wts[t, k]) * d[m, j]
        return y.cpu().numpy()


def slot_memory(n, hidden, inter, device: str, kernel=None):
    """The device slot cache's storage: Triton slots on CUDA (or when DSV41_SLOT_KERNEL=triton), else
    numba slots on the CPU, computed with `kernel` (expert_ffn's keywords, `PlacedExperts.kernel`)."""
    import os
    if device.startswith("cuda") or os.environ.get("DSV41_SLOT_KERNEL") == "triton":
        return TritonSlots(n, hidden, inter, device)
    return NumbaSlots(n, hidden, inter, kernel)


class SlotCache:
    """N device slots holding (layer, expert) pairs, LRU, with hit/miss counters."""

    def __init__(self, n: int, hidden: int, inter: int, device: str = "cpu", kernel=None):
        self.n = n
        self.mem = slot_memory(max(n, 1), hidden, inter, device, kernel)
        self.where: OrderedDict = OrderedDict()     # (layer, expert) -> slot, LRU order (oldest first)
        self.hits = self.misses = 0

    def lookup(self, key):
        s = self.where.get(key)
        if s is not None:
            self.where.move_to_end(key)
        return s

    def put(self, key, src: Fp4Bank, row: int) -> int:
        """Copy expert `row` of `src` into a slot (evicting the least recently used). -> slot."""
        if key in self.where:
            return self.lookup(key)
        slot = len(self.where) if len(self.where) < self.n else self.where.popitem(last=False)[1]
        self.mem.put(slot, src, row)
        self.where[key] = slot
        return slot


def _pinned(bank: Fp4Bank | None) -> Fp4Bank | None:
    """The same bank in page-locked memory (CUDA hosts); the numpy views keep the pinned tensors alive."""
    if bank is None:
        return None
    return Fp4Bank(*(torch.from_numpy(getattr(bank, k)).pin_memory().numpy()
                     for k in ("w13_codes", "w13_scales", "w2_codes", "w2_scales")), bank.group)


class PlacedExperts:
    def __init__(self, ck: Checkpoint, plan: Plan, reader: BatchedReader | None = None, device: str = "cpu"):
        cfg = ck.config
        self.ck, self.cfg, self.plan = ck, cfg, plan
        self.threads, why = clamp_threads(plan.cpu_threads)      # 0: every usable core; never more than usable
        if why:
            warnings.warn(f"plan: {why}", RuntimeWarning, stacklevel=2)
        # every CPU-MoE call's keywords: the threads and the plan's kernel choices, measured per host
        self.kernel = dict(threads=self.threads, streams=plan.cpu_moe_streams, inputs=plan.cpu_moe_inputs,
                           fetch=plan.cpu_moe_fetch)
        L, E, eb = cfg.num_hidden_layers, cfg.n_routed_experts, cfg.expert_bytes
        total = L * E if plan.host_expert_budget_gib is None else min(L * E, int(plan.host_expert_budget_gib * (1 << 30) // eb))
        per_layer = [total // L + (1 if i < total % L else 0) for i in range(L)]
        self.resident = per_layer                               # experts 0..resident[i]-1 in the host bank
        # one shared expert (the routed experts' shape) rides in the host bank as its last row: a layer's
        # CPU call computes it with its routed experts (`routed(..., shared=True)`); others: banks of their own
        rides = cfg.shared_rides
        self.shared_row = [per_layer[i] if rides else None for i in range(L)]
        self.host = [Fp4Bank.from_experts([expert_raw(ck, f"layers.{i}.ffn.experts.{e}") for e in range(per_layer[i])] +
                                          ([expert_raw(ck, f"layers.{i}.ffn.shared_experts")] if rides else []))
                     if per_layer[i] or rides else None for i in range(L)]
        if device.startswith("cuda"):        # pinned host banks: gathers become true async DMA copies
            self.host = [_pinned(b) for b in self.host]
        self.shared_bank = [Fp4Bank.from_experts([expert_raw(ck, f"layers.{i}.ffn.shared_experts")])
                            if cfg.n_shared_experts and not rides else None for i in range(L)]
        # the DSpark drafter's experts (its own MoE), loaded when the plan uses speculative decoding
        self.drafter = [Fp4Bank.from_experts([expert_raw(ck, f"mtp.{k}.ffn.experts.{e}") for e in range(cfg.dspark_n_routed_experts)])
                        for k in range(cfg.dspark_num_layers)] if plan.dspark else []
        self.drafter_shared = [Fp4Bank.from_experts([expert_raw(ck, f"mtp.{k}.ffn.shared_experts")])
                               for k in range(cfg.dspark_num_layers)] if plan.dspark and cfg.n_shared_experts else []
        nvme_direct = total < L * E and plan.expert_nvme_path == "nvme_direct"
        self.reader = reader if reader is not None else (BatchedReader(depth=8) if nvme_direct else None)
        self.nvme_bytes = defaultdict(int)    # expert bytes read from the NVMe tier, by path
        self.stream = (PrefillStream(plan, cfg, device, self.kernel, slot_memory)
                       if plan.prefill_moe_path == "device" else None)
        self.seconds = defaultdict(float)
        self.cache = SlotCache(plan.slot_cache_experts, cfg.hidden_size, cfg.moe_intermediate_size, device, self.kernel)
        for k in reversed(range(min(plan.slot_cache_experts, L * E))):   # warm start: lowest ids of each layer,
            i, e = k % L, k // L                                       # k = 0 most recent (autotune/routing.py)
            self.cache.put((i, e), *self._source(i, [e]))
        self.cache.hits = self.cache.misses = 0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv41-cpu-moe")
        self.overlap = concurrent_ok()        # the CPU share beside the device's (else in turn: kernels/threads.py)
        self.seconds.clear()
        self.layer_calls = 0
        self.experts_read = 0                 # routed experts read, summed over layer calls (the union per call)
        self.drafter_experts_read = 0         # the drafter's experts (top-k per drafted token and layer)
        self.gathered = 0                     # experts copied into the slot cache since load
        self.trace = None                     # a runtime.routing.RoutingTrace while recording

    # ------------------------------------------------------------------ sources
    def _source(self, layer, experts) -> tuple[Fp4Bank, int]:
        """(bank, row) for a single expert: the host bank, or read from NVMe."""
        bank, rows = self._fetch(layer, experts)
        return bank, rows[0]

    def _fetch(self, layer, experts) -> tuple[Fp4Bank, list]:
        """A bank holding `experts` of `layer` and each one's row in it (NVMe-tier experts are read)."""
        r = self.resident[layer]
        if all(e < r for e in experts):
            return self.host[layer], list(experts)
        t0 = time.perf_counter()
        prefixes = [f"layers.{layer}.ffn.experts.{e}" for e in experts]
        if self.plan.expert_nvme_path == "nvme_mmap":   # through the page cache: the checkpoint's mapping
            raws = [expert_raw(self.ck, p) for p in prefixes]
            bank = Fp4Bank.from_experts(raws)           # the copy is the read
        else:                                           # O_DIRECT batched reads, sliced per tensor
            spans = [expert_span(self.ck, p) for p in prefixes]
            blobs = self.reader.read(spans, reuse=True)                 # from_experts copies them
            bank = Fp4Bank.from_experts([expert_from_span(self.ck, p, b, s[1]) for p, b, s in zip(prefixes, blobs, spans)])
        self.nvme_bytes[self.plan.expert_nvme_path] += len(experts) * self.cfg.expert_bytes
        self.seconds["nvme_read"] += time.perf_counter() - t0
        return bank, list(range(len(experts)))

    # ------------------------------------------------------------------ compute
    def _run(self, bank, x, ids, wts, key):
        t0 = time.perf_counter()
        y = expert_ffn(x, ids, wts, bank, **self.kernel)
        self.seconds[key] += time.perf_counter() - t0
        return y

    def _subset(self, x, ids, wts, experts, rows, bank):
        """Run `experts` (mapped to `rows` of `bank`) for the tokens routed to them."""
        lut = np.full(self.cfg.n_routed_experts, -1, np.int64)
        lut[list(experts)] = rows
        sub = lut[ids]                                   # [T, K]: bank row, or -1 (skipped) for other experts
        return bank, sub, np.where(sub >= 0, wts, 0.0).astype(np.float32)

    def _groups(self, layer, experts, host: bool = False):
        """(bank, experts, rows): the host bank's experts in place (`host`: even none), then the NVMe
        tier's (only those read), NVME_BATCH at a time, so one call's read buffers stay bounded however wide it is."""
        r = self.resident[layer]
        nvme = [e for e in experts if e >= r]
        resident = [e for e in experts if e < r]
        if resident or host:
            yield self._batch(layer, resident)
        for i in range(0, len(nvme), NVME_BATCH):
            yield self._batch(layer, nvme[i:i + NVME_BATCH])   # no local keeps a batch alive while the next is read

    def _batch(self, layer, group):
        bank, rows = self._fetch(layer, group)
        return bank, group, rows

    def _cpu_part(self, layer, x, ids, wts, experts, shared: bool = False):
        """The CPU's share of a layer (runs in the worker thread, overlapping the device's share);
        `shared`: the shared expert too, in the host bank's call (weight 1, after the routed experts:
        the same sum as adding it to theirs)."""
        y, first = np.zeros_like(x), True
        for bank, group, rows in self._groups(layer, experts, host=shared):   # not enumerate(): its result
            bank, sub, w = self._subset(x, ids, wts, group, rows, bank)       # tuple holds the last batch while
            if shared and first:                                               # the next is read
                sub = np.concatenate([sub, np.full((len(x), 1), self.shared_row[layer], np.int64)], 1)
                w = np.concatenate([w, np.ones((len(x), 1), np.float32)], 1)
            y += self._run(bank, x, sub, w, "cpu_moe")
            first = False
            del bank, sub, w                  # before the next batch is read: one batch alive at a time
        return y

    def routed(self, layer, m, ids, wts, shared: bool = False):
        """The layer's routed experts for m [T, H] (ids, wts [T, K]), and with `shared` its shared
        expert(s) added: in the CPU call where it rides in the host bank, else its own call. -> [T, H]"""
        y = self.routed_np(layer, m.detach().to(torch.float32).cpu().numpy(), ids.cpu().numpy(),
                           wts.detach().to(torch.float32).cpu().numpy(), shared)
        return torch.from_numpy(y).to(device=m.device, dtype=m.dtype)

    def routed_np(self, layer, x, ids_np, w_np, shared: bool = False) -> np.ndarray:
        """`routed` on numpy arrays (x float32 [T, H], ids int64, w_np float32 [T, K]) -> float32 [T, H]."""
        t_layer = time.perf_counter()
        self.layer_calls += 1
        if self.trace is not None:
            self.trace.record(layer, ids_np)
        if self._host_only(layer, len(x)):   # every expert in the host bank, no slots: the one CPU call, no split
            ride = shared and self.shared_row[layer] is not None
            if ride:                                       # the shared expert after the routed ones (`_cpu_part`)
                sub, w, n = with_row(ids_np, w_np, self.shared_row[layer])
            else:
                sub, w, n = ids_np, w_np, len(np.unique(ids_np))
            self.experts_read += n                         # a verify batch reads the union of its tokens' experts
            self.cache.misses += n
            y = self._run(self.host[layer], x, sub, w, "cpu_moe")
            self.seconds["moe_layer_total"] += time.perf_counter() - t_layer
            return self._finish(layer, x, y, own_shared=shared and not ride)
        need = np.unique(ids_np).tolist()
        self.experts_read += len(need)
        if self.stream is not None and self.stream.wants(len(x)):   # a wide prefill call: stream to the device
            y = self.stream.run(self, layer, x, ids_np, w_np, need)
            self.seconds["moe_layer_total"] += time.perf_counter() - t_layer
            return self._finish(layer, x, y, own_shared=shared)
        hits = [e for e in need if self.cache.lookup((layer, e)) is not None]
        miss = [e for e in need if e not in hits]
        self.cache.hits += len(hits)
        self.cache.misses += len(miss)
        strat = self.plan.moe_strategy
        if strat == "cpu" or (strat == "hybrid" and self.cache.n == 0):
            to_dev, to_cpu = [], miss
        elif strat == "offload":
            to_dev, to_cpu = miss, []
        else:
            n = round(self.plan.fetch_fraction * len(miss))
            to_dev, to_cpu = miss[:n], miss[n:]
        dev_keys = hits + to_dev
        ride = shared and self.shared_row[layer] is not None
        if not dev_keys:                           # nothing for the device: the CPU share inline, no hand-off
            y = self._cpu_part(layer, x, ids_np, w_np, to_cpu, ride) if to_cpu or ride else np.zeros_like(x)
            self.seconds["moe_layer_total"] += time.perf_counter() - t_layer
            return self._finish(layer, x, y, own_shared=shared and not ride)
        y = np.zeros_like(x)
        fut = cpu_y = None
        if (to_cpu or ride) and self.overlap:      # overlapped with the device's share in the worker thread
            fut = self.pool.submit(self._cpu_part, layer, x, ids_np, w_np, to_cpu, ride)
        elif to_cpu or ride:                       # numba's layer is not threadsafe here: in turn, added last all the same
            cpu_y = self._cpu_part(layer, x, ids_np, w_np, to_cpu, ride)
        if dev_keys and not self.cache.n:          # offload with no cache: transient staging banks
            t0 = time.perf_counter()
            for bank, group, rows in self._groups(layer, dev_keys):
                job = self._subset(x, ids_np, w_np, group, rows, bank)
                y += expert_ffn(x, job[1], job[2], job[0], **self.kernel)
                del bank, job                 # one NVMe batch alive at a time
            self.seconds["device_moe"] += time.perf_counter() - t0
        # a call may need more distinct experts than there are slots (a wide prefill chunk, a long verify
        # batch): the device runs them in rounds of at most `n`, each round resident before it computes
        for r0 in range(0, len(dev_keys) if self.cache.n else 0, max(self.cache.n, 1)):
            y += self._device_round(layer, x, ids_np, w_np, dev_keys[r0:r0 + self.cache.n])
        if fut is not None:
            y += fut.result()
        if cpu_y is not None:
            y += cpu_y
        self.seconds["moe_layer_total"] += time.perf_counter() - t_layer
        return self._finish(layer, x, y, own_shared=shared and not ride)

    def _device_round(self, layer, x, ids_np, w_np, keys):
        """Make `keys` (<= slots) resident, touching the resident ones first so no put evicts them; then
        compute them on the device. -> [T, H]"""
        t0 = time.perf_counter()
        for e in keys:
            self.cache.lookup((layer, e))
        todo = [e for e in keys if (layer, e) not in self.cache.where]
        self.gathered += len(todo)
        for bank, group, rows in self._groups(layer, todo):
            for e, r in zip(group, rows):
                self.cache.put((layer, e), bank, r)
            del bank                          # one NVMe batch alive at a time
        slots = [self.cache.where[(layer, e)] for e in keys]
        self.seconds["gather"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        _, sub_ids, sub_w = self._subset(x, ids_np, w_np, keys, slots, None)
        y = self.cache.mem.compute(x, sub_ids, sub_w)
        self.seconds["device_moe"] += time.perf_counter() - t0
        return y

    def _host_only(self, layer, T: int) -> bool:
        """Whether this call is the host bank's alone: the CPU strategy (or hybrid without slots), no
        slot cache to look up, every expert of the layer resident, no prefill stream taking it."""
        return (self.cache.n == 0 and self.plan.moe_strategy in ("cpu", "hybrid") and self.host[layer] is not None
                and self.resident[layer] == self.cfg.n_routed_experts and not (self.stream is not None and self.stream.wants(T)))

    def _finish(self, layer, x, y, own_shared: bool) -> np.ndarray:
        """y [T, H] (the call's experts); `own_shared`: the shared expert added from a call of its own
        (`shared_moe`), where it does not ride in the host bank or the call streamed through the device."""
        if own_shared:
            bank, row = (self.host[layer], self.shared_row[layer]) if self.shared_row[layer] is not None else (self.shared_bank[layer], 0)
            y += self._run(bank, x, np.full((len(x), 1), row, np.int64), np.ones((len(x), 1), np.float32), "shared_moe")
        return y

    # ---------------------------------------------------------------- probes through this path
    def dispatch_seconds(self, layer: int, repeats: int = 20) -> list[float]:
        """The fixed cost of one MoE layer call under this plan's strategy (submit, wait, split, merge,
        per-call kernel overheads): one token's routed() call, its shared expert with it as a decode
        step runs it, minus the time its kernels and transfers ran, overlapped parts counted once (the
        CPU share, the shared expert's too, runs beside the gather + device compute). A device strategy
        starts every call from an empty slot cache, so every expert is a gather as in a decode step's
        misses. -> samples (s)."""
        H, K = self.cfg.hidden_size, self.cfg.num_experts_per_tok
        m = torch.randn(1, H, generator=torch.Generator().manual_seed(0))
        ids = torch.arange(K)[None] % self.cfg.n_routed_experts
        out = []
        for _ in range(repeats + 2):
            self.seconds.clear()
            self.cache.where.clear()
            self.routed(layer, m, ids, torch.full((1, K), 1.0 / K), shared=bool(self.cfg.n_shared_experts))
            s = self.seconds
            device = s["gather"] + s["device_moe"]
            beside = self.overlap and self.plan.moe_strategy != "cpu" and device > 0   # the CPU share ran in the worker
            busy = max(s["cpu_moe"], device) if beside else s["cpu_moe"] + device
            out.append(s["moe_layer_total"] - busy - s["nvme_read"])
        self.seconds.clear()
        return out[2:]

    def gather_seconds(self, layer: int, n_miss: int) -> float:
        """Time to gather `n_miss` host-resident experts of `layer` into an emptied slot cache (so every
        call, repeated, times a real gather; the host bank is the source, never the NVMe tier)."""
        resident = self.resident[layer]
        if not self.cache.n or min(self.cache.n, resident) < n_miss:
            raise ValueError(f"cannot gather {n_miss} experts: {self.cache.n} slots, {resident} resident in layer {layer}")
        self.cache.where.clear()
        self._gathers = getattr(self, "_gathers", 0) + 1
        todo = [(self._gathers * n_miss + i) % resident for i in range(n_miss)]
        t0 = time.perf_counter()
        for e in todo:
            self.cache.put((layer, e), self.host[layer], e)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def drafter_moe(self, k, m, ids, wts):
        """The drafter's own MoE (its experts live in host RAM, computed by the CPU kernel)."""
        x = m.detach().to(torch.float32).cpu().numpy()
        self.drafter_experts_read += len(set(ids.reshape(-1).tolist()))
        t0 = time.perf_counter()
        y = expert_ffn(x, ids.cpu().numpy(), wts.detach().to(torch.float32).cpu().numpy(), self.drafter[k], **self.kernel)
        if self.drafter_shared:
            y += expert_ffn(x, np.zeros((len(x), 1), np.int64), np.ones((len(x), 1), np.float32), self.drafter_shared[k],
                            **self.kernel)
        self.seconds["dspark_moe"] += time.perf_counter() - t0
        return torch.from_numpy(y).to(device=m.device, dtype=m.dtype)

    @property
    def hit_rate(self) -> float:
        n = self.cache.hits + self.cache.misses
        return self.cache.hits / n if n else 0.0

    def close(self):
        self.pool.shutdown()
        if self.reader:
            self.reader.close()
