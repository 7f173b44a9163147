"""Routing as data: a routing trace -> the slot cache's hit rate for every slot count, and the expected
number of distinct experts c tokens read per layer.

The runtime's slot cache (runtime/experts.py) starts with key k = (k % L, k // L) for k < slots (k = 0 the
most recent, so every slot count's warm set is the top of one LRU stack), then
per layer call looks up the call's distinct experts (a hit moves to most recent) and, with `offload`,
puts every miss (evicting the least recent); with `cpu` nothing is ever put (the warm set stays); with
`hybrid` the first round(f x misses) are put.
  LRU (offload): a key hits with S slots iff its stack distance (distinct keys used since its last use,
    counted before the call that uses it) is < S. The warm start is the stack after using keys
    k = L*E-1 .. 0 (so the S most recent are exactly k < S), uncounted. One pass gives every S. Exact
    but for one detail: within a call the runtime makes its hits most recent before its misses (the
    stack, in expert order); it matters only when a call's keys straddle the cache's edge
    (tests/autotune/test_routing.py holds the pass to an exact replay, `simulate`).
  static (cpu): a key hits iff its warm-start rank k = expert * L + layer is < S.
  hybrid: the cache replayed over the trace (simulate) on a grid of slot counts x fetch fractions,
    interpolated between them.
Only decode calls are counted (prefill calls move the cache, as they do in the runtime).
Union for c tokens: the mean over layers and windows of |experts of c consecutive tokens| (decode
tokens for c <= the decode tokens traced; else the prompt's tokens); for c concurrent sequences, c
decode tokens drawn at random positions (`union_independent`).
Without a trace: the uniform prior (independent, uniform routing): h = S / (L E) and
union(c) = E (1 - (1 - K/E)^c), flagged `assumed`.
"""
from __future__ import annotations

import numpy as np

UNIONS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _bit_add(tree, i, v):
    i += 1
    while i < len(tree):
        tree[i] += v
        i += i & -i


def _bit_sum(tree, i):           # sum of [0, i)
    s = 0
    while i > 0:
        s += tree[i]
        i -= i & -i
    return s


def stack_distances(trace) -> tuple[np.ndarray, np.ndarray]:
    """-> (LRU stack distance, warm-start rank) of every decode-phase access, in trace order."""
    L, E = trace.num_layers, trace.n_experts
    calls = [(layer, ph, sorted(set(np.asarray(ids).reshape(-1).tolist()))) for layer, ph, ids in trace.calls]
    n_time = L * E + sum(len(c[2]) for c in calls) + 1
    tree = np.zeros(n_time + 1, np.int64)
    last, now = {}, 0
    for k in range(L * E - 1, -1, -1):             # the warm start, most recent = rank 0
        last[(k % L, k // L)] = now
        _bit_add(tree, now, 1)
        now += 1
    dist, rank = [], []
    for layer, ph, need in calls:
        start = now
        if ph == "decode":
            for e in need:
                t = last[(layer, e)]
                dist.append(_bit_sum(tree, start) - _bit_sum(tree, t + 1))   # distinct keys used since, before this call
                rank.append(e * L + layer)
        for e in need:
            t = last[(layer, e)]
            _bit_add(tree, t, -1)
            _bit_add(tree, now, 1)
            last[(layer, e)] = now
            now += 1
    return np.asarray(dist, np.int64), np.asarray(rank, np.int64)


def simulate(trace, slots: int, strategy: str, fetch_fraction: float = 1.0) -> float:
    """The runtime's slot cache replayed exactly over the trace -> decode hit rate (slow: one slot count)."""
    from collections import OrderedDict
    L, E = trace.num_layers, trace.n_experts
    cache = OrderedDict(((k % L, k // L), None) for k in reversed(range(min(slots, L * E))))
    hits = total = 0
    for layer, ph, ids in trace.calls:
        need = sorted(set(np.asarray(ids).reshape(-1).tolist()))
        hit = [e for e in need if (layer, e) in cache]
        for e in hit:
            cache.move_to_end((layer, e))
        miss = [e for e in need if (layer, e) not in cache]
        if ph == "decode":
            hits, total = hits + len(hit), total + len(need)
        put = miss if strategy == "offload" else miss[:round(fetch_fraction * len(miss))] if strategy == "hybrid" else []
        for e in put if slots else []:        # a call wider than the cache runs in rounds: the last ones stay
            if len(cache) >= slots:
                cache.popitem(last=False)
            cache[(layer, e)] = None
    return hits / total if total else 0.0


HYBRID_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def slot_grid(L: int, E: int, K: int) -> list[int]:
    n, out, s = L * E, {0, L * E}, K
    while s < n:
        out.add(s)
        s = int(s * 1.25) + 1
    out.update(range(0, n + 1, max(1, n // 32)))
    return sorted(out)


def unions(trace) -> dict:
    """{c: mean distinct experts per layer over windows of c consecutive tokens}."""
    out = {}
    for c in UNIONS:
        vals = []
        for phase in ("decode", "prefill"):
            per_layer = {}
            for layer, ph, ids in trace.calls:
                if ph == phase:
                    per_layer.setdefault(layer, []).append(np.asarray(ids))
            for layer, parts in per_layer.items():
                rows = np.concatenate(parts)
                for w0 in range(0, len(rows) - c + 1, max(1, c // 2)):
                    vals.append(len(np.unique(rows[w0:w0 + c])))
            if vals:
                break                                # decode windows when there are enough decode tokens
        if vals:
            out[c] = float(np.mean(vals))
    return out


def unions_independent(trace, samples: int = 200, seed: int = 0) -> dict:
    """{c: mean distinct experts per layer over c decode tokens drawn at random positions}: c concurrent
    sequences' tokens share less than c consecutive tokens of one sequence."""
    rng = np.random.default_rng(seed)
    per_layer: dict = {}
    for layer, ph, ids in trace.calls:
        if ph == "decode":
            per_layer.setdefault(layer, []).append(np.asarray(ids))
    out = {}
    for c in UNIONS:
        vals = []
        for parts in per_layer.values():
            rows = np.concatenate(parts)
            if len(rows) >= c:
                vals += [len(np.unique(rows[rng.choice(len(rows), c, replace=False)])) for _ in range(max(1, samples // len(per_layer)))]
        if vals:
            out[c] = float(np.mean(vals))
    return out


def curve(trace) -> dict:
    """The profile's `routing` entry: hit rates on a slot grid for LRU and static, and the unions."""
    dist, rank = stack_distances(trace)
    L, E, K = trace.num_layers, trace.n_experts, trace.top_k
    grid = slot_grid(L, E, K)
    n = max(len(dist), 1)
    out = {"geometry": trace.geometry_hash, "layers": L, "experts": E, "top_k": K, "source": "measured",
            "decode_tokens": trace.tokens("decode"), "prefill_tokens": trace.tokens("prefill"),
            "slots": grid, "lru_hit": [float((dist < s).sum() / n) for s in grid],
            "static_hit": [float((rank < s).sum() / n) for s in grid],
            "hybrid_slots": grid[::max(1, len(grid) // 12)] + ([grid[-1]] if (len(grid) - 1) % max(1, len(grid) // 12) else []),
            "hybrid_fractions": list(HYBRID_FRACTIONS),
            "union": {str(c): u for c, u in unions(trace).items()},
            "union_independent": {str(c): u for c, u in unions_independent(trace).items()},
            "hybrid_hit": None,
            "note": "from a routing trace recorded through the runtime on this checkpoint (autotune/routing.py)"}
    out["hybrid_hit"] = [[simulate(trace, S, "hybrid", f) for S in out["hybrid_slots"]] for f in HYBRID_FRACTIONS]
    return out


class Routing:
    """Hit rate and union for one model: from a measured curve at its geometry, else the uniform prior."""

    def __init__(self, entry: dict | None, L: int, E: int, K: int):
        self.L, self.E, self.K = L, E, K
        self.entry = entry if entry and entry.get("layers") == L and entry.get("experts") == E and entry.get("top_k") == K else None
        self.source = "measured" if self.entry else "assumed"

    def hit(self, slots: int, strategy: str, fetch_fraction: float = 1.0) -> float:
        if slots <= 0:
            return 0.0
        if self.entry is None:
            return min(1.0, slots / (self.L * self.E))
        g = self.entry["slots"]
        lru = float(np.interp(slots, g, self.entry["lru_hit"]))
        static = float(np.interp(slots, g, self.entry["static_hit"]))
        if strategy == "offload":
            return lru
        if strategy == "cpu":
            return static
        hs, fs, grid = self.entry["hybrid_slots"], self.entry["hybrid_fractions"], self.entry["hybrid_hit"]
        at_f = [float(np.interp(slots, hs, row)) for row in grid]          # replayed at a grid of (S, f)
        return float(np.interp(fetch_fraction, fs, at_f))

    def union(self, c: float, independent: bool = False) -> float:
        """Expected distinct experts per layer for c tokens (c >= 1): consecutive tokens of one sequence,
        or (independent) c tokens of different sequences."""
        uniform = self.E * (1 - (1 - self.K / self.E) ** c)
        key = "union_independent" if independent else "union"
        if self.entry is None or c <= 1 or not self.entry.get(key):
            return uniform if c > 1 else float(self.K)
        pts = sorted((int(k), v) for k, v in self.entry[key].items())
        if c > pts[-1][0]:          # beyond the trace: the uniform law's remaining growth, from the last point
            return min(float(self.E), pts[-1][1] + uniform - self.E * (1 - (1 - self.K / self.E) ** pts[-1][0]))
        xs, ys = zip(*pts)
        return float(np.interp(np.log(c), np.log(xs), ys))
