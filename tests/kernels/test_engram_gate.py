"""kernels/engram_gate.py: the Engram rows as formats.dequantize_fp8_rows gives them (bit for bit), and
the gate against a float64 reference on fresh random inputs."""
import math

import numpy as np
import pytest
import torch

from kernels import engram_gate
from kernels.cpu_moe import STAB
from kernels.formats import dequantize_fp8_rows
from kernels.fp8_dense import E4M3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1])
def test_rows_are_the_torch_dequantization(dtype, seed):
    rng = np.random.default_rng(seed)
    N, D = 50, 96
    codes = rng.integers(0, 256, (N, D), dtype=np.uint8)                      # every code, NaNs included
    scales = rng.integers(100, 256, (N, D // 32), dtype=np.uint8)              # E8M0 255 is NaN too
    ids = rng.integers(0, N, 17).astype(np.int64)                              # repeats allowed
    got = engram_gate.rows(codes, scales, ids, E4M3, STAB, np.empty((len(ids), D), dtype=torch.empty(0, dtype=dtype).numpy().dtype))
    idx = torch.from_numpy(ids)
    want = dequantize_fp8_rows(torch.from_numpy(codes)[idx].view(torch.float8_e4m3fn), torch.from_numpy(scales)[idx], dtype)
    np.testing.assert_array_equal(got, want.numpy())                           # NaN where either is NaN, else the same bits


def test_rows_name_a_bad_shape():
    with pytest.raises(ValueError, match="engram_gate.rows"):
        engram_gate.rows(np.zeros((4, 64), np.uint8), np.zeros((4, 3), np.uint8), np.zeros(2, np.int64), E4M3, STAB,
                         np.empty((2, 64), np.float32))


def _reference(h, k, v, eps):
    h, k, v = (torch.from_numpy(x).double() for x in (h, k, v))
    n = lambda x: x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)    # noqa: E731
    g = torch.sigmoid((n(h) * n(k)).sum(-1, keepdim=True) / math.sqrt(h.shape[1]))
    return (h + g * v).numpy()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("H", [64, 100, 5120])
def test_gate_against_float64(seed, H):
    """float32 inputs; tolerance: the norms' and the output's float32 roundings, a few units in the
    last place of |h| + |v|."""
    rng = np.random.default_rng(seed)
    T = 3
    h, k, v = (rng.standard_normal((T, H)).astype(np.float32) * s for s in (1.0, 4.0, 0.5))
    got = engram_gate.gate(h, k, v, 1e-6, np.empty_like(h))
    ref = _reference(h, k, v, 1e-6)
    tol = 4 * np.finfo(np.float32).eps * (np.abs(h) + np.abs(v)).max()
    assert np.abs(got - ref).max() <= tol
    for t in range(T):                                                         # a row's bits alone or in a batch
        one = engram_gate.gate(h[t:t + 1], k[t:t + 1], v[t:t + 1], 1e-6, np.empty_like(h[t:t + 1]))
        np.testing.assert_array_equal(one[0], got[t])


def test_gate_in_float64():
    rng = np.random.default_rng(5)
    h, k, v = (rng.standard_normal((2, 80)) for _ in range(3))
    got = engram_gate.gate(h, k, v, 1e-6, np.empty_like(h))
    assert np.abs(got - _reference(h, k, v, 1e-6)).max() < 1e-12
