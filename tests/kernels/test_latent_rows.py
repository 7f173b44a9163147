"""Selected compressed rows dequantized and roped in one numba call (kernels/latent_rows.py) against the
torch form (kernels/formats.py dequantize_fp4_e4m3, then runtime/model/transformer.py rope): the same
bits, so a decode query and a prompt chunk see the same keys."""
import torch
from hypothesis import given, settings, strategies as st

from kernels import latent_rows
from kernels.formats import dequantize_fp4_e4m3
from runtime.model.transformer import rope, rope_tables


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6).map(lambda m: 16 * m), st.integers(0, 12), st.integers(1, 8),
       st.sampled_from([torch.float32, torch.float64]), st.integers(0, 2**31))
def test_rows_are_the_torch_forms_bits(N, C, n, r, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (N, C // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 127, (N, C // 16), dtype=torch.uint8, generator=g)      # finite E4M3 scales
    rows = torch.randint(0, N, (n,), generator=g)
    cos, sin = rope_tables((rows + 1) * r - 1, C // 2, 10000.0, dtype)
    K, V = torch.full((n, C), 7.0, dtype=dtype), torch.full((n, C), 7.0, dtype=dtype)
    latent_rows.selected(codes.numpy(), scales.numpy(), rows.numpy(), cos.numpy(), sin.numpy(), K.numpy(), V.numpy())
    want = dequantize_fp4_e4m3(codes[rows], scales[rows], dtype)
    assert torch.equal(V, want)
    assert torch.equal(K, rope(want, None, 10000.0, (cos, sin)))
