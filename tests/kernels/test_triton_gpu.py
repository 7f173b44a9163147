"""Triton kernels against float64 references. Here they run under TRITON_INTERPRET=1 on CPU tensors
(set before triton is imported, in a subprocess-free way: this module sets it if unset and the CUDA
device is absent); on a CUDA machine the same tests run on the GPU."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from kernels.formats import dequantize_fp8_block, dequantize_mxfp4, quantize_act, quantize_fp8_block, quantize_mxfp4  # noqa: E402
from kernels.triton_gpu import fp4_slot_matmul, fp8_block_matmul  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and triton was imported without TRITON_INTERPRET=1", allow_module_level=True)
RTOL = 1e-5   # float32 accumulation ('ieee' dot) vs float64


@pytest.mark.parametrize("S,N,K,M,T", [(4, 64, 128, 2, 1), (3, 48, 192, 3, 5), (2, 33, 64, 1, 17)])
def test_fp4_slot_matmul(S, N, K, M, T):
    """Against float64 products of the quantized inputs (every expert path's arithmetic): each 32-block's
    term is exact, only their float32 sum is rounded."""
    g = torch.Generator().manual_seed(S * 100 + T)
    codes, scales = quantize_mxfp4(torch.randn(S, N, K, generator=g))
    scales[0, 0, 0] = 255                                                # a NaN scale: row 0 of slot 0
    x = torch.randn(M, T, K, generator=g) * torch.logspace(-3, 3, K // 32).repeat_interleave(32)
    slots = torch.randint(0, S, (M,), generator=g)
    slots[0] = 0
    y = fp4_slot_matmul(x.to(DEV), codes.to(DEV), scales.to(DEV), slots.to(DEV)).cpu()
    ref = torch.stack([quantize_act(x[m]).double() @ dequantize_mxfp4(codes[slots[m]], scales[slots[m]], torch.float64).T
                       for m in range(M)])
    assert y.shape == (M, T, N)
    assert torch.equal(y.isnan(), ref.isnan())
    ok = ~ref.isnan()
    bound = (quantize_act(x).double().abs() @ torch.ones(K, dtype=torch.float64))[..., None] \
        * dequantize_mxfp4(codes, scales, torch.float64).abs().nan_to_num().amax()   # sum |x^| max |w|
    assert ((y.double() - ref).abs()[ok] <= 8 * K / 32 * 2 ** -24 * bound.expand_as(ref)[ok]).all()
    assert not torch.equal(quantize_act(x), x)                                 # the inputs were quantized


@pytest.mark.parametrize("group", [8, 16])
def test_fp4_slot_matmul_reads_the_lanes_layout(group):
    """Slots holding the CPU banks' lanes layout (kernels/fp4_lanes.py, copied as they are by a gather):
    the same bits as the rows they were repacked from (only the addresses differ)."""
    from kernels.fp4_lanes import to_lanes
    g = torch.Generator().manual_seed(group)
    S, N, K, M, T = 3, 48, 192, 3, 4
    codes, scales = quantize_mxfp4(torch.randn(S, N, K, generator=g))
    scales[1, 17, 2] = 255                                               # a NaN scale: row 17 of slot 1 only
    lc, ls = (torch.from_numpy(a) for a in to_lanes(codes.numpy(), scales.numpy(), group))
    assert not torch.equal(lc, codes)
    x, slots = torch.randn(M, T, K, generator=g), torch.tensor([1, 0, 2])
    want = fp4_slot_matmul(x.to(DEV), codes.to(DEV), scales.to(DEV), slots.to(DEV)).cpu()
    got = fp4_slot_matmul(x.to(DEV), lc.to(DEV), ls.to(DEV), slots.to(DEV), group=group).cpu()
    assert torch.equal(got.isnan(), want.isnan()) and want[0, :, 17].isnan().all() and want.isnan().sum() == T
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
@pytest.mark.parametrize("M,N,K", [(1, 96, 128), (5, 70, 256), (20, 130, 160)])
def test_fp8_block_matmul(block, M, N, K):
    g = torch.Generator().manual_seed(M + N + K)
    q, s = quantize_fp8_block(torch.randn(N, K, generator=g), block)
    x = torch.randn(M, K, generator=g)
    y = fp8_block_matmul(x.to(DEV), q.to(DEV), s.to(DEV), block).cpu()
    ref = x.double() @ dequantize_fp8_block(q, s, block, torch.float64).T
    assert ((y.double() - ref).norm() / ref.norm()) < RTOL


def test_shape_errors_named():
    q, s = quantize_fp8_block(torch.randn(64, 64), (32, 32))
    with pytest.raises(ValueError, match="do not fit 128x128"):
        fp8_block_matmul(torch.randn(2, 64), q, s, (128, 128))
