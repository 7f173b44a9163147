"""Engram tables behind one interface, in the three placements a plan can choose.

  prefetch({layer: row_ids [T, S]})   issue every read for these rows now (asynchronously)
  rows(layer, row_ids) -> float32 [T, S, D]   the rows, waiting for their prefetch if needed

Row indices depend only on token ids, so the model hashes every position at the start of a forward
and prefetches: in prefill all reads go out before the first layer; in decode layer 1's reads hide only
behind layer 0, layer 14's behind layers 0-13 (V4.1). Placements:
  host         codes [rows, D] fp8 + scales [rows, D/32] copied into RAM at load
  nvme_direct  rows read with O_DIRECT through the runtime's batched reader at the plan's depth, in
               front of a row cache (LRU, `engram_row_cache_mib`); the 8 B/row scales stay in RAM when
               `engram_scales_in_ram` (one read per row), else each row also reads its scales
  nvme_mmap    the shard mapped through the page cache (competes with pinned RAM for it)
A table whose shard is shorter than its header says, or whose row count differs from the config, is
refused at load with both sizes named. Counters: rows requested, cache hits, reads, bytes, wait.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict

import numpy as np
import torch

from kernels.formats import dequantize_fp8_rows
from runtime.checkpoint.reader import Checkpoint
from runtime.io_reader import BatchedReader


class EngramStore:
    def __init__(self, ck: Checkpoint, placement: str = "host", depth: int = 8, row_cache_mib: int = 0,
                 scales_in_ram: bool = True):
        cfg = ck.config
        self.placement, self.D = placement, cfg.engram_head_dim
        self.counters = defaultdict(float)
        self.codes, self.scales, self.where = {}, {}, {}
        for i, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
            name = f"layers.{i}.engram.embed.weight"
            info, sinfo = ck.infos[name], ck.infos[f"layers.{i}.engram.embed.scale"]
            if info.shape[0] != rows:
                raise ValueError(f"{info.path.name}: Engram table of layer {i} has {info.shape[0]} rows, "
                                 f"the config's engram_num_embeddings says {rows}")
            size = info.path.stat().st_size
            if size < info.end or size < sinfo.end:
                raise ValueError(f"{info.path.name}: the Engram shard holds {size} B, its header needs {max(info.end, sinfo.end)} B")
            if placement == "host":
                self.codes[i] = ck.tensor(name).clone()
                self.scales[i] = ck.tensor(sinfo.name).clone()
            elif placement == "nvme_mmap":
                self.codes[i], self.scales[i] = ck.tensor(name), ck.tensor(sinfo.name)
            else:
                self.where[i] = (str(info.path), info.begin, str(sinfo.path), sinfo.begin)
                self.scales[i] = ck.tensor(sinfo.name).clone() if scales_in_ram else None
        self.reader = BatchedReader(depth=depth) if placement == "nvme_direct" else None
        self.row_bytes = self.D + self.D // 32
        self.cache: OrderedDict = OrderedDict()              # (layer, row) -> (codes u8 [D], scales u8 [D/32])
        self.cache_rows = row_cache_mib * (1 << 20) // self.row_bytes
        self._pending: dict = {}
        self._lock = threading.Lock()

    # -------------------------------------------------------------- prefetch / rows
    def prefetch(self, layer_rows: dict) -> None:
        if self.placement != "nvme_direct":
            return
        for layer, ids in layer_rows.items():
            ev = threading.Event()
            self._pending[layer] = (ids, ev, {})
            threading.Thread(target=self._fetch, args=(layer, ids, ev), daemon=True).start()

    def _fetch(self, layer, ids, ev):
        try:
            uniq = np.unique(ids)
            with self._lock:
                have = {int(r): self.cache[(layer, int(r))] for r in uniq if (layer, int(r)) in self.cache}
            miss = [int(r) for r in uniq if int(r) not in have]
            cpath, cbase, spath, sbase = self.where[layer]
            sc = self.scales[layer]
            reqs = [(cpath, cbase + r * self.D, self.D) for r in miss]
            if sc is None:
                reqs += [(spath, sbase + r * (self.D // 32), self.D // 32) for r in miss]
            blobs = self.reader.read(reqs) if reqs else []
            got = {}
            for k, r in enumerate(miss):
                s = blobs[len(miss) + k] if sc is None else sc[r].numpy()
                got[r] = (blobs[k], s)
            with self._lock:
                for r, v in got.items():
                    if self.cache_rows:
                        self.cache[(layer, r)] = v
                        if len(self.cache) > self.cache_rows:
                            self.cache.popitem(last=False)
                self.counters["rows_requested"] += ids.size
                self.counters["unique_rows"] += len(uniq)
                self.counters["cache_hits"] += len(have)
                self.counters["reads"] += len(reqs)
                self.counters["bytes_read"] += sum(n for _, _, n in reqs)
            self._pending[layer][2].update(have)
            self._pending[layer][2].update(got)
        finally:
            ev.set()

    def rows(self, layer: int, row_ids: np.ndarray) -> torch.Tensor:
        T, S = row_ids.shape
        flat = np.ascontiguousarray(row_ids).reshape(-1)
        if self.placement == "nvme_direct":
            p = self._pending.get(layer)
            if p is None or p[0] is not row_ids and not np.array_equal(p[0], row_ids):
                self.prefetch({layer: row_ids})                  # not prefetched: read now (the naive path)
                p = self._pending[layer]
            t0 = time.perf_counter()
            p[1].wait()
            self.counters["wait_s"] += time.perf_counter() - t0
            got = p[2]
            codes = torch.from_numpy(np.stack([got[int(r)][0] for r in flat]))
            scales = torch.from_numpy(np.stack([np.asarray(got[int(r)][1]) for r in flat]))
            del self._pending[layer]
        else:
            idx = torch.from_numpy(flat)
            codes, scales = self.codes[layer][idx], self.scales[layer][idx]
            self.counters["rows_requested"] += flat.size
        x = dequantize_fp8_rows(codes.view(torch.float8_e4m3fn), scales)
        return x.view(T, S, -1)

    def close(self):
        if self.reader:
            self.reader.close()
