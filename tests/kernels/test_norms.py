"""RMSNorm and RoPE in numba (kernels/norms.py, through runtime/model/transformer.py on CPU tensors):
RMSNorm against float64 with each row's bits independent of its batch; RoPE the torch form's bits."""
import torch
from hypothesis import given, settings, strategies as st

from kernels import norms
from runtime.model.transformer import rmsnorm, rope, rope_tables


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.integers(1, 300), st.booleans(), st.sampled_from([torch.float32, torch.float64]),
       st.integers(0, 2**31))
def test_rmsnorm_matches_float64_and_each_row_is_its_own(T, H, weighted, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (T, 1), generator=g)).to(dtype)
    w = torch.randn(H, generator=g).to(dtype) if weighted else None
    y = rmsnorm(x, w, 1e-6)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 if w is None else w.double())
    tol = 4e-7 if dtype == torch.float32 else 1e-15                        # a few float32 / float64 roundings
    assert float(((y.double() - ref).abs() / ref.abs().amax(-1, keepdim=True)).max()) < tol
    t = int(torch.randint(0, T, (1,), generator=g))
    assert torch.equal(rmsnorm(x[t:t + 1].clone(), w, 1e-6)[0], y[t])       # the same bits alone or batched
    assert T < norms.PARALLEL_ROWS or torch.equal(rmsnorm(x[:3].clone(), w, 1e-6), y[:3])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 20), st.sampled_from([0, 1, 4]), st.integers(1, 24).map(lambda m: 2 * m),
       st.sampled_from([torch.float32, torch.float64]), st.integers(0, 2**31))
def test_rope_is_the_torch_forms_bits(T, heads, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*((T, heads, D) if heads else (T, D)), generator=g).to(dtype)
    pos = torch.randint(0, 70000, (T,), generator=g)
    cos, sin = rope_tables(pos, D // 2, 10000.0, dtype)
    got = rope(x, pos, 10000.0, (cos, sin))
    if heads:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    assert torch.equal(got, torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1))
