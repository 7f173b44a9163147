"""CSA2 attention over what SeqState keeps, tiled so that only the indexer's scores grow with
chunk x context (runtime/budget.py prices each term; tests hold the two equal).

attend: queries in blocks of Q_BLOCK; a block sees the window's earlier positions (gathered from the
  ring in position order), this forward's keys from window-1 before the block to its end, and each
  query's selected compressed rows: scores [Q_BLOCK, heads, 2 (window - 1) + Q_BLOCK + index_topk],
  whatever the chunk or context.
select: an index layer scores every visible row in tiles of t = TILE_ELEMS / (T Hi) rows:
  relu(qi . ik) [T, Hi, t] -> weighted by wh -> score [T, n] (itemsize B per score: the only
  chunk x context term); a stable sort of Q_BLOCK queries at a time keeps the top k. One decode query
  on the CPU: all of it in one call, no tile (kernels/indexer_top.py select_one).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from kernels.arrays import numpy_views
from kernels import decode_attn, window_keys
from runtime.budget import Q_BLOCK, key_tile
from runtime.model.kv import Compressed, Ring


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def attend(q, pos, k_new, v_new, ring: Ring, window: int, glob=None):
    """q [T, Hq, C] roped queries at pos [T] (ascending, contiguous); k_new, v_new [T, C] this forward's
    window keys and values; ring: the earlier ones. glob(b0, b1) -> (keys [B, k, C], values [B, k, C],
    ok [B, k]) for queries b0..b1-1, or None. -> [T, Hq, C]."""
    T, C = len(pos), q.shape[-1]
    p0, scale = int(pos[0]), 1.0 / math.sqrt(C)
    # the earlier positions a query here can see that the ring holds (a bounded replay's decoder never
    # computed those before its start), in position order: the same keys in the same order whatever the
    # ring's size (its spare slots for a DSpark rollback), so DSpark on or off the prompt is attended
    # to the bit; a rejected draft's stale slot is past p0 and never read
    want = torch.arange(max(0, p0 - window + 1) if ring.R else p0, p0, device=ring.pos.device)
    slot = want % max(ring.R, 1)
    held = ring.pos[slot] == want
    rk, rv = (d[slot[held]] for d in ring.data)
    rpos = want[held].to(pos.device)
    out = torch.empty_like(q)
    for b0 in range(0, T, Q_BLOCK):
        b1 = min(T, b0 + Q_BLOCK)
        lo = max(0, b0 - window + 1)
        K, V = torch.cat([rk, k_new[lo:b1]]), torch.cat([rv, v_new[lo:b1]])          # [N, C]
        kpos, qp = torch.cat([rpos, pos[lo:b1]]), pos[b0:b1]
        mask = (kpos[None] <= qp[:, None]) & (kpos[None] > qp[:, None] - window)      # [B, N]
        s = torch.einsum("thc,nc->thn", q[b0:b1], K).mul_(scale).masked_fill_(~mask[:, None], float("-inf"))
        if glob is None:
            out[b0:b1] = torch.einsum("thn,nc->thc", torch.softmax(s, -1), V)
            continue
        gk, gv, ok = glob(b0, b1)
        sg = torch.einsum("thc,tkc->thk", q[b0:b1], gk).mul_(scale).masked_fill_(~ok[:, None], float("-inf"))
        p = torch.softmax(torch.cat([s, sg], -1), -1)
        out[b0:b1] = torch.einsum("thn,nc->thc", p[..., :len(K)], V) + torch.einsum("thk,tkc->thc", p[..., len(K):], gv)
    return out


def select(src: Compressed, qi, wh, pos, window: int, topk: int, dtype, device):
    """Top `topk` visible compressed rows of `src` per query. qi [T, Hi, Di], wh [T, Hi] ->
    (idx [T, k], ok [T, k], peak bytes of the tensors this held at once). Ties keep the lower row, so
    the choice is the same whatever the chunk."""
    r, T = src.r, len(pos)
    n_vis = torch.clamp((pos + 1 - window) // r, min=0)                               # [T]
    n = int(n_vis.max())
    k = min(topk, max(n, 1))
    if n == 0:
        z = torch.zeros(T, k, dtype=torch.long, device=device)
        return z, z.bool(), 0
    score = torch.empty(T, n, dtype=dtype, device=device)                             # the chunk x context term
    idx = torch.empty(T, k, dtype=torch.long, device=device)
    ok = torch.empty(T, k, dtype=torch.bool, device=device)
    if T == 1 and src.top_rows(qi[0], wh[0], score[0], k, idx[0], ok[0]):   # one query on the CPU: one call, no tile
        return idx, ok, nbytes(score, idx, ok) + n * (score.element_size() + 8)   # + the sort's -score, order
    peak = 0
    tile = key_tile(T, qi.shape[1], n)
    for j0 in range(0, n, tile):
        j1 = min(n, j0 + tile)
        ik = src.index_keys(j0, j1)                                                    # [t, Di]
        act = torch.einsum("thd,nd->thn", qi, ik).relu_()                              # [T, Hi, t]
        part = torch.einsum("thn,th->tn", act, wh)                                     # [T, t]
        peak = max(peak, nbytes(score, ik, act, part))
        score[:, j0:j1] = part
        del ik, act, part
    score.masked_fill_(torch.arange(n, device=device)[None] >= n_vis[:, None], float("-inf"))
    for b0 in range(0, T, Q_BLOCK):                       # sorted a block of queries at a time
        val, order = torch.sort(score[b0:b0 + Q_BLOCK], dim=-1, descending=True, stable=True)
        idx[b0:b0 + Q_BLOCK], ok[b0:b0 + Q_BLOCK] = order[:, :k], torch.isfinite(val[:, :k])
        peak = max(peak, nbytes(score, idx, ok, val, order))
    return idx, ok, peak


def attend_decode(q, pos, k_new, v_new, rings: list, window: int, kv, n_sel=None):
    """S sequences' one decode query each (continuous batching), each over rows of its own: the
    forward's decode buffers kv = (keys, values) [S, M, C] (M = index_topk + R + 1, transformer.py
    `_decode_buffers`) hold in rows 0..n_sel[j]-1 sequence j's selected rows (roped keys, values;
    global layers), and take its visible window keys after them (kernels/window_keys.py: one call, no
    mask); window layers write theirs after row index_topk. The scores run over those rows alone, so a
    sequence's arithmetic is the same alone or batched. q [S, Hq, C] at pos [S]; k_new, v_new [S, C].
    -> [S, Hq, C]."""
    K, V = kv
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    Ka, Va, qa, oa, kna, vna = numpy_views(K, V, q, out, k_new, v_new)
    if isinstance(Ka, np.ndarray):                 # the CPU: each sequence in one call (kernels/decode_attn.py)
        for j, (ring, p) in enumerate(zip(rings, pos.tolist())):
            at = K.shape[1] - ring.R - 1 if n_sel is None else n_sel[j]
            decode_attn.attend(ring.views, p, window, kna[j], vna[j], Ka[j], Va[j], at, at if n_sel is None else 0,
                               qa[j], scale, oa[j])
        return out
    for j, (ring, p) in enumerate(zip(rings, pos.tolist())):
        at = K.shape[1] - ring.R - 1 if n_sel is None else n_sel[j]
        n = window_keys.gather(ring.views, p, window, kna[j], vna[j], Ka[j], Va[j], at)
        lo = at if n_sel is None else 0
        s = torch.matmul(q[j], K[j, lo:at + n].T).mul_(scale)                            # [Hq, m]
        out[j] = torch.matmul(torch.softmax(s, -1), V[j, lo:at + n])
    return out
