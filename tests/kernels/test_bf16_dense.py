"""The BF16 dense kernel (LM head, routers) against float64 over the same BF16 values: GEMV and tile
widths, K off the SIMD width, batch invariance (every ISA path and thread counts:
tests/kernels/test_dense_isa_paths.py)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hostinfo import isa
from kernels.bf16_dense import GEMV_ANY_WIDTH_BYTES, TILE_MIN_TOKENS, UNROLL, Bf16Weight, bf16_linear, simd_ok
from kernels.cpu_moe import LANES

RTOL = 1e-5          # fp32 sums of exact products (a BF16 weight widens exactly) against float64


def _weight(seed, N, K):
    g = torch.Generator().manual_seed(seed)
    return Bf16Weight.from_tensor((torch.randn(N, K, generator=g) * 0.05).bfloat16())


def _rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("N,K", [(96, 128), (37, 320), (100, 70), (64, 5120)])
@pytest.mark.parametrize("T", [1, 2, 3, 5, TILE_MIN_TOKENS, 40])
def test_matches_the_float64_reference(N, K, T):
    w = _weight(N * K + T, N, K)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
    assert _rel(bf16_linear(x, w), x.double() @ w.reference().T) < RTOL


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 70), st.integers(1, 6).map(lambda m: m * 64), st.integers(1, 6), st.integers(0, 2**31))
def test_fresh_shapes_and_inputs_match_the_reference(N, K, T, seed):
    w = _weight(seed, N, K)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(seed)) * 3
    ref = x.double() @ w.reference().T
    assert _rel(bf16_linear(x, w), ref) < RTOL or float(ref.norm()) == 0.0


def test_every_bf16_value_widens_exactly():
    """One row per BF16 bit pattern (NaN aside): x = e_0 picks the weight out exactly."""
    bits = np.array([b for b in range(1 << 16) if (b & 0x7F80) != 0x7F80 or not b & 0x7F], np.uint16)
    K = UNROLL * max(LANES, 16)                              # the SIMD width where there is one
    q = np.zeros((len(bits), K), np.uint16)
    q[:, 0] = bits
    x = torch.zeros(1, K)
    x[0, 0] = 1.0
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float32)
    got = bf16_linear(x, Bf16Weight(q))[0]
    assert torch.equal(got, want) and simd_ok(Bf16Weight(q)) == (isa() != "scalar")


def test_a_token_gives_the_same_bits_alone_or_in_a_batch():
    w = _weight(3, 128, 256)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    batch = bf16_linear(x, w)
    for t in range(7):
        assert torch.equal(batch[t], bf16_linear(x[t:t + 1], w)[0])


def test_a_cache_sized_matrix_gives_a_token_the_same_bits_at_any_width():
    """Routers (<= GEMV_ANY_WIDTH_BYTES) stay on the GEMV past the tile width: a token's routing does not
    depend on how many tokens share its pass."""
    if isa() == "scalar":
        pytest.skip("no SIMD path here: every width takes torch's tiles (speed and invariance are not goals there)")
    w = _weight(5, 256, 512)
    assert w.nbytes <= GEMV_ANY_WIDTH_BYTES and simd_ok(w)
    x = torch.randn(2 * TILE_MIN_TOKENS + 3, 512, generator=torch.Generator().manual_seed(4))
    wide = bf16_linear(x, w)
    assert all(torch.equal(wide[t], bf16_linear(x[t:t + 1], w)[0]) for t in range(len(x)))


def test_bad_weights_and_shapes_are_named():
    with pytest.raises(ValueError, match="expected C-contiguous uint16"):
        Bf16Weight(np.zeros((4, 64), np.float32))
    with pytest.raises(ValueError, match="expected bfloat16"):
        Bf16Weight.from_tensor(torch.zeros(4, 64))
    with pytest.raises(ValueError, match="x has 32 inputs"):
        bf16_linear(torch.zeros(1, 32), _weight(0, 64, 64))


@pytest.mark.skipif(not LANES, reason=f"this host's path ({isa()}) has no SIMD BF16 GEMV")
def test_the_gemv_prefetches_each_line_into_l1_at_its_distance_and_changes_no_bits(monkeypatch):
    """Every weight line of a chunk gets an L2 prefetch (on AVX-512 a chunk is two lines: one prefetch a chunk left
    every other line to the hardware, 0.59 against 0.81 of the stream) and, bf16_dense.L1_AHEAD (read as the kernel is
    emitted) above 0, a T0 prefetch at that distance; 0 emits none. The outputs are the same bits either way."""
    from numba import njit
    from kernels import bf16_dense
    from kernels.bf16_dense import bf16_dot
    N, K = 8, 4 * UNROLL * LANES
    w = _weight(7, N, K).bits.reshape(-1)
    x = np.random.default_rng().standard_normal(K).astype(np.float32)
    outs, t0 = {}, {}
    for ahead in (0, 4096, 1024):
        monkeypatch.setattr(bf16_dense, "L1_AHEAD", ahead)

        @njit
        def gemv(w, x, out):
            for n in range(N):
                bf16_dot(1, LANES, w, n * K, K // (UNROLL * LANES), x, 0, K, out, n, N)
        out = np.zeros(N, np.float32)
        gemv(w, x, out)
        asm = "".join(gemv.inspect_asm().values())
        outs[ahead], t0[ahead] = out, asm.count("prefetcht0")
        t2 = sum(asm.count(p) for p in ("prefetcht1", "prefetcht2", "prefetchnta"))
        assert t2 >= UNROLL * LANES * 2 // 64, (ahead, t2)
        assert ahead == 0 or t2 == asm.count("prefetcht0"), (ahead, t2)      # a line gets both, however LLVM unrolls
    assert t0[0] == 0 and t0[4096] >= UNROLL * LANES * 2 // 64 and t0[1024] == t0[4096], t0
    assert all(np.array_equal(outs[0].view(np.uint32), o.view(np.uint32)) for o in outs.values())


@pytest.mark.skipif(not LANES, reason=f"this host's path ({isa()}) has no SIMD BF16 GEMV")
@pytest.mark.parametrize("T", [1, 3, 6])
def test_the_gemv_gives_the_same_bits_at_any_thread_split(T):
    """`_gemv_simd` gives each thread a contiguous range of rows (bf16_linear and the fused decode layer's
    routers call it with numba's thread count): each row is computed the same way whatever the split."""
    from kernels.bf16_dense import _gemv_simd
    N, K = 37, 2 * UNROLL * LANES
    w = _weight(T, N, K).bits
    x = np.random.default_rng().standard_normal((T, K)).astype(np.float32)
    ref = np.empty((T, N), np.float32)
    _gemv_simd(w, x, ref, 1)
    for nt in (2, 3, N + 5):                        # more threads than rows: some take none
        out = np.full((T, N), np.nan, np.float32)
        _gemv_simd(w, x, out, nt)
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), nt
    assert np.array_equal(bf16_linear(torch.from_numpy(x), Bf16Weight(w)).numpy().view(np.uint32), ref.view(np.uint32))
