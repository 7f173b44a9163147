import itertools

import pytest
import torch

from kernels.formats import (E2M1_VALUES, dequantize_fp8_block, dequantize_fp8_rows, dequantize_mxfp4,
                             e8m0_to_float, quantize_fp8_block, quantize_fp8_rows, quantize_mxfp4, unpack_e2m1)


def test_every_e2m1_code():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)                 # 32 codes = one group
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 16)
    for b, scale in ((127, 1.0), (128, 2.0), (120, 2.0 ** -7)):
        w = dequantize_mxfp4(packed, torch.tensor([[b]], dtype=torch.uint8), torch.float64)
        assert torch.equal(w[0], E2M1_VALUES.repeat(2) * scale)
    assert torch.equal(unpack_e2m1(packed)[0], codes)


def test_e8m0_extremes_and_nan():
    b = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    f = e8m0_to_float(b, torch.float64)
    assert f[0] == 2.0 ** -127 and f[1] == 2.0 ** -126 and f[2] == 1 and f[3] == 2.0 ** 127
    assert torch.isnan(f[4])
    packed = torch.full((1, 16), 0x22, dtype=torch.uint8)                  # all codes = 1.0
    w = dequantize_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8))
    assert torch.isnan(w).all()                                          # a NaN scale poisons its group


def test_mxfp4_roundtrip_exact_on_representable_values():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8)
    codes[:, ::32] = 7                                                   # amax 6 in each group -> scale 2^e exact
    exps = torch.randint(100, 150, (8, 2), generator=g, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    w = dequantize_mxfp4(packed, exps, torch.float64)
    p2, s2 = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(p2, s2, torch.float64), w)
    assert torch.equal(s2, exps)


def test_mxfp4_error_bound_on_random():
    w = torch.randn(64, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    p, s = quantize_mxfp4(w)
    d = dequantize_mxfp4(p, s, torch.float64)
    step = e8m0_to_float(s, torch.float64).repeat_interleave(32, -1)      # E2M1 spacing <= 2 * 2^e
    sat = w.abs() > 6 * step
    assert ((d - w).abs()[~sat] <= step[~sat] + 1e-12).all()             # half the widest spacing
    assert ((d.abs() - 6 * step)[sat].abs() < 1e-12).all()               # above 6*2^e saturates


def test_quantizers_refuse_non_finite():
    w = torch.randn(4, 32)
    w[1, 3] = float("inf")
    with pytest.raises(ValueError, match="1 non-finite"):
        quantize_mxfp4(w)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_fp8_block(w, (32, 32))


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
@pytest.mark.parametrize("shape", [(64, 96), (70, 33), (1, 5)])
def test_fp8_block_roundtrip(block, shape):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1] + block[0])
    w = torch.randn(*shape, dtype=torch.float64, generator=g) * torch.rand(*shape, dtype=torch.float64, generator=g) * 10
    q, s = quantize_fp8_block(w, block)
    assert s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    d = dequantize_fp8_block(q, s, block, torch.float64)
    assert ((d - w).abs() <= w.abs() * 2 ** -4 + 1e-30 + 2 ** -9 * e8m0_to_float(s, torch.float64).max()).all()
    if w.numel() >= 1000:          # e4m3's 3 mantissa bits: ~2% rms, 6.25% worst case per element
        assert (d - w).norm() / w.norm() < 0.04


def test_fp8_block_scale_mismatch_named():
    q, s = quantize_fp8_block(torch.randn(64, 64), (32, 32))
    with pytest.raises(ValueError, match=r"128x128 blocks"):
        dequantize_fp8_block(q, s, (128, 128))


def test_fp8_rows_roundtrip():
    x = torch.randn(100, 64) * 3
    q, s = quantize_fp8_rows(x)
    assert q.shape == (100, 64) and s.shape == (100, 2)
    assert (dequantize_fp8_rows(q, s) - x).norm() / x.norm() < 0.04


def test_the_fp4_kv_format_round_trips_its_grid_and_bounds_the_error():
    from kernels.formats import E2M1_VALUES, dequantize_fp4_e4m3, quantize_fp4_e4m3
    g = torch.Generator().manual_seed(7)
    scale = torch.tensor([2.0 ** -3, 0.75, 6.0], dtype=torch.float64)          # exact E4M3 values
    grid = E2M1_VALUES[torch.randint(0, 16, (3, 64), generator=g)]
    grid[:, 0] = 6.0                                                            # amax / 6 is the scale itself
    x = grid * scale[:, None]
    c, s = quantize_fp4_e4m3(x)
    assert c.shape == (3, 32) and s.shape == (3, 4) and c.dtype == s.dtype == torch.uint8
    assert torch.equal(dequantize_fp4_e4m3(c, s, torch.float64)[:, :16], x[:, :16])   # on the grid: exact
    y = torch.randn(200, 48, dtype=torch.float64, generator=g) * torch.rand(200, 1, dtype=torch.float64, generator=g)
    c, s = quantize_fp4_e4m3(y)
    err = (dequantize_fp4_e4m3(c, s, torch.float64) - y).abs().view(200, 3, 16)
    amax = y.abs().view(200, 3, 16).amax(-1, keepdim=True)
    # half the top step (2) of the scale, the scale within E4M3's 1/16 or, subnormal, half its 2^-9 step
    assert bool((err <= amax / 6 * (1 + 1 / 16) + 6 * 2.0 ** -10).all())
    z = quantize_fp4_e4m3(torch.zeros(2, 16))
    assert dequantize_fp4_e4m3(*z).abs().sum() == 0
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_fp4_e4m3(torch.ones(2, 24))
    with pytest.raises(ValueError, match="non-finite"):
        quantize_fp4_e4m3(torch.full((1, 16), float("nan")))


def test_the_fp4_kv_dequantizer_is_code_by_code_times_its_group_scale():
    """Byte pairs looked up at once give the values of decoding each code alone (NaN scales too)."""
    from kernels.formats import E2M1_VALUES, dequantize_fp4_e4m3
    g = torch.Generator().manual_seed(11)
    c = torch.randint(0, 256, (2, 5, 24), dtype=torch.uint8, generator=g)           # [..., K/2], K = 48
    s = torch.randint(0, 256, (2, 5, 3), dtype=torch.uint8, generator=g)            # every E4M3 bit pattern, NaN too
    s[0, 0, 0] = 0x7F                                                               # a NaN scale
    for dtype in (torch.float32, torch.float64):
        want = torch.empty(2, 5, 48, dtype=dtype)
        sc = s.view(torch.float8_e4m3fn).to(dtype)
        for idx in itertools.product(range(2), range(5), range(48)):
            b = int(c[idx[0], idx[1], idx[2] // 2])
            want[idx] = E2M1_VALUES.to(dtype)[b >> 4 if idx[2] % 2 else b & 0xF] * sc[idx[0], idx[1], idx[2] // 16]
        got = dequantize_fp4_e4m3(c, s, dtype)
        assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan()) and torch.isnan(got[0, 0, :16]).all()
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
        assert torch.equal(dequantize_fp4_e4m3(c[1, 2], s[1, 2], dtype), want[1, 2])  # one row, no leading dims


def test_the_index_key_format_is_e4m3_with_a_row_scale():
    from kernels.formats import dequantize_fp8_rowscale, quantize_fp8_rowscale
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    q, s = quantize_fp8_rowscale(x)
    assert q.dtype == torch.uint8 and s.dtype == torch.float32 and s.shape == (50,)
    err = (dequantize_fp8_rowscale(q, s, torch.float64) - x).abs()
    assert bool((err <= x.abs() / 16 + 2.0 ** -9 * s.double()[:, None] + 1e-6).all())   # E4M3: 3 mantissa bits
