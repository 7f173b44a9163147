"""A decode step's layer in a few numba calls (runtime/model/decode.py): the work around attention, the
attention of each sequence, an Engram layer, a decoder kv source.

Between two layers' CPU-MoE calls (each reads ~100 MB on mini, 0.4 GB on V4.1) the interpreter's,
torch's and numba's code and state are evicted, and each small op of the unfused layer pays 10-80 us
to fetch them again (kernels/lab/README.md, "Where the dense phase's glue goes"): ~25 calls a layer.
These calls run the same kernels on the same rows, so their bits are the unfused path's:
  attn_in   h [S, H] -> a = rmsnorm(h, attn_norm)                          [S, H]
            ql = a wq_a^T [S, q];  q = rope(ql wq_b^T) [S, Hq, C]
            cw = rmsnorm(a wkv^T, kv_norm) [S, C];  kn = rope(cw) [S, C]
            index layer:  qi = ql wi_q^T [S, Hi Di],  wh = a wi_w^T [S, Hi] (BF16)
            source layer: lat = a wkv_c^T [S, C],  ik = a wi_k^T [S, Di]
  source_in a decoder kv source's latent and index key from the encoder's output (its own norm)
  attend_one  one sequence's query: the indexer's top rows (index layer), its selected rows
            dequantized and roped (when the layer's (kv source, index source) pair differs from the
            last one's), the attention over them and the window, the window's write
  engram    Engram layers: e = the rows (kernels/engram_gate.py) [S, slots D]; k = e wk^T, v = e wv^T;
            h + gate(h, k) v, the gate as engram_gate's
  attn_out  h2 = h + o wo^T [S, H];  m = rmsnorm(h2, ffn_norm) [S, H]
            routed layer: logits = m gate^T [S, E] (BF16), ids, wts = route(logits + bias)
A weight a layer lacks is passed as an empty array. The FP8 and BF16 GEMVs are the package's
(`fp8_dense`, `bf16_dense`: one row per thread call, the same sums for any thread count), RMSNorm and
RoPE `norms`' row kernels, the router `router`'s: only for S below both GEMVs' TILE_MIN_TOKENS (wider
calls take tiles there, with other sums) and weights both SIMD paths take (`fits`).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from kernels import bf16_dense, fp8_dense
from kernels.cpu_moe import CACHE
from kernels.decode_attn import _attend
from kernels.engram_gate import _gate
from kernels.engram_gate import _rows as _engram_rows
from kernels.indexer_top import select_one
from kernels.latent_rows import _rows as _latent_rows
from kernels.norms import _rope, _rope_tables, _rows
from kernels.window_keys import _write
from kernels.router import _route

MAX_ROWS = min(fp8_dense.TILE_MIN_TOKENS, bf16_dense.TILE_MIN_TOKENS) - 1


def fits(rows: int, fp8=(), bf16=()) -> bool:
    """Whether `rows` decode rows over these weights take exactly the unfused path's kernels."""
    return (rows <= MAX_ROWS and all(isinstance(w, fp8_dense.Fp8Weight) and fp8_dense.simd_ok(w) for w in fp8)
            and all(isinstance(w, bf16_dense.Bf16Weight) and bf16_dense.simd_ok(w) for w in bf16))


@njit(nogil=True, cache=CACHE)
def _fp8(q, s, bn, bk, x, out, stab):
    if q.shape[0] > 0:
        fp8_dense._gemv_simd(q, s, bn, bk, x, out, stab)


@njit(nogil=True, cache=CACHE)
def attn_in(h, attn_norm, kv_norm, eps, bn, bk, stab, cos, sin,
            wqa, wqa_s, wqb, wqb_s, wkv, wkv_s, wiq, wiq_s, wiw, wkvc, wkvc_s, wik, wik_s,
            a, ql, q, cw, kn, qi, wh, lat, ik, nt):
    """Outputs written in place: a, ql, q [S, Hq, C], cw, kn [S, C]; qi, wh where wi_q, wi_w are given;
    lat, ik where wkv_c, wi_k are given (their arrays then [S, N], else empty). nt: numba's thread count (the
    BF16 GEMV's, bf16_dense._gemv_simd)."""
    S = h.shape[0]
    r = np.empty(S, h.dtype)
    _rows(h, attn_norm, eps, r, a)
    fp8_dense._gemv_simd(wqa, wqa_s, bn, bk, a, ql, stab)
    qraw = np.empty((S, q.shape[1] * q.shape[2]), h.dtype)
    fp8_dense._gemv_simd(wqb, wqb_s, bn, bk, ql, qraw, stab)
    _rope(qraw.reshape(q.shape), cos, sin, q)
    craw = np.empty(cw.shape, h.dtype)
    fp8_dense._gemv_simd(wkv, wkv_s, bn, bk, a, craw, stab)
    _rows(craw, kv_norm, eps, r, cw)
    _rope(cw.reshape(S, 1, cw.shape[1]), cos, sin, kn.reshape(S, 1, kn.shape[1]))
    _fp8(wiq, wiq_s, bn, bk, ql, qi, stab)
    if wiw.shape[0] > 0:
        bf16_dense._gemv_simd(wiw, a, wh, nt)
    _fp8(wkvc, wkvc_s, bn, bk, a, lat, stab)
    _fp8(wik, wik_s, bn, bk, a, ik, stab)


@njit(nogil=True, cache=CACHE)
def attn_out(h, o, wo, wo_s, bn, bk, stab, ffn_norm, eps, gate, bias, scale, h2, m, ids, wts, nt):
    """h2 = h + o wo^T, m = rmsnorm(h2, ffn_norm), and with a gate (else empty) the routing into
    ids, wts [S, K]; o [S, Hq C]. nt: numba's thread count (the router's BF16 GEMV)."""
    S, H = h.shape
    t = np.empty((S, H), h.dtype)
    fp8_dense._gemv_simd(wo, wo_s, bn, bk, o, t, stab)
    for i in range(S):
        for j in range(H):
            h2[i, j] = h[i, j] + t[i, j]
    _rows(h2, ffn_norm, eps, np.empty(S, h.dtype), m)
    if gate.shape[0] > 0:
        E = gate.shape[0]
        logits = np.empty((S, E), h.dtype)
        bf16_dense._gemv_simd(gate, m, logits, nt)
        _route(logits, bias, scale, np.empty(E, wts.dtype), np.empty(E, np.bool_), ids, wts)


@njit(nogil=True, cache=CACHE)
def attend_one(p, window, scale, q, kn, vn, ring_k, ring_v, ring_p, K, V, out,
               n_vis, ik_codes, ik_scale, lut, qi, wh, idx, ok,
               r, lat_codes, lat_scales, pairs, e4m3, group, inv_freq, n_rows):
    """One sequence's decode query at position p: q, out [Hq, C]; kn, vn [C] its window key and value;
    the layer's ring (keys, values [R, C], positions [R]); K, V [M, C] its decode buffers.
    n_vis >= 0: an index layer with n_vis visible rows: idx, ok [k] (k = min(topk, n_vis), or 1 with
    none visible) get its top rows (`indexer_top.select_one` over ik_codes, ik_scale; qi [Hi, Di], wh
    [Hi]); -1: not one. r > 0: the rows idx[ok] of the kv source (lat_codes, lat_scales; ratio r) are
    dequantized into V[:n] and roped at positions (row + 1) r - 1 into K[:n] (tables from inv_freq
    [C/2], `norms.rope_tables`' arithmetic); r = 0: rows 0..n_rows-1 hold them already; r < 0: a
    window layer. -> the selected rows in K, V."""
    if n_vis > 0:
        select_one(ik_codes, ik_scale, lut, qi, wh, np.empty(n_vis, np.float32), idx.shape[0], idx, ok)
    elif n_vis == 0:
        idx[0], ok[0] = 0, False
    if r > 0:
        n_rows = 0
        rows = np.empty(idx.shape[0], np.int64)
        for i in range(idx.shape[0]):
            if ok[i]:
                rows[n_rows] = idx[i]
                n_rows += 1
        rows = rows[:n_rows]
        cos, sin = np.empty((n_rows, inv_freq.shape[0]), K.dtype), np.empty((n_rows, inv_freq.shape[0]), K.dtype)
        _rope_tables((rows + 1) * r - 1, inv_freq, cos, sin)
        _latent_rows(lat_codes, lat_scales, rows, pairs, e4m3, group, cos, sin, K, V)
    at = n_rows if r >= 0 else K.shape[0] - ring_p.shape[0] - 1     # a window layer's keys after row index_topk
    _attend(ring_k, ring_v, ring_p, p, window, kn, vn, K, V, at, 0 if r >= 0 else at, q, scale, out)
    _write(ring_k, ring_v, ring_p, np.full(1, p, np.int64), kn.reshape(1, -1), vn.reshape(1, -1))
    return n_rows


@njit(nogil=True, cache=CACHE)
def engram(h, codes, scales, ids, lut, stab, wk, wk_s, wv, wv_s, bn, bk, eps, inv_sqrt_h, out):
    """h [S, H]; the table's codes, scales and the step's row ids [S slots] -> out [S, H]."""
    S, H = h.shape
    e = np.empty((ids.shape[0], codes.shape[1]), h.dtype)
    _engram_rows(codes, scales, ids, lut, stab, e)
    e2 = e.reshape(S, -1)
    k, v = np.empty((S, H), h.dtype), np.empty((S, H), h.dtype)
    fp8_dense._gemv_simd(wk, wk_s, bn, bk, e2, k, stab)
    fp8_dense._gemv_simd(wv, wv_s, bn, bk, e2, v, stab)
    _gate(h, k, v, eps, inv_sqrt_h, out)


@njit(nogil=True, cache=CACHE)
def source_in(h, attn_norm, eps, bn, bk, stab, wkvc, wkvc_s, wik, wik_s, lat, ik):
    """A decoder kv source's inputs from the encoder's output h [S, H]: a = rmsnorm(h, its attn_norm),
    lat = a wkv_c^T [S, C], ik = a wi_k^T [S, Di] (written in place)."""
    a = np.empty(h.shape, h.dtype)
    _rows(h, attn_norm, eps, np.empty(h.shape[0], h.dtype), a)
    fp8_dense._gemv_simd(wkvc, wkvc_s, bn, bk, a, lat, stab)
    fp8_dense._gemv_simd(wik, wik_s, bn, bk, a, ik, stab)
