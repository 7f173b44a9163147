"""The FP8 dense kernel against the float64 dequantized reference: GEMV and tile widths, odd shapes,
batch invariance (every ISA path and thread counts: tests/kernels/test_dense_isa_paths.py)."""

import numpy as np
import pytest
import torch

from hostinfo import isa
from kernels.fp8_dense import TILE_MIN_TOKENS, Fp8Weight, fp8_linear, simd_ok

RTOL = 1e-5          # fp32 accumulation of <= a few hundred products against float64


def _weight(seed, N, K, block=(32, 32)):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, (N, K)).astype(np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x38                                 # no NaN codes (checkpoints hold none)
    q[0, :8] = np.arange(8)                                      # subnormals and +0 are decoded too
    q[1, :8] = 0x80 | np.arange(8)                               # and their negatives, -0
    s = (118 + rng.integers(0, 10, (-(-N // block[0]), -(-K // block[1])))).astype(np.uint8)
    return Fp8Weight(q, s, block)


def _rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("N,K", [(96, 160), (100, 64), (37, 70), (64, 4096)])
@pytest.mark.parametrize("T", [1, 2, 3, 5, TILE_MIN_TOKENS, 40])
def test_matches_the_float64_reference(N, K, T):
    w = _weight(N * K + T, N, K)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
    assert _rel(fp8_linear(x, w), x.double() @ w.reference().T) < RTOL


def test_every_e4m3_code_decodes_exactly():
    """One row per code: W = e4m3(code) * 1, x = e_k picks single weights out exactly."""
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    K = 32
    q = np.zeros((len(codes), K), np.uint8)
    q[:, 0] = codes
    w = Fp8Weight(q, np.full((-(-len(codes) // 32), 1), 127, np.uint8), (32, 32))
    x = torch.zeros(1, K)
    x[0, 0] = 1.0
    want = torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(fp8_linear(x, w)[0], want) and simd_ok(w) == (isa() != "scalar")


def test_a_token_gives_the_same_bits_alone_or_in_a_batch():
    w = _weight(3, 128, 256)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    batch = fp8_linear(x, w)
    for t in range(7):
        assert torch.equal(batch[t], fp8_linear(x[t:t + 1], w)[0])


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="expected uint8 codes"):
        Fp8Weight(np.zeros((64, 64), np.uint8), np.zeros((1, 2), np.uint8), (32, 32))
    with pytest.raises(ValueError, match="x has 32 inputs"):
        fp8_linear(torch.zeros(1, 32), _weight(0, 64, 64))
