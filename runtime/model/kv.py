"""What one sequence keeps between forwards, in V4.1's storage format, and nothing more.

Grows with the context (per kv source layer s, ratio r = compress_ratios[s], one row per r positions):
  latent  FP4 E2M1 codes [rows, C/2] + one E4M3 scale per 16 channels [rows, C/16]
  index   E4M3 key [rows, Di] + one float32 scale [rows]
  -> sum_s (C/2 + C/16 + Di + 4) / r_s bytes per token = ModelConfig.kv_bytes_per_token (test).
Constant (`fixed_bytes`), whatever the context:
  window  per layer a ring of R = window_size - 1 + spare roped keys and values [R, C] + positions [R]
  tail    per source a ring of r + spare per-position latents and index keys (the row being filled)
`spare` is the deepest rollback (DSpark: draft_length): rejected drafts overwrite ring slots, so the
rings keep that many more positions. A row is the mean of its r positions, computed once from their
exact per-position values when its last position is written, so chunking never changes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.arrays import numba_ok, numpy_views
from kernels import indexer_top, kv_quant, latent_rows, window_keys
from kernels.formats import dequantize_fp4_e4m3, dequantize_fp8_rowscale
from kernels.kv_quant import fp4_e4m3, fp8_rowscale
from runtime.config import ModelConfig


class Ring:
    """The last R positions of per-position vectors, slot = position % R; pos -1 = empty."""

    def __init__(self, R: int, widths: tuple, dtype, device):
        self.R = R
        self.data = [torch.zeros(R, w, dtype=dtype, device=device) for w in widths]
        self.pos = torch.full((R,), -1, dtype=torch.long, device=device)
        # (keys, values, positions) as kernels/window_keys.py gathers them: numpy views of CPU tensors
        # share their memory and `write` writes in place, so they are made once
        self.views = numpy_views(*self.data, self.pos)

    def write(self, pos: torch.Tensor, *vals: torch.Tensor) -> None:
        """pos [T] ascending; vals [T, w] each. Only the last R positions can be kept."""
        if self.R == 0:
            return
        if len(vals) == 2 and numba_ok(pos, *vals) and all(v.dtype == d.dtype for v, d in zip(vals, self.data)):
            window_keys.write(self.views, *numpy_views(pos, *vals))      # one call (kernels/window_keys.py)
            return
        pos = pos[-self.R:]
        slot = pos % self.R
        for d, v in zip(self.data, vals):
            d[slot] = v[-self.R:]
        self.pos[slot] = pos

    def get(self, lo: int, hi: int) -> list[torch.Tensor]:
        """Vectors of positions lo..hi-1 (all must be held) -> [hi-lo, w] each."""
        if hi <= lo:
            return [d[:0] for d in self.data]
        want = torch.arange(lo, hi, device=self.pos.device)
        slot = want % self.R
        if not bool((self.pos[slot] == want).all()):
            raise RuntimeError(f"ring lost positions {lo}..{hi - 1}: the rollback was deeper than its spare")
        return [d[slot] for d in self.data]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data + [self.pos])


class Compressed:
    """One kv source layer's global rows in the stored format, and the tail of the row being filled."""

    def __init__(self, r: int, max_context: int, C: int, Di: int, spare: int, dtype, device):
        n = max_context // r
        u8 = dict(dtype=torch.uint8, device=device)
        self.r, self.dtype = r, dtype
        self.lat_codes, self.lat_scales = torch.zeros(n, C // 2, **u8), torch.zeros(n, C // 16, **u8)
        self.ik_codes, self.ik_scale = torch.zeros(n, Di, **u8), torch.zeros(n, dtype=torch.float32, device=device)
        self.tail = Ring(r + spare, (C, Di), dtype, device)
        cpu = self.lat_codes.device.type == "cpu"      # the stored rows as the CPU kernels read them (views, made once)
        self.lat_views = (self.lat_codes.numpy(), self.lat_scales.numpy()) if cpu else None
        self.ik_views = (self.ik_codes.numpy(), self.ik_scale.numpy()) if cpu else None

    def write(self, pos: torch.Tensor, lat: torch.Tensor, ik: torch.Tensor) -> None:
        """Positions pos [T] (contiguous) with their latents [T, C] and index keys [T, Di]: every row
        whose last position is among them is (re)computed from its r exact per-position values, their
        mean (on the CPU in float32 in one call, kernels/kv_quant.py write_rows: summed in float64;
        the torch form, a GPU's, sums in float32)."""
        if (self.lat_views is not None and self.dtype == torch.float32 and lat.dtype == ik.dtype == torch.float32
                and numba_ok(pos, lat, ik) and kv_quant.write_rows(self.tail.views, *numpy_views(pos, lat, ik), self.r,
                                                                   self.lat_views, self.ik_views)):
            return
        r, p0, p1 = self.r, int(pos[0]), int(pos[-1]) + 1
        g0, g1 = p0 // r, p1 // r                                  # rows g0..g1-1 complete here
        if g1 > g0:
            old_lat, old_ik = self.tail.get(g0 * r, p0)
            lat_all = torch.cat([old_lat, lat[: g1 * r - p0]])       # [(g1-g0) r, C]
            ik_all = torch.cat([old_ik, ik[: g1 * r - p0]])
            rows_lat = lat_all.view(g1 - g0, r, -1).mean(1)
            rows_ik = ik_all.view(g1 - g0, r, -1).mean(1)
            self.lat_codes[g0:g1], self.lat_scales[g0:g1] = fp4_e4m3(rows_lat)       # formats.py's, in one call on the CPU
            self.ik_codes[g0:g1], self.ik_scale[g0:g1] = fp8_rowscale(rows_ik)
        self.tail.write(pos, lat, ik)

    def latents(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows idx [...] -> [..., C] in the model's dtype."""
        return dequantize_fp4_e4m3(self.lat_codes[idx], self.lat_scales[idx], self.dtype)

    def rows_into(self, rows, cos, sin, K, V) -> bool:
        """Rows `rows` [n] dequantized into V [n, C] and roped with (cos, sin) [n, C/2] into K, in one
        call (kernels/latent_rows.py) where all are CPU float tensors. -> False (nothing done) else."""
        if not numba_ok(rows, cos, sin, K, V):
            return False
        latent_rows.selected(*self.lat_views, *numpy_views(rows, cos, sin, K, V))
        return True

    def top_rows(self, qi, wh, score, k: int, idx, ok) -> bool:
        """One query's scores over rows 0..len(score)-1 and its top k (kernels/indexer_top.py
        select_one: qi [Hi, Di], wh [Hi] -> score [n], idx [k], ok [k]) in one call where all are CPU
        tensors numba reads. -> False (nothing done) else."""
        if not numba_ok(qi, wh, score, idx):
            return False
        q, w, s, i = numpy_views(qi, wh, score, idx)
        indexer_top.select_one(*self.ik_views, indexer_top.E4M3, q, w, s, k, i, ok.numpy())
        return True

    def index_keys(self, lo: int, hi: int) -> torch.Tensor:
        """Rows lo..hi-1's index keys [hi-lo, Di] in the model's dtype (on the CPU through
        kernels/indexer_top.py: the same bits)."""
        out = torch.empty(hi - lo, self.ik_codes.shape[1], dtype=self.dtype, device=self.ik_codes.device)
        if not numba_ok(out):
            return dequantize_fp8_rowscale(self.ik_codes[lo:hi], self.ik_scale[lo:hi], self.dtype)
        indexer_top.index_keys(self.ik_views[0][lo:hi], self.ik_views[1][lo:hi], out.numpy())
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lat_codes, self.lat_scales, self.ik_codes, self.ik_scale))


@dataclass
class SeqState:
    """Everything one sequence keeps between chunks (the KV cache and friends)."""
    pos: int
    tokens: list
    max_context: int
    windows: list        # per layer: Ring of (roped key, value) over the last window positions
    sources: dict        # kv source layer -> Compressed
    indexer_peak_bytes: int = 0
    target_hidden: dict = field(default_factory=dict)   # DSpark target layer -> [T', H] of the last forward
    final_hidden: torch.Tensor | None = None            # [T', H] before the final norm (drafter distillation)

    @classmethod
    def new(cls, cfg: ModelConfig, max_context: int, spare: int = 0, dtype=torch.float32, device="cpu") -> "SeqState":
        C, R = cfg.kv_lora_rank, cfg.window_size - 1 + spare
        return cls(0, [], max_context, [Ring(R, (C, C), dtype, device) for _ in range(cfg.num_hidden_layers)],
                   {s: Compressed(cfg.compress_ratios[s], max_context, C, cfg.index_head_dim, spare, dtype, device)
                    for s in cfg.kv_source_layers})

    def rollback(self, pos: int) -> None:
        """Forget positions >= pos (rejected draft tokens): their ring slots and rows are rewritten when
        those positions are computed again, and no query sees a position before it is rewritten."""
        self.pos = pos
        del self.tokens[pos:]

    def context_bytes(self) -> int:
        """Bytes that grow with max_context: the compressed rows."""
        return sum(s.nbytes() for s in self.sources.values())

    def fixed_bytes(self) -> int:
        """Bytes whatever the context: the window rings and the rows' tails."""
        return sum(w.nbytes() for w in self.windows) + sum(s.tail.nbytes() for s in self.sources.values())

