"""The V4.1 model's math, once: the reference and the placed runtime both run this code, differing only
in precision, in the expert backend (dequantized torch vs the plan's placement) and the Engram source.

Per layer i, hidden h [T, H] at positions p (legend: C latent, W window, r compress ratio, k top-k):
  Engram (i in engram_layer_ids): e = rows [T, S*D]; k = e wk^T, v = e wv^T; h += sigmoid(<n(h), n(k)>/sqrt(H)) v
  a = rmsnorm(h, attn_norm); ql = a wq_a^T [T, q]; q = rope(ql wq_b^T) [T, Hq, C]
  window: c = rmsnorm(a wkv^T, kv_norm); K = rope(c), V = c; query t sees positions t-W+1..t
  CSA2 global (mode != window): the kv source s = kv_source_of(i) computes per position a latent
    a_s wkv_c^T and an index key a_s wi_k^T; row j = their mean over positions j*r..j*r+r-1
    (r = compress_ratios[s]), stored as V4.1 stores it: the latent FP4 E2M1 with an E4M3 scale per
    16 channels, the index key E4M3 with a float32 scale (runtime/model/kv.py); query t sees rows wholly before its window: (j+1)*r <= t+1-W. An index layer x scores rows:
    sum_h w_h relu(qi_h . ik_j) (qi = ql wi_q^T, w = a wi_w^T) and keeps the top index_topk;
    reuse layers take the selection of index_source_of(i). Keys rope(row) at position (j+1)*r-1.
  attention over window + selected rows, softmax(q.K/sqrt(C)); h += concat_heads(P V) wo^T
  MoE: m = rmsnorm(h, ffn_norm); s = sigmoid(m gate^T); top-k of s + bias; w = s_sel/sum * scale
    (hash layers: tid2eid[token], w = 1/K); h += routed(m) + shared(m)
Encoder/decoder: the decoder's global state (its kv source layers' latents and index keys) is
projected from the encoder's final hidden states (the input of layer num_encoder_layers), for every
token, so `bounded_replay` can run the decoder over the last window of the prompt only.
logits = rmsnorm(h, norm) head^T.
"""
from __future__ import annotations

import functools

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from hostinfo import usable_cores
from kernels import engram_gate, norms, router
from kernels.arrays import numba_ok
from kernels.decode_layer import MAX_ROWS
from kernels.norms import RMS_EPS
from kernels.engram_hash import engram_rows, slot_ranges, slot_seeds
from kernels.threads import release_blas_buffers, torch_threads
from runtime.config import ModelConfig
from runtime.model.attention import attend, attend_decode, select
from runtime.model.decode import FusedDecode
from runtime.model.kv import SeqState
from runtime.model.weights import linear


def rmsnorm(x, w=None, eps=RMS_EPS):
    """x [T, H] -> x / sqrt(mean(x^2) + eps) (* w): on the CPU in one numba call (kernels/norms.py)."""
    if x.dim() == 2 and numba_ok(x, *([] if w is None else [w])):
        out = torch.empty(x.shape, dtype=x.dtype)
        norms.rmsnorm(x.numpy(), None if w is None else w.numpy(), eps, out.numpy())
        return out
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


@functools.lru_cache(maxsize=8)
def _inv_freq(d: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(d, dtype=torch.float64) / d))


def rope_tables(pos, d: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, d] of integer positions pos [T] (computed in float64, then cast); on the CPU in one
    numba call (kernels/norms.py rope_tables: the tables the fused decode computes for itself)."""
    if pos.device.type == "cpu" and pos.dtype == torch.int64 and dtype in (torch.float32, torch.float64):
        cos, sin = torch.empty(len(pos), d, dtype=dtype), torch.empty(len(pos), d, dtype=dtype)
        norms.rope_tables(pos.numpy(), _inv_freq(d, theta).numpy(), cos.numpy(), sin.numpy())
        return cos, sin
    ang = pos.to(torch.float64)[:, None] * _inv_freq(d, theta).to(pos.device)[None]   # [T, d]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope(x, pos, theta, tables=None):
    """Rotate-half RoPE over the last dim of x [..., T, (heads,) D] at integer positions pos [T];
    `tables`: rope_tables(pos, D/2, theta, x.dtype) when the caller already holds them."""
    d = x.shape[-1] // 2
    cos, sin = tables if tables is not None else rope_tables(pos, d, theta, x.dtype)
    if x.dim() in (2, 3) and numba_ok(x, cos, sin) and x.dtype == cos.dtype == sin.dtype:   # one call (kernels/norms.py), the same bits
        out = torch.empty(x.shape, dtype=x.dtype)
        x3, o3 = (x, out) if x.dim() == 3 else (x[:, None], out[:, None])
        norms.rope(x3.numpy(), cos.numpy(), sin.numpy(), o3.numpy())
        return out
    if x.dim() == 3:                                                       # [T, heads, D]
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


@dataclass
class Seg:
    """One sequence's tokens in a batched forward: rows a..b of the step's tensors, T tokens given;
    verify: a DSpark verify block (else a prompt chunk, or a decode token)."""
    st: SeqState
    a: int
    b: int
    T: int
    verify: bool = False


# A forward of at most this many tokens (decode steps, verify blocks, decode batches) runs torch's CPU
# ops on one thread: they are small ([T, H] rows, mostly under torch's parallel grain), and an idle torch
# worker spins on the cores the CPU-MoE kernel's pool wants next (kernels/threads.py): one pool at a
# time. Mini, Zen 4 VM (2 cores): with the whole process's torch on 1 thread, the routed calls inside
# the engine ran at 0.93-1.02 of their own replay's speed, against 0.80-0.96 on 2 threads (4
# interleaved pairs); this switch alone (decode forwards only), 20 rounds in ABBA order: decode 15.7
# against 15.0 tok/s median, within the VM's spread (9-18). Wider forwards (prompt chunks) run torch on every
# usable core (hostinfo.usable_cores); the caller's count is restored after each forward.
ONE_POOL_TOKENS = 32


@dataclass
class Phases:
    seconds: dict = field(default_factory=lambda: defaultdict(float))

    def add(self, name, t0):
        self.seconds[name] += time.perf_counter() - t0


class Model:
    def __init__(self, cfg: ModelConfig, dense: dict, experts, engram=None, cmap=None,
                 dtype=torch.float32, device="cpu"):
        self.cfg, self.w, self.experts, self.engram = cfg, dense, experts, engram
        self.dtype, self.device = dtype, device
        self.cmap = cmap
        self.phases = Phases()
        self.fuse_decode = True                    # decode steps in a few calls a layer (runtime/model/decode.py)
        self.fused = None                          # its state: FusedDecode, made at the first decode step
        self.torch_threads = usable_cores()        # torch's pool for wide forwards (ONE_POOL_TOKENS)
        self._global_layers = any(cfg.layer_mode(i) != "window" for i in range(cfg.num_hidden_layers))
        if cfg.engram_layer_ids:
            S = cfg.engram_slots
            self.engram_ranges = {i: slot_ranges(rows, S) + (slot_seeds(i, S),)
                                  for i, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings)}

    # ------------------------------------------------------------------ state
    def new_state(self, max_context: int, spare: int = 0) -> SeqState:
        """A sequence of up to max_context positions that can roll back `spare` of them (runtime/model/kv.py)."""
        return SeqState.new(self.cfg, max_context, spare, self.dtype, self.device)

    def L(self, name, x):
        return linear(x, self.w[name + ".weight"], self.dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, st: SeqState, tokens: list[int], decoder_start: int = 0, verify: bool = False) -> torch.Tensor | None:
        """Run `tokens` (the next positions of the sequence) through the model. The decoder runs only
        for positions >= decoder_start. verify: the tokens are a DSpark verify block (computed as
        one-token decode computes them, where the fused path runs), not a prompt chunk. -> logits [T', V]
        of the positions the decoder ran, or None."""
        return self.forward_many([st], [tokens], decoder_start, [verify])[0]

    def forward_many(self, states: list[SeqState], token_lists: list[list[int]], decoder_start: int = 0,
                     verify: list[bool] | None = None) -> list:
        """Several sequences' next tokens in one pass (continuous batching): the linears, the router and
        the experts run over all their tokens at once (each MoE layer reads the union of the step's
        experts once), attention over each sequence's own state (one-query segments together:
        attention.attend_decode). One sequence is the plain forward (decoder_start, bounded replay,
        only then). verify[s]: sequence s gives a DSpark verify block (`forward`). -> logits [T_s', V]
        per sequence."""
        n = sum(len(t) for t in token_lists)
        with torch_threads(1 if n <= ONE_POOL_TOKENS else self.torch_threads):
            out = self._forward_many(states, token_lists, decoder_start, verify or [False] * len(states))
        release_blas_buffers()                  # a no-op unless torch came before kernels/__init__.py
        return out

    def _forward_many(self, states: list[SeqState], token_lists: list[list[int]], decoder_start: int, verify: list[bool]) -> list:
        c = self.cfg
        if decoder_start and len(states) > 1:
            raise ValueError("decoder_start (bounded replay) runs one sequence at a time")
        segs, pos, toks, row_parts, n0 = [], [], [], [], 0
        for st, tokens, block in zip(states, token_lists, verify):
            T, p0 = len(tokens), st.pos
            if p0 + T > st.max_context:
                raise ValueError(f"sequence of {p0 + T} tokens exceeds the plan's max_context {st.max_context}")
            st.tokens.extend(tokens)
            pos.append(torch.arange(p0, p0 + T, device=self.device))
            toks += tokens
            row_parts.append(self._engram_row_ids(st, p0, T))
            segs.append(Seg(st, n0, n0 + T, T, block))
            n0 += T
        pos, tok = torch.cat(pos), torch.tensor(toks, device=self.device)
        h = self.w["embed.weight"][tok].to(self.dtype)
        rows = {layer: np.concatenate([r[layer] for r in row_parts]) for layer in row_parts[0]}
        if rows:
            self.engram.prefetch(rows)     # every read issued now: they overlap the layers before each Engram layer
        enc = c.num_encoder_layers
        fw = {}                            # what this forward's layers share
        fw["fused"] = not decoder_start and self._fused_step(segs, fw)   # bounded replay's prompt: unfused
        sel: list = [{} for _ in range(n0 if fw["fused"] else len(segs))]   # the indexer's picks: per row when fused
        if fw["fused"]:                    # the fused decode keeps the residual stream in numpy (runtime/model/decode.py)
            h = h.numpy()
        else:
            fw["rope"] = rope_tables(pos, c.kv_lora_rank // 2, c.rope_theta, self.dtype)
        for i in range(c.num_hidden_layers):
            if i == enc:                   # decoder global state from the encoder's final hidden states
                t0 = time.perf_counter()
                for sg in segs:
                    self._decoder_sources(sg.st, h[sg.a:sg.b], pos[sg.a:sg.b], fw)
                self.phases.add("dense", t0)   # its linears and the KV format's quantizer
                if decoder_start:
                    keep = (pos >= decoder_start).nonzero().flatten()
                    if len(keep) == 0:
                        segs[0].st.pos += segs[0].T
                        return [None]
                    h, pos, tok = h[keep], pos[keep], tok[keep]
                    rows = {l: r[keep.cpu().numpy()] for l, r in rows.items()}
                    sel[0] = {x: (idx[keep], ok[keep]) for x, (idx, ok) in sel[0].items()}
                    segs[0].a, segs[0].b = 0, len(keep)
                    fw["rope"] = rope_tables(pos, c.kv_lora_rank // 2, c.rope_theta, self.dtype)
            h = self._layer(segs, i, h, pos, tok, rows, sel, fw)
            if i in c.dspark_target_layer_ids:
                for sg in segs:
                    sg.st.target_hidden[i] = torch.as_tensor(h[sg.a:sg.b])
        h = torch.as_tensor(h)
        for sg in segs:
            sg.st.pos += sg.T
            sg.st.final_hidden = h[sg.a:sg.b]
        t0 = time.perf_counter()
        logits = self.L("head", rmsnorm(h, self.w["norm.weight"], c.rms_norm_eps))
        self.phases.add("dense", t0)
        return [logits[sg.a:sg.b] for sg in segs]

    def _layer(self, segs, i, h, pos, tok, rows, sel, fw):
        """fw: what the forward's layers share: its positions' RoPE tables, the last decode batch's
        selected rows (keyed by kv source and index source: reuse layers read the same rows) and, on
        the fused decode path (runtime/model/decode.py), its intermediates' buffers. A pair's rows are
        first built after its source is written (a source is written at its own layer, before its
        attention, or at the encoder's end for the decoder's, and kv_source_of(i) <= i), so they are
        never stale within the forward."""
        c = self.cfg
        fused = self.fused.layers[i] if fw["fused"] else None          # h: numpy [S, H] when fused, else a tensor
        if i in c.engram_layer_ids:
            held = fused and self.engram.held_rows(i, rows[i])
            if held:                                      # in memory: the whole layer in one call, `dense`
                t0 = time.perf_counter()
                h = fused.engram(h, held)
                self.phases.add("dense", t0)
            elif fused:
                h = self._engram(i, torch.from_numpy(h), rows[i]).numpy()
            else:
                h = self._engram(i, h, rows[i])           # its wait is `engram_wait`, its linears `dense`
        t0 = time.perf_counter()
        x = fused.attn_in(h, *fw["rope_np"], fw["work"]) if fused else self._attn_in(i, h, pos, fw)
        if i in c.kv_source_layers and i < c.num_encoder_layers:
            for sg in segs:
                r = slice(sg.a, sg.b)
                lat, ik = ((x["lat"][r], x["ik"][r]) if fused else
                           (self.L(f"layers.{i}.attn.wkv_c", x["a"][r]), self.L(f"layers.{i}.attn.wi_k", x["a"][r])))
                sg.st.sources[i].write(pos[r], lat, ik)
        t_att = time.perf_counter()            # attention: the indexer, the selected rows, the window
        out = self.fused.attention(segs, i, sel, fw) if fused else self._attention(segs, i, x, pos, sel, fw)
        self.phases.add("attention", t_att)
        t_wo = time.perf_counter()             # the output projection, the MoE's norm and router
        if not fused:
            h = h + self.L(f"layers.{i}.attn.wo", out.reshape(len(h), -1))
            m, ids, wts = self._moe_in(i, h, tok)
            self.phases.seconds["dense"] += (t_att - t0) + (time.perf_counter() - t_wo)   # linears, norms, rope
            return h + self.experts.routed(i, m, ids, wts, shared=bool(c.n_shared_experts))
        h = fused.attn_out(h, out, fw["work"])         # a new array: the MoE's output is added into it
        n = fw["work"].n
        ids, wts = (n["ids"], n["wts"]) if i >= c.n_hash_layers else (t.numpy() for t in self._hash_route(i, tok))
        self.phases.seconds["dense"] += (t_att - t0) + (time.perf_counter() - t_wo)
        h += self.experts.routed_np(i, n["m"], ids, wts, shared=bool(c.n_shared_experts))
        return h

    def _fused_step(self, segs, fw) -> bool:
        """Whether this forward takes the fused decode calls (runtime/model/decode.py): every sequence
        gives one token or a DSpark verify block (a prompt chunk of several tokens keeps the block path,
        DSpark on or off), at most decode_layer.MAX_ROWS rows in all, the model is float32 on the CPU
        with every layer's weights in forms the calls take. Each row then computes what one-token decode
        computes at its position, to the bit (the same kernels, row by row, each writing its window
        before the next attends): greedy verification is lossless on the runtime itself. Sets fw's
        buffers if so."""
        if (not self.fuse_decode or segs[-1].b > MAX_ROWS or any(sg.b - sg.a > 1 and not sg.verify for sg in segs)
                or self.device != "cpu" or self.dtype != torch.float32 or not hasattr(self.experts, "routed_np")):
            return False
        if self.fused is None:
            c = self.cfg
            self.fused = FusedDecode(c, self.w, _inv_freq(c.kv_lora_rank // 2, c.rope_theta).numpy())
        return self.fused.begin(segs, self._decode_rows(segs[0].st), fw)

    def _attn_in(self, i, h, pos, fw) -> dict:
        """The unfused form of FusedLayer.attn_in: the attention's inputs from h [T, H]."""
        c, w, T = self.cfg, self.w, len(h)
        a = rmsnorm(h, w[f"layers.{i}.attn_norm.weight"], c.rms_norm_eps)
        ql = self.L(f"layers.{i}.attn.wq_a", a)
        q = rope(self.L(f"layers.{i}.attn.wq_b", ql).view(T, c.num_attention_heads, c.kv_lora_rank), pos, c.rope_theta, fw["rope"])
        cw = rmsnorm(self.L(f"layers.{i}.attn.wkv", a), w[f"layers.{i}.attn.kv_norm.weight"], c.rms_norm_eps)
        return {"a": a, "ql": ql, "q": q, "cw": cw, "kn": rope(cw, pos, c.rope_theta, fw["rope"])}   # kn [T, C] window keys

    def _attention(self, segs, i, x, pos, sel, fw):
        """Layer i's attention over the step's rows (x: `_attn_in`'s tensors). -> [T, Hq, C]."""
        c = self.cfg
        a, ql, q, cw, k_new = (x[k][:len(pos)] for k in ("a", "ql", "q", "cw", "kn"))
        glob_layer = c.layer_mode(i) != "window"
        if glob_layer:
            xs = c.index_source_of(i)
            for sg, s_sel in zip(segs, sel):   # the indexer per sequence, over its own state
                if xs == i:
                    r = slice(sg.a, sg.b)
                    s_sel[i] = self._select(sg.st, i, a[r], ql[r], pos[r])
        # one-query segments (decode tokens) in one batched pass: the same arithmetic alone or batched,
        # whatever else shares the step; longer ones (prompt chunks, verify blocks) per sequence
        ones = [j for j, sg in enumerate(segs) if sg.b - sg.a == 1]
        out = torch.empty_like(q)
        if ones:                           # all of the step (decode): rows 0..S-1 in order, a slice
            at = slice(0, len(ones)) if len(ones) == len(pos) else torch.tensor([segs[j].a for j in ones], device=self.device)
            kv = fw.get("kv") or fw.setdefault("kv", self._decode_buffers(segs[0].st, len(ones)))
            n_sel = None
            if glob_layer:                 # held in fw (runtime/budget.py counts it through the MoE)
                key = (c.kv_source_of(i), xs)
                if fw.get("rows", (None,))[0] != key:
                    fw["rows"] = key, self._selected_rows_batch([segs[j].st.sources[key[0]] for j in ones], [sel[j][xs] for j in ones], kv)
                n_sel = fw["rows"][1]
            out[at] = attend_decode(q[at], pos[at], k_new[at], cw[at], [segs[j].st.windows[i] for j in ones], c.window_size, kv, n_sel)
        for sg, s_sel in zip(segs, sel):
            if sg.b - sg.a > 1:
                r = slice(sg.a, sg.b)
                g = self._selected_rows(sg.st.sources[c.kv_source_of(i)], *s_sel[xs]) if glob_layer else None
                out[r] = attend(q[r], pos[r], k_new[r], cw[r], sg.st.windows[i], c.window_size, g)
        for sg in segs:
            sg.st.windows[i].write(pos[sg.a:sg.b], k_new[sg.a:sg.b], cw[sg.a:sg.b])
        return out

    def _selected_rows(self, src, idx, ok):
        """-> glob(b0, b1): queries b0..b1-1's selected rows, dequantized: (roped keys, values, ok)."""
        theta, r = self.cfg.rope_theta, src.r

        def glob(b0, b1):
            bi = idx[b0:b1]
            vals = src.latents(bi)                                           # [B, k, C]
            # the tables of each distinct row once (a prompt chunk's queries select from the same few
            # rows: B k positions, P / r distinct), gathered: the same values, ~5% of a prefill on mini
            u, inv = torch.unique((bi + 1) * r - 1, return_inverse=True)
            cu, su = rope_tables(u, vals.shape[-1] // 2, theta, vals.dtype)
            keys = rope(vals.reshape(-1, vals.shape[-1]), None, theta, (cu[inv.reshape(-1)], su[inv.reshape(-1)])).view_as(vals)
            return keys, vals, ok[b0:b1]
        return glob

    def _decode_rows(self, st) -> int:
        """Rows of a decode query's buffers: index_topk + R + 1, R the window ring's slots."""
        return (self.cfg.index_topk if self._global_layers else 0) + st.windows[0].R + 1

    def _decode_buffers(self, st, S: int):
        """A decode batch's rows (attention.attend_decode), held for the forward: keys and values
        [S, index_topk + R + 1, C] (runtime/budget.py forward_shared_bytes)."""
        c = self.cfg
        shape = (S, self._decode_rows(st), c.kv_lora_rank)
        return torch.empty(shape, dtype=self.dtype, device=self.device), torch.empty(shape, dtype=self.dtype, device=self.device)

    def _selected_rows_batch(self, srcs, picks, kv):
        """One query per sequence: each sequence's selected rows (idx [1, k], ok [1, k]; those not ok
        dropped, the order kept) from its own source, dequantized and roped (the same values as
        `_selected_rows`; on the CPU in one numba call, runtime/model/kv.py `rows_into`) into rows 0..
        of the decode buffers kv. -> rows written per sequence."""
        c, n_sel = self.cfg, []
        for j, (src, (idx, o)) in enumerate(zip(srcs, picks)):
            rows = idx[0][o[0]]
            n = len(rows)
            tables = rope_tables((rows + 1) * src.r - 1, c.kv_lora_rank // 2, c.rope_theta, self.dtype)
            if not src.rows_into(rows, *tables, kv[0][j, :n], kv[1][j, :n]):
                vals = src.latents(rows)                                             # [n, C]
                kv[0][j, :n], kv[1][j, :n] = rope(vals, None, c.rope_theta, tables), vals
            n_sel.append(n)
        return n_sel

    def _write_source(self, st, s, a, pos):
        st.sources[s].write(pos, self.L(f"layers.{s}.attn.wkv_c", a), self.L(f"layers.{s}.attn.wi_k", a))

    def _decoder_sources(self, st, h_enc, pos, fw):
        c = self.cfg
        for s in c.kv_source_layers:
            if s >= c.num_encoder_layers and fw.get("fused"):                # one call (runtime/model/decode.py)
                st.sources[s].write(pos, *self.fused.layers[s].source_in(h_enc, fw["work"]))
            elif s >= c.num_encoder_layers:
                self._write_source(st, s, rmsnorm(h_enc, self.w[f"layers.{s}.attn_norm.weight"], c.rms_norm_eps), pos)

    def _select(self, st, x, a, ql, pos):
        """Index layer x: top index_topk visible compressed rows per query. -> (idx [T, k], ok [T, k])."""
        c, T = self.cfg, len(pos)
        src = st.sources[c.kv_source_of(x)]
        if (int(pos[-1]) + 1 - c.window_size) // src.r <= 0:                  # nothing visible yet
            z = torch.zeros(T, 1, dtype=torch.long, device=self.device)
            return z, z.bool()
        qi, wh = self.L(f"layers.{x}.attn.wi_q", ql), self.L(f"layers.{x}.attn.wi_w", a)
        idx, ok, peak = select(src, qi.view(T, c.index_n_heads, c.index_head_dim), wh, pos, c.window_size, c.index_topk,
                               self.dtype, self.device)
        st.indexer_peak_bytes = max(st.indexer_peak_bytes, peak)
        return idx, ok

    def _moe_in(self, i, h, tok):
        """The MoE's input and routing: m = rmsnorm(h, ffn_norm) [T, H], ids, wts [T, K]."""
        c, w = self.cfg, self.w
        m = rmsnorm(h, w[f"layers.{i}.ffn_norm.weight"], c.rms_norm_eps)
        if i < c.n_hash_layers:
            return (m, *self._hash_route(i, tok))
        return (m, *self._route(self.L(f"layers.{i}.ffn.gate", m), w[f"layers.{i}.ffn.gate.bias"]))

    def _hash_route(self, i, tok):
        """Hash layers: tid2eid[token], each weight 1/K."""
        ids = self.w[f"layers.{i}.ffn.tid2eid"][tok]
        return ids, torch.full(ids.shape, 1.0 / self.cfg.num_experts_per_tok, dtype=self.dtype, device=self.device)

    def _route(self, logits, bias):
        """logits [T, E] -> the top num_experts_per_tok of sigmoid + bias (ids [T, K]) and their sigmoid
        scores normalised x routed_scaling_factor (wts [T, K]); on the CPU in one call (kernels/router.py)."""
        c, K = self.cfg, self.cfg.num_experts_per_tok
        if numba_ok(logits, bias):
            ids = torch.empty(len(logits), K, dtype=torch.long)
            wts = torch.empty(len(logits), K, dtype=logits.dtype)
            router.route(logits.numpy(), bias.numpy(), c.routed_scaling_factor, ids.numpy(), wts.numpy())
            return ids, wts
        scores = torch.sigmoid(logits)
        ids = torch.topk(scores + bias, K, dim=-1).indices
        wts = scores.gather(1, ids)
        return ids, wts / wts.sum(-1, keepdim=True) * c.routed_scaling_factor

    # ------------------------------------------------------------------ Engram
    def _engram_row_ids(self, st, p0, T) -> dict:
        """{Engram layer: row ids [T, slots]} of positions p0.. of this sequence (hashed n-grams)."""
        c = self.cfg
        if not c.engram_layer_ids:
            return {}
        lo = max(0, p0 - (c.engram_max_ngram_size - 1))    # the tokens position p0's n-grams reach back to
        cids = self.cmap[np.asarray(st.tokens[lo:], dtype=np.int64)].astype(np.int64)   # int64, as engram_rows takes
        return {i: engram_rows(cids, p0 - lo, c.engram_compressed_vocab_size, c.engram_max_ngram_size, c.engram_n_heads,
                               primes, offsets, seeds) for i, (primes, offsets, seeds) in self.engram_ranges.items()}

    def _engram(self, i, h, row_ids):
        t0 = time.perf_counter()
        e = self.engram.rows(i, row_ids, self.dtype).to(device=self.device).reshape(len(h), -1)   # [T, S*D]
        self.phases.add("engram_wait", t0)
        t0 = time.perf_counter()
        k = self.L(f"layers.{i}.engram.wk", e)
        v = self.L(f"layers.{i}.engram.wv", e)
        if numba_ok(h, k, v) and h.dtype == k.dtype == v.dtype:        # one call on the CPU (kernels/engram_gate.py)
            out = torch.empty_like(h)
            engram_gate.gate(h.numpy(), k.numpy(), v.numpy(), RMS_EPS, out.numpy())
        else:
            gate = torch.sigmoid((rmsnorm(h) * rmsnorm(k)).sum(-1, keepdim=True) / math.sqrt(self.cfg.hidden_size))
            out = h + gate * v
        self.phases.add("dense", t0)
        return out

    # ------------------------------------------------------------------ DSpark drafter
    def draft(self, tok: int, hidden: list) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter step (stand-in for the unpublished DSpark head): the last token's embedding and
        the target layers' hidden states (or, after the first step, the drafter's own output repeated)
        -> eh_proj -> dspark_num_layers blocks (window attention over the token itself, the drafter's
        own MoE + shared expert) -> mtp.norm -> the shared LM head. -> (logits [V], hidden [H])."""
        c, w = self.cfg, self.w
        t0 = time.perf_counter()
        e = rmsnorm(w["embed.weight"][tok].to(self.dtype), w["mtp.0.enorm.weight"], c.rms_norm_eps)
        hs = [rmsnorm(h.to(self.dtype), w["mtp.0.hnorm.weight"], c.rms_norm_eps) for h in hidden]
        x = self.L("mtp.0.eh_proj", torch.cat([e] + hs)[None])                  # [1, H]
        for k in range(c.dspark_num_layers):
            p = f"mtp.{k}"
            a = rmsnorm(x, w[f"{p}.attn_norm.weight"], c.rms_norm_eps)
            cw = rmsnorm(self.L(f"{p}.attn.wkv", a), w[f"{p}.attn.kv_norm.weight"], c.rms_norm_eps)
            x = x + self.L(f"{p}.attn.wo", cw.repeat(1, c.num_attention_heads))  # one key: softmax = 1
            m = rmsnorm(x, w[f"{p}.ffn_norm.weight"], c.rms_norm_eps)
            ids, wts = self._route(self.L(f"{p}.ffn.gate", m), w[f"{p}.ffn.gate.bias"])
            x = x + self.experts.drafter_moe(k, m, ids, wts)
        self.phases.add("dspark_draft", t0)
        out = rmsnorm(x, w["mtp.norm.weight"], c.rms_norm_eps)
        return self.L("head", out)[0], x[0]
