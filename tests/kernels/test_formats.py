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
