"""The lab's AMX tile route (kernels/lab/fp4_amx_tiles.py) gives the package GEMV's bits: the claim its
figures rest on. Runs only where the kernels may use AMX tiles (hostinfo.amx_tiles)."""
import numpy as np
import pytest

import hostinfo

pytestmark = pytest.mark.skipif(not hostinfo.amx_tiles(), reason="no AMX int8 tiles usable on this host (hostinfo.amx_tiles)")


@pytest.mark.parametrize("widths", [[1], [3, 17], [16, 40, 5]])
def test_tiles_give_the_gemvs_bits_for_every_slot_width(widths):
    from kernels import cpu_moe as cm
    from kernels.lab import fp4_amx_tiles as fa
    rng = np.random.default_rng(sum(widths))
    bank = cm.Fp4Bank.random(len(widths), 512, 256, seed=len(widths))       # 256-byte rows: whole superblocks
    A = sum(widths)
    x = rng.standard_normal((A, 512)).astype(np.float32)
    x[0, :32] = 0.0                                                           # an all-zero block (scale 0)
    experts = np.arange(len(widths), dtype=np.int64)[::-1].copy()            # slots need not be in bank order
    off = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
    xq, xc, xr = cm._prepare(x, np.arange(A))
    want = np.empty((A, 512), np.float32)
    cm._matvecs(bank.w13_codes, bank.w13_scales, experts, off, xq, xc, xr, want, 1, 4, 2)
    for _ in range(3):                                                        # fresh scratch each call (alignment varies)
        got = np.full_like(want, np.nan)
        fa.tile_matvecs(bank.w13_codes, bank.w13_scales, experts, off, fa.tile_inputs(xq), xr, got, fa.tile_config(), 2)
        assert np.isfinite(got).all() and np.array_equal(got.view(np.int32), want.view(np.int32))


def test_tiles_refuse_rows_that_are_not_whole_superblocks():
    from kernels import cpu_moe as cm
    from kernels.lab import fp4_amx_tiles as fa
    bank = cm.Fp4Bank.random(1, 288, 64, seed=0)                              # 144-byte rows: the GEMV's steps, not tiles
    xq, xc, xr = cm._prepare(np.ones((2, 288), np.float32), np.arange(2))
    with pytest.raises(ValueError, match="whole superblocks"):
        fa.tile_inputs(xq)
    aq = np.zeros((17, 288 + fa.A_PAD), np.int8)                              # the pass refuses them too
    with pytest.raises(ValueError, match="whole superblocks"):
        fa.tile_matvecs(bank.w13_codes, bank.w13_scales, np.zeros(1, np.int64), np.array([0, 2], np.int64), aq,
                        xr, np.empty((2, 128), np.float32), fa.tile_config(), 2)
