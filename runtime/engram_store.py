"""Engram tables behind one interface, in the three placements a plan can choose.

  prefetch({layer: row_ids [T, S]})   issue every read for these rows now (asynchronously)
  rows(layer, row_ids) -> float32 [T, S, D]   the rows, waiting for their prefetch if needed

Row indices depend only on token ids, so the model hashes every position at the start of a forward
and prefetches: in prefill all reads go out before the first layer; in decode layer 1's reads hide only
behind layer 0, layer 14's behind layers 0-13 (V4.1). Placements:
  host         codes [rows, D] fp8 + scales [rows, D/32] copied into RAM at load
  nvme_direct  rows read with O_DIRECT through the runtime's batched reader at the plan's depth and
               engine (`engram_io_engine`: a named engine the kernel refuses fails the load), in
               front of a row cache (LRU, `engram_row_cache_mib`): rows deduplicated, each 4 KiB block
               read once however many rows share it; the 8 B/row scales stay in RAM when
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

from kernels import engram_gate
from kernels.cpu_moe import STAB
from kernels.formats import dequantize_fp8_rows
from kernels.fp8_dense import E4M3
from runtime.checkpoint.reader import Checkpoint
from runtime.io_reader import BLOCK, BatchedReader


class EngramReadError(OSError):
    """An Engram row read failed; raised in the request that needed the rows, naming file and offset."""


def gather_rows(reader: BatchedReader, path: str, base: int, rows: np.ndarray, nbytes: int) -> tuple[np.ndarray, int]:
    """Rows `rows` (sorted, unique) of a [rows, nbytes] tensor at file offset `base` -> (uint8 [n, nbytes],
    blocks read). Each 4 KiB block is read once however many rows share it; a row straddling two
    blocks reads both (consecutive block numbers sit next to each other in the read buffer)."""
    off = base + rows.astype(np.int64) * nbytes
    first, last = off // BLOCK, (off + nbytes - 1) // BLOCK
    blocks = np.unique(np.concatenate([first, last]))
    buf = reader.read_blocks(path, blocks, reuse=True)                   # copied out below
    at = np.searchsorted(blocks, first) * BLOCK + off % BLOCK
    return buf[at[:, None] + np.arange(nbytes)], len(blocks)


class EngramStore:
    def __init__(self, ck: Checkpoint, placement: str = "host", depth: int = 8, row_cache_mib: int = 0,
                 scales_in_ram: bool = True, engine: str = "auto"):
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
        self.reader = None
        if placement == "nvme_direct":                   # auto: $DSV41_IO_ENGINE, else the kernel's first
            self.reader = BatchedReader(depth=depth, engine=None if engine == "auto" else engine)
            try:
                self.reader.require_engine()
            except OSError as e:
                self.reader.close()
                raise OSError(e.errno, f"plan field 'engram_io_engine': {e.strerror}") from e
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
            ev, result = threading.Event(), {}          # this request's own result: a late reader never
            self._pending[layer] = (ids, ev, result)    # writes into a later request's
            threading.Thread(target=self._fetch, args=(layer, ids, ev, result), daemon=True).start()

    def _gather(self, path, base, rows, nbytes) -> np.ndarray:
        out, blocks = gather_rows(self.reader, path, base, rows, nbytes)
        self.counters["reads"] += blocks
        self.counters["bytes_read"] += blocks * BLOCK
        return out

    def _fetch(self, layer, ids, ev, result):
        try:
            uniq, inv = np.unique(ids, return_inverse=True)
            D, DS = self.D, self.D // 32
            codes, scales = np.empty((len(uniq), D), np.uint8), np.empty((len(uniq), DS), np.uint8)
            hit = np.zeros(len(uniq), bool)
            if self.cache_rows:
                with self._lock:
                    for k, r in enumerate(uniq.tolist()):
                        v = self.cache.get((layer, r))
                        if v is not None:
                            self.cache.move_to_end((layer, r))
                            codes[k], scales[k], hit[k] = v[0], v[1], True
            miss = uniq[~hit]
            cpath, cbase, spath, sbase = self.where[layer]
            if len(miss):
                codes[~hit] = self._gather(cpath, cbase, miss, D)
                sc = self.scales[layer]
                scales[~hit] = sc[torch.from_numpy(miss)].numpy() if sc is not None else self._gather(spath, sbase, miss, DS)
            if self.cache_rows:
                with self._lock:
                    for k in np.nonzero(~hit)[0].tolist():
                        self.cache[(layer, int(uniq[k]))] = (codes[k], scales[k])
                    while len(self.cache) > self.cache_rows:
                        self.cache.popitem(last=False)
            self.counters["rows_requested"] += ids.size
            self.counters["unique_rows"] += len(uniq)
            self.counters["cache_hits"] += int(hit.sum())
            result.update(codes=codes, scales=scales, ids=inv.reshape(-1))      # the rows of `uniq`, and each request's
        except Exception as e:                           # re-raised in the request that issued the read
            result["error"] = e
        finally:
            ev.set()

    def held_rows(self, layer: int, row_ids: np.ndarray) -> tuple | None:
        """Where the table is in memory (host, nvme_mmap): (codes uint8 [N, D], scales uint8 [N, D/32],
        row ids int64 [T S]) for a caller that gathers them itself (runtime/model/decode.py), counted
        as `rows` counts them; None for nvme_direct (its reads: `rows`)."""
        if self.placement == "nvme_direct":
            return None
        flat = np.asarray(row_ids, np.int64).reshape(-1)
        self.counters["rows_requested"] += flat.size
        return self.codes[layer].view(torch.uint8).numpy(), self.scales[layer].numpy(), flat

    def rows(self, layer: int, row_ids: np.ndarray, dtype=torch.float32) -> torch.Tensor:
        """Rows row_ids [T, S] of the layer's table, dequantized -> [T, S, D] `dtype` (on the CPU in one
        numba call, kernels/engram_gate.py: the same bits as formats.dequantize_fp8_rows)."""
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
            del self._pending[layer]
            if "error" in p[2]:
                raise EngramReadError(f"Engram table of layer {layer}: {p[2]['error']}") from p[2]["error"]
            codes, scales, ids = p[2]["codes"], p[2]["scales"], p[2]["ids"]
        else:
            self.counters["rows_requested"] += flat.size
            codes, scales, ids = self.codes[layer].view(torch.uint8).numpy(), self.scales[layer].numpy(), flat
        ids = np.asarray(ids, np.int64)
        if dtype in (torch.float32, torch.float64):                     # gathered and dequantized in one call
            out = torch.empty(len(ids), codes.shape[1], dtype=dtype)
            engram_gate.rows(codes, scales, ids, E4M3, STAB, out.numpy())
        else:
            idx = torch.from_numpy(ids)
            out = dequantize_fp8_rows(torch.from_numpy(codes)[idx].view(torch.float8_e4m3fn), torch.from_numpy(scales)[idx], dtype)
        return out.view(T, S, -1)

    def close(self):
        if self.reader:
            self.reader.close()
