"""The KV quantizers' numba forms give the torch forms' codes bit for bit (kernels/kv_quant.py)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kernels.formats import quantize_fp4_e4m3, quantize_fp8_rowscale
from kernels.kv_quant import e4m3_code, fp4_e4m3, fp8_rowscale


def _same(fast, ref):
    for a, b in zip(fast, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.uint8 else a, b.view(torch.uint8) if b.dtype == torch.uint8 else b)


def test_e4m3_code_is_torchs_conversion_on_every_boundary():
    """Every E4M3 value, the midpoints between neighbours (ties to even), just either side of them,
    the subnormal range, values past 448 (saturated) and -0.0."""
    vals = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    mids = (vals[1:] + vals[:-1]) / 2
    pts = torch.cat([vals, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), torch.tensor([2 ** -10, 3 * 2 ** -11, 2 ** -12,
                     448.0, 455.0, 464.0, 470.0, 1e6, 3e38, 0.0])]).to(torch.float32)
    pts = torch.cat([pts, -pts])
    want = pts.to(torch.float8_e4m3fn).view(torch.uint8)
    got = torch.tensor([e4m3_code(float(v)) for v in pts], dtype=torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert len(bad) == 0, [(float(pts[i]), int(got[i]), int(want[i])) for i in bad[:10]]
    assert e4m3_code(-0.0) == 0x80 == int(torch.tensor([-0.0]).to(torch.float8_e4m3fn).view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 8), log_scale=st.floats(-14, 12), seed=st.integers(0, 2 ** 31),
       zeros=st.booleans())
def test_fp4_e4m3_matches_the_torch_form(rows, groups, log_scale, seed, zeros):
    x = torch.randn(rows, 16 * groups, generator=torch.Generator().manual_seed(seed)) * 2.0 ** log_scale
    if zeros:
        x[:, :16] = 0.0                                 # an all-zero group: scale 0, codes 0
        x[0, -1] = -0.0
    _same(fp4_e4m3(x), quantize_fp4_e4m3(x))


def test_fp4_e4m3_ties_between_e2m1_values():
    """Inputs on E2M1's midpoints once scaled (amax 6 gives scale 1): bucketize's side of each tie."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x = torch.cat([mids, -mids]).reshape(1, 16)
    _same(fp4_e4m3(x), quantize_fp4_e4m3(x))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), width=st.sampled_from([16, 64, 100]), log_scale=st.floats(-30, 30), seed=st.integers(0, 2 ** 31))
def test_fp8_rowscale_matches_the_torch_form(rows, width, log_scale, seed):
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 2.0 ** log_scale
    x[-1] = 0.0                                         # a zero row: scale 0, codes of x / 1
    _same(fp8_rowscale(x), quantize_fp8_rowscale(x))


def test_the_torch_forms_run_where_numba_cannot_and_name_a_bad_value():
    x = torch.randn(2, 32, dtype=torch.float64)         # another dtype: the torch form, the same codes
    _same(fp4_e4m3(x), quantize_fp4_e4m3(x))
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        fp4_e4m3(x)
    with pytest.raises(ValueError, match="non-finite"):
        fp8_rowscale(x)
    x = torch.randn(4, 32)[:, ::2]                      # not contiguous
    _same(fp8_rowscale(x), quantize_fp8_rowscale(x))
    assert np.all(fp8_rowscale(torch.zeros(1, 8))[1].numpy() == 0)


def _compressed(r, n, C=32, Di=16, spare=0):
    from runtime.model.kv import Compressed
    return Compressed(r, n, C, Di, spare, torch.float32, "cpu")


@pytest.mark.parametrize("r", [1, 2, 4, 5])
@pytest.mark.parametrize("chunks", [(1,), (3, 1, 4), (23,)])
def test_compressed_write_in_one_call(r, chunks):
    """kv_quant.write_rows through Compressed.write: each row the float64 mean of its r positions
    rounded to float32, quantized by the torch forms' arithmetic (bit for bit), whatever the chunks."""
    from kernels.formats import quantize_fp4_e4m3, quantize_fp8_rowscale
    g = torch.Generator().manual_seed(r)
    n = 23
    lat, ik = torch.randn(n, 32, generator=g) * 3, torch.randn(n, 16, generator=g)
    src, p = _compressed(r, n), 0
    for k in range(n):
        T = min(chunks[k % len(chunks)], n - p)
        if T <= 0:
            break
        src.write(torch.arange(p, p + T), lat[p:p + T], ik[p:p + T])
        p += T
    rows = n // r
    ml = lat[:rows * r].double().view(rows, r, -1).sum(1).div(r).float()
    mi = ik[:rows * r].double().view(rows, r, -1).sum(1).div(r).float()
    codes, scales = quantize_fp4_e4m3(ml)
    icodes, iscale = quantize_fp8_rowscale(mi)
    assert torch.equal(src.lat_codes[:rows], codes) and torch.equal(src.lat_scales[:rows], scales)
    assert torch.equal(src.ik_codes[:rows], icodes) and torch.equal(src.ik_scale[:rows], iscale)


def test_compressed_write_falls_back_to_the_torch_form_that_names_the_problem():
    src = _compressed(4, 16)
    src.write(torch.arange(0, 2), torch.randn(2, 32), torch.randn(2, 16))
    with pytest.raises(RuntimeError, match="ring lost positions"):              # positions 2, 3 skipped
        src.write(torch.arange(6, 8), torch.randn(2, 32), torch.randn(2, 16))
    bad = torch.randn(4, 32)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError):
        _compressed(4, 16).write(torch.arange(0, 4), bad, torch.randn(4, 16))
