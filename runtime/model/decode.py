"""A decode step's layers in a few numba calls each (kernels/decode_layer.py), on the CPU.

Model._forward_many takes this path when every sequence of the step gives one token or a DSpark verify
block (decode, a decode batch: at most decode_layer.MAX_ROWS rows), the model is float32 on the CPU and
every layer's weights are held as FP8 / BF16 that the SIMD GEMVs take (`FusedLayer.make` -> None
otherwise). Per layer: `attn_in`, one `attend_one` per row (a verify block's rows in order: each
attends over the window its predecessors wrote, as one-token decode does), `attn_out`, then the MoE
call (and an Engram layer held in memory, a decoder kv source: one call each). The same kernels on the
same rows as the unfused path: the same bits for one-token rows (tests/runtime/test_decode_fused.py);
a verify block's row gets the bits one-token decode gets at its position (tests/runtime/test_dspark.py),
which the unfused path's block attention does not. ~20 fewer Python-level calls a layer between two
MoE reads, each of which costs 10-80 us there (kernels/lab/README.md, "a fourth session").
What a layer computes besides its output is consumed within the layer (or, an index layer's top rows,
within the forward), so those buffers (`Work`, runtime/budget.py decode_work_bytes) are made for the
step's width and kept for the next step of that width (one width at a time; forwards of one model run
one after another); the layer's output h2 is new each layer (sequences keep references to it:
DSpark's target hidden states). The residual stream stays a numpy array through the layers (a
tensor's `.numpy()` or a `torch.empty` costs ~35 us after a layer's expert read, ~2 us warm).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch

from kernels import decode_layer, indexer_top, latent_rows, norms
from kernels.cpu_moe import STAB
from kernels.formats import KV_FP4_GROUP
from kernels.fp8_dense import E4M3
from kernels.norms import RMS_EPS


def _fp8(w) -> tuple:
    return (w.q, w.scale) if w is not None else (np.zeros((0, 0), np.uint8), np.zeros((0, 0), np.uint8))


def _bf16(w) -> np.ndarray:
    return w.bits if w is not None else np.zeros((0, 0), np.uint16)


@dataclass
class Work:
    """A step's per-layer intermediates (torch tensors and their numpy views, the same memory), and its
    decode buffers kv = (keys, values) [S, rows, C] (Model._decode_buffers' rows; counted with the
    forward's shared tensors, runtime/budget.py forward_shared_bytes)."""
    t: dict
    n: dict
    kv: tuple = ()

    @classmethod
    def make(cls, S: int, shapes: dict, kv_shape: tuple = (0, 0)) -> "Work":
        t = {k: torch.empty((S,) + s, dtype=dt) for k, (s, dt) in shapes.items()}
        kv = tuple(np.empty((S,) + tuple(kv_shape), np.float32) for _ in range(2))
        return cls(t, {k: v.numpy() for k, v in t.items()}, kv)

    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.n.values())


class FusedLayer:
    """One layer's weights as the fused calls take them (`make`: None where they do not fit)."""

    def __init__(self, cfg, w, i: int):
        p = f"layers.{i}."
        get = lambda n, use=True: w[p + n + ".weight"] if use else None          # noqa: E731
        self.cfg = cfg
        self.index, self.source, self.decoder_source, self.routed, engram = self.roles(cfg, i)
        self.block = get("attn.wq_a").block
        self.wq = [*_fp8(get("attn.wq_a")), *_fp8(get("attn.wq_b")), *_fp8(get("attn.wkv")),
                   *_fp8(get("attn.wi_q", self.index)), _bf16(get("attn.wi_w", self.index)),
                   *_fp8(get("attn.wkv_c", self.source)), *_fp8(get("attn.wi_k", self.source))]
        self.wo = _fp8(get("attn.wo"))
        self.gate = _bf16(get("ffn.gate", self.routed))
        self.bias = w[p + "ffn.gate.bias"].numpy() if self.routed else np.zeros(0, np.float32)
        self.norms = [w[p + n + ".weight"].numpy() for n in ("attn_norm", "attn.kv_norm", "ffn_norm")]
        self.engram_w = [*_fp8(get("engram.wk")), *_fp8(get("engram.wv"))] if engram else None
        self.source_w = [*_fp8(get("attn.wkv_c")), *_fp8(get("attn.wi_k"))] if self.source or self.decoder_source else None

    @staticmethod
    def roles(cfg, i: int) -> tuple:
        """(index layer, encoder kv source (written in the layer), decoder kv source (written at the
        encoder's end), router-routed (not hashed), Engram layer) of layer i."""
        return (cfg.layer_mode(i) != "window" and cfg.index_source_of(i) == i,
                i in cfg.kv_source_layers and i < cfg.num_encoder_layers, i in cfg.kv_source_layers and i >= cfg.num_encoder_layers,
                i >= cfg.n_hash_layers, i in cfg.engram_layer_ids)

    @classmethod
    def make(cls, cfg, w, i: int, rows: int) -> "FusedLayer | None":
        """Layer i's fused form for steps of up to `rows` rows, or None: a weight held in another form
        (float copies, a device's) or one the SIMD GEMVs do not take, FP8 blocks of more than one shape."""
        index, source, decoder_source, routed, engram = cls.roles(cfg, i)
        fp8 = (["attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo"] + ["attn.wi_q"] * index
               + ["attn.wkv_c", "attn.wi_k"] * (source or decoder_source) + ["engram.wk", "engram.wv"] * engram)
        bf16 = ["attn.wi_w"] * index + ["ffn.gate"] * routed
        fp8, bf16 = ([w.get(f"layers.{i}.{n}.weight") for n in names] for names in (fp8, bf16))
        if not decode_layer.fits(rows, fp8, bf16) or len({x.block for x in fp8}) != 1:
            return None
        return cls(cfg, w, i)

    def attn_in(self, h: np.ndarray, cos: np.ndarray, sin: np.ndarray, work: Work) -> dict:
        """-> {a, ql, q, cw, kn, qi, wh, lat, ik}: tensors (views of `work`; the last four only on
        index / source layers)."""
        c, n = self.cfg, work.n
        bn, bk = self.block
        e = NO_OUTPUT
        decode_layer.attn_in(h, self.norms[0], self.norms[1], c.rms_norm_eps, bn, bk, STAB, cos, sin, *self.wq,
                             n["a"], n["ql"], n["q"], n["cw"], n["kn"], n["qi"] if self.index else e,
                             n["wh"] if self.index else e, n["lat"] if self.source else e, n["ik"] if self.source else e,
                             numba.get_num_threads())
        return work.t

    def source_in(self, h: np.ndarray, work: Work) -> tuple:
        """A decoder kv source's (latents, index keys) [S, C], [S, Di] from the encoder's output h: views
        of `work` (Compressed.write consumes them at once)."""
        bn, bk = self.block
        S = len(h)
        decode_layer.source_in(h, self.norms[0], self.cfg.rms_norm_eps, bn, bk, STAB, *self.source_w,
                               work.n["lat"][:S], work.n["ik"][:S])
        return work.t["lat"][:S], work.t["ik"][:S]

    def engram(self, h: np.ndarray, table: tuple) -> np.ndarray:
        """An Engram layer's h + gate v (kernels/decode_layer.py engram) from table = (codes, scales, row
        ids [S slots]) as EngramStore.held_rows gives them -> a new array."""
        out = np.empty_like(h)
        bn, bk = self.block
        decode_layer.engram(h, *table, E4M3, STAB, *self.engram_w, bn, bk, RMS_EPS, 1.0 / math.sqrt(h.shape[1]), out)
        return out

    def attn_out(self, h: np.ndarray, o: np.ndarray, work: Work) -> np.ndarray:
        """o [S, Hq, C] -> h2 = h + o wo^T (a new array); m, and on routed layers ids, wts, in `work`."""
        c, n = self.cfg, work.n
        bn, bk = self.block
        h2 = np.empty_like(h)
        decode_layer.attn_out(h, o.reshape(len(h), -1), *self.wo, bn, bk, STAB, self.norms[2], c.rms_norm_eps,
                              self.gate, self.bias, c.routed_scaling_factor, h2, n["m"], n["ids"], n["wts"], numba.get_num_threads())
        return h2


class FusedDecode:
    """A model's fused decode state: every layer's FusedLayer (None where one does not fit: then no
    layer is fused, the fused attention keeping the selections its own way), the held `Work`."""

    def __init__(self, cfg, w, inv_freq: np.ndarray):
        layers = [FusedLayer.make(cfg, w, i, decode_layer.MAX_ROWS) for i in range(cfg.num_hidden_layers)]
        self.cfg, self.layers, self.work, self.inv_freq = cfg, layers if all(layers) else None, None, inv_freq

    def begin(self, segs, rows: int, fw) -> bool:
        """A decode step of `segs` (a sequence's next token, or its DSpark verify block: rows sg.a..sg.b-1
        at positions st.pos, st.pos + 1, ...), decode buffers of `rows` rows: fw's work and its positions'
        RoPE tables (`rope_np`), its rows in order (`decode_rows`). -> False where the layers do not fit."""
        if self.layers is None:
            return False
        S, c = segs[-1].b, self.cfg
        if self.work is None or self.work.kv[0].shape[:2] != (S, rows):   # one width held (runtime/budget.py)
            self.work = None                                              # the old freed before the new
            self.work = Work.make(S, work_shapes(c), (rows, c.kv_lora_rank))
        fw["work"] = self.work
        fw["rope_np"] = self.work.n["cos"], self.work.n["sin"]
        fw["decode_rows"] = decode_rows(segs)
        norms.rope_tables(np.array([p for _, p, _ in fw["decode_rows"]], np.int64), self.inv_freq, *fw["rope_np"])
        return True

    def attention(self, segs, i, sel, fw) -> np.ndarray:
        """Model._attention for a fused decode step: each row's query in one call (kernels/decode_layer.py
        attend_one, the window's write included), a verify block's rows in order, so each sees the
        window as one-token decode left it. sel[j][x] holds row j's top rows' count k; their ids sit in
        the step's buffers of index layer x. -> [S, Hq, C] (numpy)."""
        c, n = self.cfg, fw["work"].n
        glob = c.layer_mode(i) != "window"
        xs = c.index_source_of(i) if glob else None
        K, V = fw["work"].kv
        key = (c.kv_source_of(i), xs) if glob else None
        fresh = glob and fw.get("rows", (None,))[0] != key
        n_rows = list(fw["rows"][1]) if glob and not fresh else [0] * len(sel)
        for st, p, j in fw["decode_rows"]:
            n_vis, ix = -1, NO_INDEX
            if xs == i:                         # the indexer, over this sequence's rows
                src = st.sources[c.kv_source_of(i)]
                n_vis = max(0, (p + 1 - c.window_size) // src.r)
                k = min(c.index_topk, n_vis) if n_vis else 1
                sel[j][i] = k
                ix = (*src.ik_views, indexer_top.E4M3, n["qi"][j].reshape(c.index_n_heads, c.index_head_dim), n["wh"][j])
                if n_vis:
                    st.indexer_peak_bytes = max(st.indexer_peak_bytes, n_vis * 4 + k * 9 + n_vis * 12)   # as `select`
            if glob:
                k = sel[j][xs]
                idx, ok = n[f"idx{xs}"][j, :k], n[f"ok{xs}"][j, :k]
            else:
                idx, ok = NO_ROWS
            lat = st.sources[key[0]].lat_views if fresh else NO_LATENTS
            r = -1 if not glob else st.sources[key[0]].r if fresh else 0
            n_rows[j] = decode_layer.attend_one(
                p, c.window_size, 1.0 / math.sqrt(c.kv_lora_rank), n["q"][j], n["kn"][j], n["cw"][j],
                *st.windows[i].views, K[j], V[j], n["o"][j], n_vis, *ix, idx, ok,
                r, *lat, latent_rows.PAIRS, indexer_top.E4M3, KV_FP4_GROUP, self.inv_freq, n_rows[j])
        if fresh:
            fw["rows"] = key, n_rows
        return n["o"]


def decode_rows(segs):
    """A fused step's rows in order: (state, position, row) for each sequence's tokens."""
    return [(sg.st, sg.st.pos + t, sg.a + t) for sg in segs for t in range(sg.b - sg.a)]


def work_shapes(cfg) -> dict:
    """The per-layer intermediates: name -> (shape without the step's rows, dtype); idx{x}, ok{x}: index
    layer x's top rows, read again by the layers that reuse its selection."""
    C, Hq, H, k, f = cfg.kv_lora_rank, cfg.num_attention_heads, cfg.hidden_size, cfg.index_topk, torch.float32
    out = {"a": ((H,), f), "ql": ((cfg.q_lora_rank,), f), "q": ((Hq, C), f), "cw": ((C,), f), "kn": ((C,), f),
           "qi": ((cfg.index_n_heads * cfg.index_head_dim,), f), "wh": ((cfg.index_n_heads,), f), "lat": ((C,), f),
           "ik": ((cfg.index_head_dim,), f), "o": ((Hq, C), f), "m": ((H,), f), "cos": ((C // 2,), f), "sin": ((C // 2,), f),
           "ids": ((cfg.num_experts_per_tok,), torch.long), "wts": ((cfg.num_experts_per_tok,), f)}
    for x in sorted({cfg.index_source_of(i) for i in range(cfg.num_hidden_layers) if cfg.layer_mode(i) != "window"}):
        out[f"idx{x}"], out[f"ok{x}"] = ((k,), torch.long), ((k,), torch.bool)
    return out


# decode_layer.attend_one's arguments a layer does not use, typed as the used ones
NO_INDEX = (np.zeros((0, 0), np.uint8), np.zeros(0, np.float32), indexer_top.E4M3, np.zeros((0, 0), np.float32),
            np.zeros(0, np.float32))
NO_ROWS = (np.zeros(1, np.int64), np.zeros(1, np.bool_))
NO_OUTPUT = np.zeros((0, 0), np.float32)          # decode_layer.attn_in's outputs a layer does not have
NO_LATENTS = (np.zeros((0, 0), np.uint8), np.zeros((0, 0), np.uint8))
