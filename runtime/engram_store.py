"""Engram tables behind one interface: rows(layer, row_ids [T, S]) -> float32 [T, S, D].

`HostEngram` keeps the tables where the checkpoint maps them (the in-RAM placement): codes
[rows, D] fp8 and scales [rows, D/32] ue8m0, dequantized per lookup. The NVMe placements (O_DIRECT
batched reads with a row cache, mmap through the page cache) implement the same interface.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.formats import dequantize_fp8_rows
from runtime.checkpoint.reader import Checkpoint


class HostEngram:
    def __init__(self, ck: Checkpoint):
        cfg = ck.config
        self.codes = {i: ck.tensor(f"layers.{i}.engram.embed.weight") for i in cfg.engram_layer_ids}
        self.scales = {i: ck.tensor(f"layers.{i}.engram.embed.scale") for i in cfg.engram_layer_ids}
        self.rows_requested = 0

    def rows(self, layer: int, row_ids: np.ndarray) -> torch.Tensor:
        T, S = row_ids.shape
        idx = torch.from_numpy(np.ascontiguousarray(row_ids).reshape(-1))
        self.rows_requested += idx.numel()
        x = dequantize_fp8_rows(self.codes[layer][idx], self.scales[layer][idx])
        return x.view(T, S, -1)
