"""CPU expert FFN over ds_fp4 banks (numba): y[t] = sum_k w[t,k] * down_e(silu(gate_e x_t) * up_e x_t).

Weights are read in place in ds_fp4 (no full-precision copy of an expert); each expert input is
quantized per 32-block to int8 (kernels/formats.py `quantize_act`: the arithmetic of every expert path)
and the SIMD paths sum weight x input in integers, a whole 32-weight block per integer lane
(kernels/fp4_i8.py); the scalar path sums the same integers in plain loops, 4 code bytes at a time, so
its float rounding differs from the SIMD paths' (each path is the same bits for every plan). Shapes
that matter: decode (1 token x top-6 experts), DSpark verification (2-6 tokens whose experts overlap),
small batches, and prefill widths too. `expert_ffn_dense` (dequantize a tile, torch matmul) is the
benchmark's comparison only (benchmarks/cpu_moe.py): the runtime never takes it, because its rounding
differs from the kernel's, so a plan's prefill chunk would change which arithmetic a token gets (the
chunk is an exact knob); on the AMX Xeon VM it was also 16x slower at 16 tokens an expert, 7x at 64.

Bank layout (built by the runtime at load; FreeToken's layout):
  w13_codes [E, 2I, H/2] u8, w13_scales [E, 2I, H/32] u8   rows 0..I-1 = gate (w1), I..2I-1 = up (w3)
  w2_codes  [E, H, I/2]  u8, w2_scales  [E, H, I/32]  u8   down
with, on the paths in LANES_MODES, each GROUP rows' bytes repacked as lanes as rows (kernels/fp4_lanes.py:
the same shapes and bytes, moved; `Fp4Bank.group`, `Fp4Bank.rows` gives them back in rows' order). Those
paths run the lanes kernel for every width (decode, verify, prefill), so a token's output bits do not
depend on what is beside it; the others run the superblock kernel (kernels/fp4_i8.py).
Work is split over output rows: every output element is one ordered dot product and the expert sum
runs in a fixed order (experts ascending), so the result is bit-identical for any thread count.
The call releases the GIL (nogil) so the runtime can overlap it with other work.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import numba
from numba import njit, prange, types
from llvmlite import ir
from numba.extending import intrinsic, overload

from hostinfo import isa, l1d_bytes
from kernels import ISA_CACHE
from kernels.formats import dequantize_mxfp4, quantize_act
from kernels.fp4_i8 import LUT16, OFFSET, ROWS_FIRST, fp4_i8_dot, superblock_bytes
from kernels.fp4_lanes import BLOCK_ENTRIES, FAR, FAR_ALONE, FETCHES, NEAR, fp4_lanes_dot, group_rows, to_lanes, to_rows
from kernels.fp4_simd import E2M1, fp4_dequant
from kernels.probe_bank import expert_bytes
from kernels.threads import set_threads

ISA = isa()                  # the host's widest path, or $DSV41_CPU_ISA (hostinfo)
LANES = {"avx512vbmi": 16, "avx512vnni": 16, "avx512": 16, "avx2vnni": 8, "avx2": 8, "scalar": 0}[ISA]   # compile-time constants
MODE = {"avx512vbmi": 4, "avx512vnni": 3, "avx512": 2, "avx2vnni": 5, "avx2": 1, "scalar": 0}[ISA]        # fp4_i8_dot's path
SUPERBLOCK = superblock_bytes(MODE)                                      # the inputs' layout (kernels/fp4_i8.py)
# The banks' layout on this path: lanes as rows (kernels/fp4_lanes.py), GROUP rows a vector, where it was
# measured against the superblock kernel; 0 keeps rows in order. Zen 4 VM, 2 threads, V4.1 geometry, each
# path forced (kernels/lab/lanes_ab.py; kernels/lab/README.md "lanes as rows in the package"): batch 1
# 0.92-1.02x before the lanes kernel's L1 prefetch (kernels/fp4_lanes.py L1_AHEAD), 0.95-1.05x with it;
# verify 4-8 1.05-1.78x, 16-64 tokens 0.99-1.71x. AVX2 + AVX-VNNI (5) was not measured: no host here has it.
LANES_MODES = (1, 2, 3, 4)
GROUP = group_rows(MODE) if MODE in LANES_MODES else 0
# Compiled code is cached on disk for the host's path, and for a forced path where it has a cache
# directory of its own (kernels/__init__.py); else a forced path (tests) compiles in memory, so no
# directory ever holds two paths' code under the one key numba gives them (CPU name + features).
CACHE = "DSV41_CPU_ISA" not in os.environ or ISA_CACHE
ROWS_PER_CHUNK = 64          # rows per parallel work item (multiple of 4)
ROW_STREAMS = (1, 4)         # DRAM streams a thread reads at once: rows in order, or 4 rows a quarter-chunk apart
DEFAULT_STREAMS = 1          # where nothing was measured: rows in order won on 3 of the 4 hosts measured (kernels/lab/README.md)
ROW_INPUTS = (4, 8)          # the most inputs one row decode serves with rows in order (4 rows apart: always 4)
DEFAULT_INPUTS = 4           # where nothing was measured: 8 won on the Emerald Rapids VM, 4 on the Zen 4 VM (`_rows`)
DEFAULT_FETCH = "far"        # where nothing was measured: the lanes kernel's fetching (kernels/fp4_lanes.py FETCHES)
# Rows in order go in pairs for a slot of 2 inputs or more where the path decodes 2 rows before loading its
# inputs (AVX-512's 32 registers; kernels/fp4_i8.py ROWS_FIRST): each input vector loaded serves both rows.
# The same bits (each output is one `_dot` of its row and input). Zen 4 VM, 2 threads, fresh rows from DRAM
# (kernels/lab/fp4_row_pairs.py), of one row with its inputs loaded first: 1.05-1.11x at 3-4 inputs, 1.3-2x
# at 5-8; 0.93 at 1 input, so not there.
PAIRS = ROWS_FIRST[MODE] >= 2 if MODE else False


def l1_input_bytes() -> int:
    """What a slot's inputs may take before `_matvecs_wide` passes them over the rows in blocks: 7/8 of this
    core's L1 data cache, the rest left to the row passing through (the L1D is a host fact: hostinfo,
    `DSV41_L1D_KIB`). On the Zen 4 VM (32 KiB) 5 inputs of 5120 bytes ran faster as one block, 6 as
    blocks of 4 (kernels/lab/README.md)."""
    return l1d_bytes() * 7 // 8


STAB = np.array([np.float32(2.0) ** (b - 127) if b != 255 else np.nan for b in range(256)], dtype=np.float32)
E2M1_F32 = np.array(E2M1, dtype=np.float32)
LUT_I32 = np.array(LUT16, dtype=np.int32)


@dataclass(frozen=True)
class Fp4Bank:
    """A bank of E experts in ds_fp4 (see module docstring for shapes). group: the layout of its bytes, 0
    for rows in order (the checkpoint's), R for lanes as rows (kernels/fp4_lanes.py; the shapes are the
    same). The runtime builds its banks in this path's layout (`GROUP`: from_experts, random)."""
    w13_codes: np.ndarray
    w13_scales: np.ndarray
    w2_codes: np.ndarray
    w2_scales: np.ndarray
    group: int = 0

    def __post_init__(self):
        E, I2, Hh = self.w13_codes.shape
        H, I = 2 * Hh, I2 // 2
        want = {"w13_scales": (E, I2, H // 32), "w2_codes": (E, H, I // 2), "w2_scales": (E, H, I // 32)}
        for k, shape in want.items():
            a = getattr(self, k)
            if a.shape != shape or a.dtype != np.uint8:
                raise ValueError(f"Fp4Bank.{k} is {a.dtype}{a.shape}, expected uint8{shape}")
        for k in ("w13_codes", "w13_scales", "w2_codes", "w2_scales"):
            if not getattr(self, k).flags.c_contiguous:
                raise ValueError(f"Fp4Bank.{k} must be C-contiguous")
        if H % 32 or I % 32:
            raise ValueError(f"hidden ({H}) and intermediate ({I}) must be multiples of 32")
        if self.group not in (0, 8, 16):
            raise ValueError(f"Fp4Bank.group must be 0 (rows in order), 8 or 16 (lanes as rows), got {self.group}")

    @property
    def n_experts(self) -> int:
        return self.w13_codes.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13_codes.shape[2] * 2

    @property
    def inter(self) -> int:
        return self.w13_codes.shape[1] // 2

    @property
    def expert_bytes(self) -> int:
        """Bytes one expert's evaluation reads: 3*H*I*(1/2 + 1/32)."""
        return expert_bytes(self.hidden, self.inter)

    @classmethod
    def from_experts(cls, experts, group: int | None = None) -> "Fp4Bank":
        """experts: list of dicts {w1, w2, w3: (codes u8, scales u8)} as stored in the checkpoint (rows in
        order). Copied once, straight into the bank's arrays in layout `group` (default: this path's,
        `GROUP`); no temporaries: the bank is all it allocates."""
        group = GROUP if group is None else group
        (c1, s1), (c2, s2) = experts[0]["w1"], experts[0]["w2"]
        I, E = np.shape(c1)[0], len(experts)
        w13c = np.empty((E, 2 * I) + np.shape(c1)[1:], np.uint8)
        w13s = np.empty((E, 2 * I) + np.shape(s1)[1:], np.uint8)
        w2c, w2s = np.empty((E,) + np.shape(c2), np.uint8), np.empty((E,) + np.shape(s2), np.uint8)

        def put(codes, scales, c, s):
            if group:
                to_lanes(np.asarray(c), np.asarray(s), group, out=(codes, scales))
            else:
                codes[...], scales[...] = c, s
        for i, e in enumerate(experts):        # gate and up rows apart: whole groups each (I % 32 == 0)
            put(w13c[i, :I], w13s[i, :I], *e["w1"])
            put(w13c[i, I:], w13s[i, I:], *e["w3"])
            put(w2c[i], w2s[i], *e["w2"])
        return cls(w13c, w13s, w2c, w2s, group)

    @classmethod
    def random(cls, n_experts: int, hidden: int, inter: int, seed: int = 0, group: int | None = None) -> "Fp4Bank":
        """Random codes with scales giving weight RMS ~1/sqrt(fan_in) (tests and benchmarks), labelled
        layout `group` (default this path's: random bytes are random in either)."""
        rng = np.random.default_rng(seed)
        def codes(*shape):
            return random_bytes(rng, shape)
        def scales(fan_in, *shape):
            e = 127 + int(round(np.log2(1 / (np.sqrt(fan_in) * 2.93))))
            return (e + rng.integers(-1, 2, size=shape)).astype(np.uint8)
        E, H, I = n_experts, hidden, inter
        return cls(codes(E, 2 * I, H // 2), scales(H, E, 2 * I, H // 32), codes(E, H, I // 2), scales(I, E, H, I // 32),
                   GROUP if group is None else group)

    def rows(self, name: str, e=slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """(codes, scales) of "w13" or "w2" for expert(s) e in rows' order (the checkpoint's layout)."""
        c, s = getattr(self, name + "_codes")[e], getattr(self, name + "_scales")[e]
        return to_rows(c, s, self.group) if self.group else (c, s)

    def laid_out(self, group: int | None = None) -> "Fp4Bank":
        """This bank's bytes in layout `group` (default this path's, `GROUP`): a copy, or itself if already so."""
        group = GROUP if group is None else group
        if group == self.group:
            return self
        (c13, s13), (c2, s2) = self.rows("w13"), self.rows("w2")
        if group:
            (c13, s13), (c2, s2) = to_lanes(c13, s13, group), to_lanes(c2, s2, group)
        return Fp4Bank(np.ascontiguousarray(c13), np.ascontiguousarray(s13), np.ascontiguousarray(c2), np.ascontiguousarray(s2), group)

    def expert_weights(self, e: int, dtype=torch.float64):
        """(w1 [I, H], w3 [I, H], w2 [H, I]) dequantized: the reference's view of expert e."""
        I = self.inter
        w13 = dequantize_mxfp4(*(torch.from_numpy(a) for a in self.rows("w13", e)), dtype)
        w2 = dequantize_mxfp4(*(torch.from_numpy(a) for a in self.rows("w2", e)), dtype)
        return w13[:I], w13[I:], w2


def random_bytes(rng, shape, chunk=1 << 26) -> np.ndarray:
    """Random uint8 [shape] in an array numpy allocates (it asks for transparent huge pages on large
    ones, as for the runtime's banks; a buffer from Python bytes gets 4 KiB pages and reads slower)."""
    a = np.empty(shape, np.uint8)
    flat = a.reshape(-1)
    for i in range(0, flat.size, chunk):
        n = min(chunk, flat.size - i)
        flat[i:i + n] = np.frombuffer(rng.bytes(n), np.uint8)
    return a


# ----------------------------------------------------------------------------------------- kernels
@njit(nogil=True, cache=CACHE)
def _dot_scalar(R, codes, c_off, c_stride, scales, s_off, s_stride, xq, xc, xr, a, K, out, o_off, or_stride):
    """fp4_i8_dot's arithmetic in plain loops (one input; the scalar path has no superblocks, so every
    entry is 4 code bytes): per 4 code bytes an exact integer sum."""
    half = K // 2
    for r in range(R):
        acc = np.float32(0.0)
        for L in range(half // 4):
            s = STAB[scales[s_off + r * s_stride + L // 4]]
            p = np.int32(0)
            for b in range(4 * L, 4 * L + 4):
                c = codes[c_off + r * c_stride + b]
                p += LUT_I32[c & 15] * np.int32(xq[a * K + b]) + LUT_I32[c >> 4] * np.int32(xq[a * K + half + b])
            acc += np.float32(p + xc[a * (K // 8) + L]) * (s * xr[a * (K // 8) + L])
        out[o_off + r * or_stride] = acc


@njit(nogil=True, cache=CACHE)
def _plan_slots(ids, n_experts):
    """Group (token, k) assignments by expert, ascending; id -1 is no assignment (skipped). Packed, no
    padding: slot s owns assignments off[s]..off[s+1]-1 (scratch = assignments x width, exactly), each
    slot's in (token, k) order. -> experts [S], off [S+1], tok [A], kk [A].
    O(A log A) in the call's A assignments, nothing the size of the bank: a per-expert count over the
    bank cost the profiler's 64x64 probe (a bank of 308 k experts, 4x a 480 MiB LLC) ~0.6 ms a call,
    16x the runtime's whole MoE layer there, and the tiny model's predicted MoE term with it."""
    T, K = ids.shape
    key = np.empty(T * K, np.int64)                # e T K + t K + k: distinct, so sorted in one order
    A = 0
    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            if e == -1:
                continue
            if e < 0 or e >= n_experts:
                raise ValueError("expert id out of range for the bank")
            key[A] = e * (T * K) + t * K + k
            A += 1
    key = np.sort(key[:A])
    experts, off = np.empty(A, np.int64), np.empty(A + 1, np.int64)
    tok, kk = np.empty(A, np.int64), np.empty(A, np.int64)
    S = 0
    for a in range(A):
        e, tk = key[a] // (T * K), key[a] % (T * K)
        if S == 0 or e != experts[S - 1]:
            experts[S], off[S] = e, a
            S += 1
        tok[a], kk[a] = tk // K, tk % K
    off[S] = A
    return experts[:S], off[:S + 1], tok, kk


def _dot(R, T, mode, codes, c_off, c_stride, scales, s_off, s_stride, xq, xc, xr, a0, K, out, o_off, o_stride, or_stride):
    """R rows x T inputs: the SIMD intrinsic for modes 1-3, plain loops for mode 0 (compiled only)."""
    raise NotImplementedError("numba-only")


@overload(_dot, prefer_literal=True, inline="always")
def _ov_dot(R, T, mode, codes, c_off, c_stride, scales, s_off, s_stride, xq, xc, xr, a0, K, out, o_off, o_stride, or_stride):
    if not all(isinstance(a, types.IntegerLiteral) for a in (R, T, mode)):
        return None
    if mode.literal_value == 0:
        def scalar(R, T, mode, codes, c_off, c_stride, scales, s_off, s_stride, xq, xc, xr, a0, K, out, o_off, o_stride, or_stride):
            for j in range(T):
                _dot_scalar(R, codes, c_off, c_stride, scales, s_off, s_stride, xq, xc, xr, a0 + j, K, out, o_off + j * o_stride, or_stride)
        return scalar

    def simd(R, T, mode, codes, c_off, c_stride, scales, s_off, s_stride, xq, xc, xr, a0, K, out, o_off, o_stride, or_stride):
        fp4_i8_dot(R, T, mode, codes, c_off, c_stride, scales, s_off, s_stride, xq, xc, xr, a0, K, out, o_off, o_stride, or_stride)
    return simd


def _deq(lanes, codes, c_off, scales, s_off, stab, ng, out, o_off):
    raise NotImplementedError("numba-only")


@overload(_deq, prefer_literal=True, inline="always")
def _ov_deq(lanes, codes, c_off, scales, s_off, stab, ng, out, o_off):
    if not isinstance(lanes, types.IntegerLiteral):
        return None
    if lanes.literal_value == 0:
        return lambda lanes, codes, c_off, scales, s_off, stab, ng, out, o_off: \
            _deq_scalar(codes, c_off, scales, s_off, stab, ng, out, o_off)
    return lambda lanes, codes, c_off, scales, s_off, stab, ng, out, o_off: \
        fp4_dequant(lanes, codes, c_off, scales, s_off, stab, ng, out, o_off)


@njit(nogil=True, cache=CACHE)
def _deq_scalar(codes, c_off, scales, s_off, stab, ng, out, o_off):
    for g in range(ng):
        sc = stab[scales[s_off + g]]
        for j in range(16):
            b = codes[c_off + g * 16 + j]
            out[o_off + g * 32 + 2 * j] = E2M1_F32[b & 15] * sc
            out[o_off + g * 32 + 2 * j + 1] = E2M1_F32[b >> 4] * sc


@njit(nogil=True, cache=CACHE, inline="always")
def _chunk(cf, sf, qf, cxf, rf, e, N, K, r0, r1, j0, j1, of, streams, inputs):
    """Rows r0..r1-1 of expert e against inputs j0..j1-1 in the row layout `streams` (rows in order, in
    pairs where the path decodes two rows before loading the inputs and there are 2 inputs or more,
    `PAIRS`; or 4 rows a quarter-chunk apart), up to `inputs` inputs a row decode."""
    c_row, s_row = K // 2, K // 32
    if streams != 1:
        q = (r1 - r0) // 4                                 # N is a multiple of 32: whole 4-row blocks
        for r in range(r0, r0 + q):                        # rows r, r+q, r+2q, r+3q: 4 DRAM streams
            _rows(4, 4, cf, (e * N + r) * c_row, q * c_row, sf, (e * N + r) * s_row, q * s_row, qf, cxf, rf, j0, j1, K, of, r, N, q)
    elif PAIRS and j1 - j0 > 1 and inputs == 8:
        for r in range(r0, r1, 2):
            _rows(2, 8, cf, (e * N + r) * c_row, c_row, sf, (e * N + r) * s_row, s_row, qf, cxf, rf, j0, j1, K, of, r, N, 1)
    elif PAIRS and j1 - j0 > 1:
        for r in range(r0, r1, 2):
            _rows(2, 4, cf, (e * N + r) * c_row, c_row, sf, (e * N + r) * s_row, s_row, qf, cxf, rf, j0, j1, K, of, r, N, 1)
    elif inputs == 8:
        for r in range(r0, r1):
            _rows(1, 8, cf, (e * N + r) * c_row, 0, sf, (e * N + r) * s_row, 0, qf, cxf, rf, j0, j1, K, of, r, N, 0)
    else:
        for r in range(r0, r1):
            _rows(1, 4, cf, (e * N + r) * c_row, 0, sf, (e * N + r) * s_row, 0, qf, cxf, rf, j0, j1, K, of, r, N, 0)


# A work item's cost in the threads' split (`_spans`): its rows' read, worth ITEM_READ inputs' products,
# plus one per input (an estimate, not swept: on the Zen 4 VM a call of ~4-6 inputs a slot is where
# reading and the products take about as long). Zen 4 VM, V4.1 geometry, 2 threads, 256 tokens x top-6
# of 32 experts (one prefill chunk's call): 172 ms with uniform routing, 259 ms with the hot experts
# first (78% of the assignments in experts 0-15) when every thread took an equal count of items, 172
# with this split.
ITEM_READ = 4


@njit(nogil=True, cache=CACHE)
def _spans(off, per, nt):
    """The items (slot s, row chunk k: c = s per + k, slot-major) cut into nt contiguous spans of equal
    cost (`ITEM_READ` + the slot's inputs, per item): thread t takes items b[t]..b[t+1]-1, then helps
    the others from their spans' ends (`_next`). With an equal count per thread a call whose busy
    experts came first left one thread idle most of the call; contiguous spans keep each thread's
    reads in order. Which thread computes an output changes no bit."""
    S = len(off) - 1
    b = np.zeros(nt + 1, np.int64)
    if S == 0:
        return b
    cum = np.zeros(S + 1, np.int64)                      # cost of slots 0..s-1, each per items
    for s in range(S):
        cum[s + 1] = cum[s] + per * (ITEM_READ + off[s + 1] - off[s])
    b[nt] = S * per
    for t in range(1, nt):
        target = cum[S] * t // nt
        s = min(max(np.searchsorted(cum, target, side="right") - 1, 0), S - 1)
        unit = ITEM_READ + off[s + 1] - off[s]
        b[t] = max(b[t - 1], min(s * per + (target - cum[s] + unit - 1) // unit, S * per))
    return b


@njit(nogil=True, cache=CACHE, inline="always")
def _item(c, per, N):
    """Item c of `_spans` -> (slot s, its rows r0..r1-1): chunk c % per of slot c // per."""
    r0 = (c % per) * ROWS_PER_CHUNK
    return c // per, r0, min(r0 + ROWS_PER_CHUNK, N)


@intrinsic
def _claim(typingctx, flags, c):
    """Mark item c of `flags` (int32 [items], zeroed) taken, atomically -> whether this call took it."""
    sig = types.boolean(flags, c)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        old = builder.atomic_rmw("xchg", builder.gep(arr.data, [args[1]]), ir.Constant(ir.IntType(32), 1), "seq_cst")
        return builder.icmp_signed("==", old, ir.Constant(ir.IntType(32), 0))
    return sig, codegen


@njit(nogil=True, cache=CACHE, inline="always")
def _next(taken, b, t, k, i):
    """Thread t's next item from `_spans`' b, claimed in `taken` (int32 [items], zeroed): the i-th of span
    (t + k) % nt, its own (k = 0) from the front, then the others' from their ends -> (item c, k, i), c = -1
    when nothing is left; call again with (k, i + 1). Each item is claimed with `_claim`, and a span is left at
    the first item found taken: the owner and the one thread stealing from the back meet with nothing
    skipped, so the threads finish together however their reads ran (one thread of 2 idled a median 5%,
    mean 8% of each pass of a batch-1 step on the Zen 4 VM; 0.3% this way, 1.02 (0.98-1.11) the speed:
    kernels/lab/README.md, "an eleventh time"). Which thread computes an item changes no bit."""
    nt = len(b) - 1
    while k < nt:
        u = (t + k) % nt
        if i < b[u + 1] - b[u]:
            c = b[u] + i if k == 0 else b[u + 1] - 1 - i
            if _claim(taken, c):
                return c, k, i
        k, i = k + 1, 0
    return -1, k, i


@njit(parallel=True, nogil=True, cache=CACHE)
def _matvecs(codes, scales, experts, off, xq, xc, xr, out, streams, inputs, nt):
    """out[a, r] = W_{experts[s]}[r] . x(a) for assignments a of slot s (off[s] <= a < off[s+1]);
    inputs prepared by `_prepare` (xq [A, K], xc and xr [A, K/8]), out [A, N]. streams (ROW_STREAMS):
    4 reads rows r, r+q, r+2q, r+3q of a chunk together (4 DRAM streams per thread), 1 reads them in
    order (one stream); which is faster is a fact of the host (the profiler measures both). Each row's
    arithmetic is the same either way: the outputs are bit-identical. inputs (ROW_INPUTS): the most
    inputs one row decode serves with rows in order; the same bits either way too. nt: the threads the
    items are split over (`_spans`: numba's count, passed in, as reading it here would keep the kernel
    from numba's cache)."""
    N = out.shape[1]
    K = xq.shape[1]
    qf, cxf, rf = xq.reshape(-1), xc.reshape(-1), xr.reshape(-1)
    of = out.reshape(-1)
    cf = codes.reshape(-1)
    sf = scales.reshape(-1)
    per = (N + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK
    b = _spans(off, per, nt)
    taken = np.zeros(b[nt], np.int32)
    for t in prange(nt):
        c, k, i = _next(taken, b, t, 0, 0)
        while c >= 0:
            s, r0, r1 = _item(c, per, N)
            _chunk(cf, sf, qf, cxf, rf, experts[s], N, K, r0, r1, off[s], off[s + 1], of, streams, inputs)
            c, k, i = _next(taken, b, t, k, i + 1)


@njit(parallel=True, nogil=True, cache=CACHE)
def _matvecs_wide(codes, scales, experts, off, xq, xc, xr, out, streams, inputs, l1_inputs, nt):
    """`_matvecs` for a call with a slot whose inputs (K bytes each) pass l1_inputs bytes
    (`l1_input_bytes`): there a block of inputs passes over the chunk's rows, then the next block over
    the same rows (from L2), so the block's inputs stay in L1 while the rows pass (8 inputs a decode
    where 8 fit, else 4); a slot that fits meets each row once. In `_matvecs` each row meets all its
    slot's inputs, which for a wide slot then come from L2 for every row: one expert's pass at 8-64
    inputs on the Zen 4 VM (32 KiB L1D) ran 1.2-1.3x faster this way, the same bits (kernels/lab/README.md).
    A function of its own: the block loop inside `_matvecs` slowed its batch-1 calls by 3-14% in L3
    (the code around the inlined dot kernels changed), and batch 1 never needs it."""
    N = out.shape[1]
    K = xq.shape[1]
    qf, cxf, rf = xq.reshape(-1), xc.reshape(-1), xr.reshape(-1)
    of = out.reshape(-1)
    cf = codes.reshape(-1)
    sf = scales.reshape(-1)
    per = (N + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK
    b = _spans(off, per, nt)
    taken = np.zeros(b[nt], np.int32)
    for t in prange(nt):
        c, k, i = _next(taken, b, t, 0, 0)
        while c >= 0:
            s, r0, r1 = _item(c, per, N)
            e = experts[s]
            B = off[s + 1] - off[s]
            if B * K > l1_inputs:
                B = inputs if streams == 1 and inputs * K <= l1_inputs else 4
            for j0 in range(off[s], off[s + 1], B):
                _chunk(cf, sf, qf, cxf, rf, e, N, K, r0, r1, j0, min(j0 + B, off[s + 1]), of, streams, inputs)
            c, k, i = _next(taken, b, t, k, i + 1)


@njit(parallel=True, nogil=True, cache=CACHE)
def _matvecs_lanes(codes, scales, experts, off, xq, xc, xr, out, streams, inputs, nt, near):
    """`_matvecs` over a bank in the lanes layout (`GROUP` rows a group; inputs prepared without
    superblocks). A chunk's rows go a group at a time, or (streams 4) its 4 groups in one call: 4 DRAM
    streams per thread, each input's broadcast serving all 4. The slot's inputs go `inputs` a call, each
    block over the chunk's groups before the next, so a block stays in L1 while the rows pass (from L2
    after the first block). Every output is its row's FMA chain with its input: the same bits whatever
    the streams, inputs, threads, fetching or slot width. near: the "near" fetching (kernels/fp4_lanes.py
    FETCHES), else "far", which tells a thread working alone (nt == 1) apart."""
    N = out.shape[1]
    K = xq.shape[1]
    qf, cxf, rf = xq.reshape(-1), xc.reshape(-1), xr.reshape(-1)
    of = out.reshape(-1)
    cf = codes.reshape(-1)
    sf = scales.reshape(-1)
    per = (N + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK
    b = _spans(off, per, nt)
    taken = np.zeros(b[nt], np.int32)
    how = NEAR if near else (FAR_ALONE if nt == 1 else FAR)
    for t in prange(nt):
        c, k, i = _next(taken, b, t, 0, 0)
        while c >= 0:
            s, r0, r1 = _item(c, per, N)
            e = experts[s]
            for j0 in range(off[s], off[s + 1], inputs):
                j1 = min(j0 + inputs, off[s + 1])
                if streams == 4 and r1 - r0 == 4 * GROUP:
                    _lanes(4, cf, (e * N + r0) * (K // 2), sf, (e * N + r0) * (K // 32), qf, cxf, rf, j0, j1, K, of, r0, N, how)
                else:
                    for r in range(r0, r1, GROUP):
                        _lanes(1, cf, (e * N + r) * (K // 2), sf, (e * N + r) * (K // 32), qf, cxf, rf, j0, j1, K, of, r, N, how)
            c, k, i = _next(taken, b, t, k, i + 1)


def _lanes(G, cf, c_off, sf, s_off, qf, cxf, rf, j0, j1, K, of, r, N, how):
    """G consecutive groups from row r (bank offsets c_off, s_off) against inputs j0..j1-1 (at most 8);
    `how` (kernels/fp4_lanes.py FAR, FAR_ALONE or NEAR) tells one input's calls apart (calls of more
    fetch "far": where a batch's experts each meet one token, its calls are one input's)."""
    raise NotImplementedError("numba-only")


@overload(_lanes, prefer_literal=True, inline="always")
def _ov_lanes(G, cf, c_off, sf, s_off, qf, cxf, rf, j0, j1, K, of, r, N, how):
    if not isinstance(G, types.IntegerLiteral):
        return None
    g = G.literal_value

    def lanes(G, cf, c_off, sf, s_off, qf, cxf, rf, j0, j1, K, of, r, N, how):
        gc, gs, o = GROUP * (K // 2), GROUP * (K // 32), j0 * N + r
        n = j1 - j0
        if n == 1 and how == NEAR:
            fp4_lanes_dot(g, 1, MODE, NEAR, cf, c_off, gc, sf, s_off, gs, qf, cxf, rf, j0, K, of, o, N, GROUP)
        elif n == 1 and how == FAR_ALONE:
            fp4_lanes_dot(g, 1, MODE, FAR_ALONE, cf, c_off, gc, sf, s_off, gs, qf, cxf, rf, j0, K, of, o, N, GROUP)
        elif n == 1:
            fp4_lanes_dot(g, 1, MODE, FAR, cf, c_off, gc, sf, s_off, gs, qf, cxf, rf, j0, K, of, o, N, GROUP)
        elif n == 2:
            fp4_lanes_dot(g, 2, MODE, FAR, cf, c_off, gc, sf, s_off, gs, qf, cxf, rf, j0, K, of, o, N, GROUP)
        elif n == 3:
            fp4_lanes_dot(g, 3, MODE, FAR, cf, c_off, gc, sf, s_off, gs, qf, cxf, rf, j0, K, of, o, N, GROUP)
        elif n == 4:
            fp4_lanes_dot(g, 4, MODE, FAR, cf, c_off, gc, sf, s_off, gs, qf, cxf, rf, j0, K, of, o, N, GROUP)
        elif n == 5:
            fp4_lanes_dot(g, 5, MODE, FAR, cf, c_off, gc, sf, s_off, gs, qf, cxf, rf, j0, K, of, o, N, GROUP)
        elif n == 6:
            fp4_lanes_dot(g, 6, MODE, FAR, cf, c_off, gc, sf, s_off, gs, qf, cxf, rf, j0, K, of, o, N, GROUP)
        elif n == 7:
            fp4_lanes_dot(g, 7, MODE, FAR, cf, c_off, gc, sf, s_off, gs, qf, cxf, rf, j0, K, of, o, N, GROUP)
        else:
            fp4_lanes_dot(g, 8, MODE, FAR, cf, c_off, gc, sf, s_off, gs, qf, cxf, rf, j0, K, of, o, N, GROUP)
    return lanes


@njit(nogil=True, cache=CACHE)
def _passes(codes, scales, experts, off, xq, xc, xr, out, streams, inputs, l1_inputs, nt, near):
    """One weight pass: `_matvecs_lanes` on a lanes bank (GROUP), else `_matvecs`, or `_matvecs_wide`
    where a slot's inputs pass l1_inputs bytes."""
    if GROUP:
        _matvecs_lanes(codes, scales, experts, off, xq, xc, xr, out, streams, inputs, nt, near)
    elif np.max(off[1:] - off[:-1]) * xq.shape[1] > l1_inputs:
        _matvecs_wide(codes, scales, experts, off, xq, xc, xr, out, streams, inputs, l1_inputs, nt)
    else:
        _matvecs(codes, scales, experts, off, xq, xc, xr, out, streams, inputs, nt)


def _rows(R, B, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j0, j1, K, of, r, N, or_stride):
    """R rows (c_stride apart) against inputs j0..j1-1, in blocks of up to B (4 or 8) inputs sharing each
    row decode. Each input's sum is the same whatever block it is in. Which B is faster is a fact of the
    host, measured by the profiler (`Plan.cpu_moe_inputs`). Emerald Rapids VM (AVX-512 VNNI), rows in
    order, `benchmarks/cpu_moe.py --quick`, 6 alternating pairs of processes, B = 8 against 4: width-8
    verify 16.1 against 13.3 GB/s of distinct expert bytes (median; ahead in 6 of 6), prefill n = 16 / 64
    280 / 301 against 234 / 266 GFLOP/s, batch 1 alike (26.0 against 26.4 GB/s, inside the spread); on
    the Zen 4 VM up to 8 was equal or slower (kernels/lab/README.md)."""
    raise NotImplementedError("numba-only")


@overload(_rows, prefer_literal=True, inline="always")
def _ov_rows(R, B, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j0, j1, K, of, r, N, or_stride):
    if not (isinstance(R, types.IntegerLiteral) and isinstance(B, types.IntegerLiteral)):
        return None
    n = R.literal_value

    def rows8(R, B, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j0, j1, K, of, r, N, or_stride):
        j = j0
        while j1 - j >= 5:                                 # blocks of 8, or one of 5-7; the rest (<= 4) below
            o_off = j * N + r
            left = j1 - j
            if left >= 8:
                _dot(n, 8, MODE, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j, K, of, o_off, N, or_stride)
                j += 8
            elif left == 7:
                _dot(n, 7, MODE, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j, K, of, o_off, N, or_stride)
                j += 7
            elif left == 6:
                _dot(n, 6, MODE, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j, K, of, o_off, N, or_stride)
                j += 6
            else:
                _dot(n, 5, MODE, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j, K, of, o_off, N, or_stride)
                j += 5
        _rows(n, 4, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j, j1, K, of, r, N, or_stride)

    def rows(R, B, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j0, j1, K, of, r, N, or_stride):
        j = j0
        while j < j1:
            o_off = j * N + r
            left = j1 - j
            if left >= 4:
                _dot(n, 4, MODE, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j, K, of, o_off, N, or_stride)
                j += 4
            elif left == 3:
                _dot(n, 3, MODE, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j, K, of, o_off, N, or_stride)
                j += 3
            elif left == 2:
                _dot(n, 2, MODE, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j, K, of, o_off, N, or_stride)
                j += 2
            else:
                _dot(n, 1, MODE, cf, c_off, c_stride, sf, s_off, s_stride, qf, cxf, rf, j, K, of, o_off, N, or_stride)
                j += 1
    return rows8 if B.literal_value == 8 else rows


@njit(nogil=True, cache=CACHE, inline="always")
def _q(v, inv):
    return np.int8(min(max(np.rint(v * inv), np.float32(-127.0)), np.float32(127.0)))


@njit(nogil=True, cache=CACHE)
def _prepare_row(x, xq, xc, xr, sbb):
    """One input x [K] f32 -> int8 q per 32-block (kernels/formats.py quantize_act), laid out for
    fp4_i8_dot with superblocks of `sbb` code bytes (the places kernels/fp4_i8.py `act_slot` gives,
    walked block by block here): xq = even inputs then odd ones, each half in the order the kernel reads
    code bytes; xc = -OFFSET x the q sum of each entry (a block in superblocks, else 4 code bytes); xr =
    its block scale / 2 (a non-finite block: q = 0, scale NaN, so NaN reaches the output). Entries
    past the last one used stay unwritten."""
    K = x.shape[0]
    h = K // 2
    per_block = sbb == BLOCK_ENTRIES                         # the lanes kernel's: in order, an entry per block
    sbb = max(sbb, 0)
    nbs = sbb // 16                                          # blocks per superblock
    g_sb = (h // sbb) * nbs if sbb else 0                    # blocks in superblocks
    v = sbb // 4                                             # bytes per vector
    nl = max(v // 16, 1)                                     # 128-bit lanes per vector
    for g in range(K // 32):
        a = np.float32(0.0)
        for i in range(32):
            u = abs(x[32 * g + i])
            if not u <= a:                                   # a larger |x|, or a NaN
                a = u
                if a != a:                                   # NaN sticks: no later |x| may replace it
                    break
        ok = a > 0 and np.isfinite(a)
        inv = np.float32(127.0) / a if ok else np.float32(0.0)
        half_sc = (a / np.float32(127.0) if ok or a == 0 else np.float32(np.nan)) * np.float32(0.5)
        e = 32 * g
        if g < g_sb:                                         # one entry; byte o at base + (o // 4) v + o % 4
            sb, gl = g // nbs, g % nbs
            m, b = gl // nl, gl % nl
            base = sb * sbb + 16 * b + 4 * m
            L = sb * nbs + 4 * b + m
            tot = np.int32(0)
            for o in range(16):
                q0, q1 = _q(x[e + 2 * o], inv), _q(x[e + 2 * o + 1], inv)
                at = base + (o // 4) * v + o % 4
                xq[at], xq[h + at] = q0, q1
                tot += np.int32(q0) + np.int32(q1)
            xc[L], xr[L] = -OFFSET * tot, half_sc
        elif per_block:                                      # in order; entry g: the whole block
            tot = np.int32(0)
            for o in range(16):
                q0, q1 = _q(x[e + 2 * o], inv), _q(x[e + 2 * o + 1], inv)
                xq[16 * g + o], xq[h + 16 * g + o] = q0, q1
                tot += np.int32(q0) + np.int32(q1)
            xc[g], xr[g] = -OFFSET * tot, half_sc
        else:                                                # in order; an entry per 4 code bytes
            for L4 in range(4):
                L = g_sb + 4 * (g - g_sb) + L4
                tot = np.int32(0)
                for t in range(4):
                    o = 4 * L4 + t
                    q0, q1 = _q(x[e + 2 * o], inv), _q(x[e + 2 * o + 1], inv)
                    xq[16 * g + o], xq[h + 16 * g + o] = q0, q1
                    tot += np.int32(q0) + np.int32(q1)
                xc[L], xr[L] = -OFFSET * tot, half_sc


@njit(parallel=True, nogil=True, cache=CACHE)
def _prepare(x, rows, sbb=SUPERBLOCK):
    """Inputs x[rows[a]] -> (xq int8 [A, K], xc int32 [A, K/8], xr f32 [A, K/8]) for this host's kernel
    (sbb: its superblock bytes; 0 gives the layout without superblocks, the scalar path's; BLOCK_ENTRIES
    the lanes kernel's, in order with one xc / xr entry per 32-block: xc, xr [A, K/32]). A row of x
    that `rows` names more than once (a token's top-k assignments) is quantized once, at its first
    assignment, and copied to the others: the same bytes. A verify-8 step on V4.1's geometry (48
    assignments of 8 tokens) spent 0.28 ms of a ~9.4 ms step quantizing each token 6 times; 0.08 now."""
    A, K = len(rows), x.shape[1]
    ne = K // 32 if sbb == BLOCK_ENTRIES else K // 8                 # xc / xr entries an input
    xq, xc, xr = np.empty((A, K), np.int8), np.empty((A, ne), np.int32), np.empty((A, ne), np.float32)
    first = np.full(x.shape[0], -1, np.int64)
    for a in range(A):
        if first[rows[a]] < 0:
            first[rows[a]] = a
    once = first[first >= 0]
    for u in prange(len(once)):
        a = once[u]
        _prepare_row(x[rows[a]], xq[a], xc[a], xr[a], sbb)
    for a in prange(A):
        f = first[rows[a]]
        if f != a:
            xq[a], xc[a], xr[a] = xq[f], xc[f], xr[f]
    return xq, xc, xr


@njit(parallel=True, nogil=True, cache=CACHE)
def _swiglu(h, inter):
    """h [A, 2I] (gate | up) -> silu(gate) * up [A, I]."""
    a = np.empty((h.shape[0], inter), np.float32)
    for j in prange(h.shape[0]):
        for i in range(inter):
            g = h[j, i]
            a[j, i] = g / (np.float32(1.0) + np.exp(-g)) * h[j, inter + i]
    return a


@njit(nogil=True, cache=CACHE)
def _combine(y, tok, kk, wts, out):
    """out[t] += w[t, k] * y[a], assignments in ascending expert order (fixed: deterministic)."""
    for a in range(len(tok)):
        t = tok[a]
        w = wts[t, kk[a]]
        for r in range(out.shape[1]):
            out[t, r] += w * y[a, r]


def expert_ffn(x: np.ndarray, ids: np.ndarray, wts: np.ndarray, bank: Fp4Bank, threads: int | None = None,
               out: np.ndarray | None = None, streams: int = DEFAULT_STREAMS, inputs: int = DEFAULT_INPUTS,
               fetch: str = DEFAULT_FETCH) -> np.ndarray:
    """x [T, H] f32, ids [T, K] int64 (bank rows; duplicates allowed; -1 = none, skipped), wts [T, K] f32
    -> y [T, H] f32. streams: DRAM streams per thread (ROW_STREAMS); inputs: the most inputs a row decode
    serves with rows in order (ROW_INPUTS); fetch: how the lanes kernel fetches its weights (FETCHES; the
    other kernels have one way); the same bits for every choice of each.
    With `out`, the result is added into it."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    wts = np.ascontiguousarray(wts, dtype=np.float32)
    T, H = x.shape
    if H != bank.hidden or ids.shape != wts.shape or ids.shape[0] != T:
        raise ValueError(f"expert_ffn: x {x.shape}, ids {ids.shape}, wts {wts.shape} do not fit a bank of hidden {bank.hidden}")
    if streams not in ROW_STREAMS:
        raise ValueError(f"expert_ffn: streams must be one of {ROW_STREAMS}, got {streams}")
    if inputs not in ROW_INPUTS:
        raise ValueError(f"expert_ffn: inputs must be one of {ROW_INPUTS}, got {inputs}")
    if fetch not in FETCHES:
        raise ValueError(f"expert_ffn: fetch must be one of {FETCHES}, got {fetch!r}")
    if bank.group != GROUP:
        raise ValueError(f"expert_ffn: the bank's layout is group {bank.group}, this path's kernel ({ISA}) reads "
                         f"group {GROUP} (0: rows in order): build it with Fp4Bank.from_experts or random")
    set_threads(threads)
    y = np.zeros((T, H), np.float32) if out is None else out
    _ffn(x, ids, wts, bank.w13_codes, bank.w13_scales, bank.w2_codes, bank.w2_scales, streams, inputs, l1_input_bytes(),
         numba.get_num_threads(), fetch == "near", y, *ffn_scratch(ids, bank.inter, H))
    return y


def ffn_scratch(ids: np.ndarray, inter: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """A call's two largest intermediates, gate/up [A, 2I] and down [A, H] float32 (A: the ids that are not
    -1), allocated by numpy rather than inside the compiled call: numpy asks for transparent huge pages
    on blocks of 4 MiB and more (madvise), so a prefill chunk's scratch past the heap's 32 MiB (mapped
    afresh every call, runtime/memwatch.py) faults 2 MiB at a time, not 4 KiB. Mini, chunk 512 (57 and
    63 MB here), a warm 1024-token request on the Zen 4 VM: 36-129 k page faults -> 14-37 k, prefill
    tok/s within the noise (98-109 against 104-111, 2 rounds of processes interleaved)."""
    A = int(np.count_nonzero(ids != -1))
    return np.empty((A, 2 * inter), np.float32), np.empty((A, hidden), np.float32)


@njit(nogil=True, cache=CACHE)
def _ffn(x, ids, wts, w13_codes, w13_scales, w2_codes, w2_scales, streams, inputs, l1_inputs, nt, near, y, h, d):
    """expert_ffn's steps in one compiled call (its parallel kernels launched from here, no Python
    between them), into h [A, 2I] and d [A, H] (`ffn_scratch`). In the mini decode on the Zen 2 VM the
    steps around the two weight passes took ~0.28 ms a call (planning 47 us with the wrapper, quantizing
    57 + 62, SwiGLU 86, combine 26), mostly inside the kernels; one call against seven: 18.95 against
    18.87 tok/s (6 alternating rounds)."""
    inter = w13_codes.shape[1] // 2
    experts, off, tok, kk = _plan_slots(ids, w13_codes.shape[0])
    if len(tok) != h.shape[0] or len(tok) != d.shape[0] or h.shape[1] != 2 * inter or d.shape[1] != x.shape[1]:
        raise ValueError("expert_ffn: the scratch does not fit the call's assignments (ffn_scratch)")
    if len(experts) == 0:
        return
    sbb = BLOCK_ENTRIES if GROUP else SUPERBLOCK                   # the lanes kernel: in order, an entry per block
    xq, xc, xr = _prepare(x, tok, sbb)                             # [A, H] int8 (+ [A, H/8 or H/32] x2): A = assignments (<= T K)
    _passes(w13_codes, w13_scales, experts, off, xq, xc, xr, h, streams, inputs, l1_inputs, nt, near)   # h [A, 2I]
    a = _swiglu(h, inter)                                          # [A, I]
    aq, ac, ar = _prepare(a, np.arange(len(tok)), sbb)
    _passes(w2_codes, w2_scales, experts, off, aq, ac, ar, d, streams, inputs, l1_inputs, nt, near)     # d [A, H]
    _combine(d, tok, kk, wts, y)


def expert_ffn_reference(x, ids, wts, bank: Fp4Bank, dtype=torch.float64, act_quant: bool = True) -> torch.Tensor:
    """Plain torch, every expert dequantized, in `dtype` (float64 for checks). act_quant: each expert
    input quantized as every runtime path does (kernels/formats.py quantize_act); False gives the
    float model the int8 inputs approximate."""
    x = torch.as_tensor(np.asarray(x)).to(dtype)
    ids, wts = np.asarray(ids), torch.as_tensor(np.asarray(wts)).to(dtype)
    q = quantize_act if act_quant else (lambda v: v)
    y = torch.zeros_like(x)
    for e in np.unique(ids[ids >= 0]):              # -1: no assignment
        w1, w3, w2 = bank.expert_weights(int(e), dtype)
        t, k = np.nonzero(ids == e)
        xe = q(x[t])
        hid = torch.nn.functional.silu(xe @ w1.T) * (xe @ w3.T)
        y.index_add_(0, torch.as_tensor(t), (q(hid) @ w2.T) * wts[t, k][:, None])
    return y


# ------------------------------------------------------------------------------ prefill: dense tiles
@njit(parallel=True, nogil=True, cache=CACHE)
def _dequant_experts(codes, scales, experts, out, stab):
    """out[s] = dequantized W_{experts[s]} [N, K] float32."""
    S, N, K = out.shape
    ng = K // 32
    cf, sf, of = codes.reshape(-1), scales.reshape(-1), out.reshape(-1)
    for c in prange(S * N):
        s, r = c // N, c % N
        e = experts[s]
        _deq(LANES, cf, (e * N + r) * (K // 2), sf, (e * N + r) * ng, stab, ng, of, (s * N + r) * K)


def dequant_experts(codes, scales, experts, group: int = 0) -> np.ndarray:
    """codes [E, N, K/2], scales [E, N, K/32] in layout `group` (0: rows in order), experts [S] -> float32
    [S, N, K]. A lanes layout is put back in rows' order first (a copy of the S experts' bytes)."""
    experts = np.asarray(experts, np.int64)
    if group:
        codes, scales = to_rows(codes[experts], scales[experts], group)
        experts = np.arange(len(experts), dtype=np.int64)
    out = np.empty((len(experts), codes.shape[1], codes.shape[2] * 2), np.float32)
    _dequant_experts(codes, scales, experts, out, STAB)
    return out


def expert_ffn_dense(x, ids, wts, bank: Fp4Bank, threads: int | None = None, dtype=torch.bfloat16):
    """Prefill path: per expert, dequantize its tile (fp4 -> f32 -> `dtype`) and use torch matmul on the
    int8-per-32 inputs. Compute-bound at prefill widths; numerics differ from expert_ffn only by `dtype`
    rounding."""
    if set_threads(threads):
        torch.set_num_threads(threads)
    x = torch.as_tensor(np.ascontiguousarray(x, dtype=np.float32))
    ids, wts_t = np.asarray(ids), torch.as_tensor(np.asarray(wts, dtype=np.float32))
    y = torch.zeros_like(x)
    I = bank.inter
    for e in np.unique(ids[ids >= 0]):              # -1: no assignment
        t, k = np.nonzero(ids == e)
        w13 = torch.from_numpy(dequant_experts(bank.w13_codes, bank.w13_scales, [e], bank.group)[0]).to(dtype)
        w2 = torch.from_numpy(dequant_experts(bank.w2_codes, bank.w2_scales, [e], bank.group)[0]).to(dtype)
        h = quantize_act(x[t]).to(dtype) @ w13.T                       # [n, 2I]
        a = torch.nn.functional.silu(h[:, :I].float()) * h[:, I:].float()
        y.index_add_(0, torch.as_tensor(t), (quantize_act(a).to(dtype) @ w2.T).float() * wts_t[t, k][:, None])
    return y.numpy()
