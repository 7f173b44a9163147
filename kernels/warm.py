"""Compile (or load from numba's cache) every kernel the runtime calls and start the thread pools, on
toy inputs: one-time process costs, kept out of what a plan's run is measured to add."""
from __future__ import annotations

import numba
import numpy as np
import torch

from kernels import (decode_attn, decode_layer, engram_gate, engram_hash, indexer_top, kv_quant, latent_rows, norms, router,
                     window_keys)
from kernels.bf16_dense import Bf16Weight, bf16_linear
from kernels.cpu_moe import LANES, STAB, Fp4Bank, expert_ffn
from kernels.fp8_dense import E4M3, TILE_MIN_TOKENS, Fp8Weight, fp8_linear


def warm_up(threads: int | None = None) -> None:
    rng = np.random.default_rng(0)
    bank = Fp4Bank.random(2, 64, 64)
    for T in (1, TILE_MIN_TOKENS):                          # decode and prefill widths
        x = rng.standard_normal((T, 64)).astype(np.float32)
        expert_ffn(x, np.zeros((T, 1), np.int64), np.ones((T, 1), np.float32), bank, threads=threads)
        w = Fp8Weight(rng.integers(0, 0x7e, (64, 64), dtype=np.uint8), np.full((2, 2), 120, np.uint8), (32, 32))
        fp8_linear(torch.from_numpy(x), w, threads=threads)
        bf16_linear(torch.from_numpy(x), Bf16Weight(rng.integers(0, 0x3f80, (64, 64), dtype=np.uint16)), threads=threads)
    torch.ones(64, 64) @ torch.ones(64, 64)
    _decode_step(rng)


def _decode_step(rng) -> None:
    """The decode step's small kernels (runtime/model), float32, as the runtime calls them."""
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)       # noqa: E731
    for T in (1, norms.PARALLEL_ROWS):
        norms.rmsnorm(f32(T, 64), f32(64), 1e-6, f32(T, 64))
        norms.rmsnorm(f32(T, 64), None, 1e-6, f32(T, 64))
        norms.rope(f32(T, 2, 64), f32(T, 32), f32(T, 32), f32(T, 2, 64))
        router.route(f32(T, 8), f32(8), 1.0, np.empty((T, 2), np.int64), f32(T, 2))
        router.with_row(np.zeros((T, 2), np.int64), f32(T, 2), 3)
    norms.rope_tables(np.arange(3, dtype=np.int64), np.ones(4), f32(3, 4), f32(3, 4))
    K, V = f32(9, 16), f32(9, 16)
    ring = (f32(4, 16), f32(4, 16), np.arange(4, dtype=np.int64))
    window_keys.write(ring, np.arange(2, dtype=np.int64), f32(2, 16), f32(2, 16))
    window_keys.gather(ring, 4, 4, f32(16), f32(16), K, V, 2)
    decode_attn.attend(ring, 4, 4, f32(16), f32(16), K, V, 2, 0, f32(2, 16), 0.25, f32(2, 16))
    codes, scale = rng.integers(0, 0x7e, (6, 16), dtype=np.uint8), np.ones(6, np.float32)
    indexer_top.index_keys(codes, scale, f32(6, 16))
    score = indexer_top.weigh(f32(2, 6), f32(2), f32(6), 0)
    indexer_top.top(score, 3, np.empty(3, np.int64), np.empty(3, np.bool_))
    indexer_top.select_one(codes, scale, indexer_top.E4M3, f32(2, 16), f32(2), f32(6), 3, np.empty(3, np.int64), np.empty(3, np.bool_))
    latent_rows.selected(rng.integers(0, 256, (6, 8), dtype=np.uint8), np.full((6, 1), 56, np.uint8),
                         np.arange(3, dtype=np.int64), f32(3, 8), f32(3, 8), f32(3, 16), f32(3, 16))
    kv_quant.fp4_e4m3(torch.from_numpy(f32(1, 16)))                          # a compressed row's formats
    kv_quant.fp8_rowscale(torch.from_numpy(f32(1, 16)))
    kv_quant.write_rows((f32(2, 16), f32(2, 8), np.full(2, -1, np.int64)), np.arange(1, dtype=np.int64), f32(1, 16), f32(1, 8), 1,
                        (np.zeros((4, 8), np.uint8), np.zeros((4, 1), np.uint8)), (np.zeros((4, 8), np.uint8), np.zeros(4, np.float32)))
    if LANES:                                     # the fused decode takes the SIMD GEMVs only (decode_layer.fits)
        _fused_layer(rng, f32)
    engram_hash.engram_rows(np.arange(5, dtype=np.int64), 2, 7, 3, 2, np.full(4, 11, np.int64), np.zeros(4, np.int64),
                            np.arange(4, dtype=np.uint64))
    for T in (1, 4):                                                          # Engram rows and gate
        engram_gate.rows(rng.integers(0, 0x7e, (8, 64), dtype=np.uint8), np.full((8, 2), 120, np.uint8),
                         np.arange(T, dtype=np.int64), E4M3, STAB, f32(T, 64))
        engram_gate.gate(f32(T, 64), f32(T, 64), f32(T, 64), 1e-6, f32(T, 64))


def _fused_layer(rng, f32) -> None:
    """kernels/decode_layer.py's two calls, every weight given (an index and source layer)."""
    u8 = lambda *shape: rng.integers(0, 0x7e, shape, dtype=np.uint8)             # noqa: E731
    fp8 = lambda n, k: (u8(n, k), np.full((-(-n // 32), k // 32), 120, np.uint8))  # noqa: E731
    bf16 = lambda n, k: (f32(n, k).view(np.uint32) >> 16).astype(np.uint16)      # noqa: E731
    H, C, Q, HQ = 64, 32, 32, 2
    decode_layer.attn_in(f32(1, H), f32(H), f32(C), 1e-6, 32, 32, STAB, f32(1, C // 2), f32(1, C // 2),
                         *fp8(Q, H), *fp8(HQ * C, Q), *fp8(C, H), *fp8(C, Q), bf16(2, H), *fp8(C, H), *fp8(C, H),
                         f32(1, H), f32(1, Q), f32(1, HQ, C), f32(1, C), f32(1, C), f32(1, C), f32(1, 2), f32(1, C), f32(1, C),
                         numba.get_num_threads())
    decode_layer.attn_out(f32(1, H), f32(1, HQ * C), *fp8(H, HQ * C), 32, 32, STAB, f32(H), 1e-6, bf16(8, H), f32(8), 1.0,
                          f32(1, H), f32(1, H), np.empty((1, 2), np.int64), f32(1, 2), numba.get_num_threads())
    decode_layer.engram(f32(1, H), u8(8, 32), np.full((8, 1), 120, np.uint8), np.arange(2, dtype=np.int64), E4M3, STAB,
                        *fp8(H, 64), *fp8(H, 64), 32, 32, 1e-6, 0.125, f32(1, H))
    decode_layer.source_in(f32(1, H), f32(H), 1e-6, 32, 32, STAB, *fp8(C, H), *fp8(C, H), f32(1, C), f32(1, C))
    ring = (f32(4, C), f32(4, C), np.arange(4, dtype=np.int64))
    for n_vis, r in ((6, 1), (-1, 0), (-1, -1)):                      # an index layer, a reuse layer, a window layer
        decode_layer.attend_one(5, 4, 0.25, f32(HQ, C), f32(C), f32(C), *ring, f32(9, C), f32(9, C), f32(HQ, C),
                                n_vis, u8(6, 16), np.ones(6, np.float32), indexer_top.E4M3, f32(2, 16), f32(2),
                                np.zeros(4, np.int64), np.ones(4, np.bool_), r, u8(6, C // 2), np.full((6, C // 16), 56, np.uint8),
                                latent_rows.PAIRS, indexer_top.E4M3, 16, np.ones(C // 2), 2)

