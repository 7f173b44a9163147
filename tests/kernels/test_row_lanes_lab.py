"""kernels/lab/fp4_row_lanes.py: the repacked bank keeps every row's dwords, and the lanes-as-rows GEMV
computes the package's products (its float sums in another order: float32 rounding, 1e-5 relative)."""
import numpy as np
import pytest

from kernels.cpu_moe import MODE, _prepare, random_bytes

lab = pytest.importorskip("kernels.lab.fp4_row_lanes")


def test_repack_puts_dword_d_of_16_rows_together():
    rng = np.random.default_rng(1)
    N, K = 32, 256
    codes = random_bytes(rng, (N, K // 2))
    scales = rng.integers(0, 256, (N, K // 32), dtype=np.uint8)
    c, s = lab.repack(codes, scales)
    c = c.reshape(N // 16, K // 8, 16, 4)
    s = s.reshape(N // 16, K // 32, 16)
    for r in (0, 5, 17, 31):
        for d in (0, 3, K // 8 - 1):
            assert c[r // 16, d, r % 16].tolist() == codes[r, 4 * d:4 * d + 4].tolist()
        assert s[r // 16, :, r % 16].tolist() == scales[r].tolist()


@pytest.mark.skipif(MODE != 4, reason="the lab kernel needs AVX-512 VNNI + VBMI (this host's path is another)")
@pytest.mark.parametrize("T", [1, 3, 8])
def test_lanes_as_rows_compute_the_packages_products(T):
    from kernels.lab.fp4_row_pairs import gemv
    rng = np.random.default_rng(T)
    N, K = 128, 512
    w = random_bytes(rng, (N, K // 2))
    s = rng.integers(118, 130, (N, K // 32), dtype=np.uint8)
    x = rng.standard_normal((T, K)).astype(np.float32)
    want, got = np.empty(T * N, np.float32), np.empty(T * N, np.float32)
    gemv(1, T, K=K)(w.reshape(-1), s.reshape(-1), tuple(a.reshape(-1) for a in _prepare(x, np.arange(T))), want, 0, N)
    wl, sl = lab.repack(w, s)
    lab.lanes_gemv(1, T)(wl, sl, tuple(a.reshape(-1) for a in _prepare(x, np.arange(T), 0)), got, 0, N, K)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert not np.array_equal(got, np.zeros_like(got))
