"""The MoE router in numba (kernels/router.py, through runtime/model/transformer.py `_route` on CPU
tensors) against torch's form (the one a GPU runs): the same experts, best first, and weights within
float32 rounding; of equal scores the lower expert id."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kernels import router


def _torch_form(logits, bias, K, scale):
    scores = torch.sigmoid(logits.double())
    ids = torch.topk(scores + bias.double(), K, dim=-1).indices
    wts = scores.gather(1, ids)
    return ids, wts / wts.sum(-1, keepdim=True) * scale


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(1, 70), st.integers(1, 8), st.integers(0, 2**31))
def test_the_same_experts_and_weights_as_torch(T, E, K, seed):
    """Logits 0.1 apart within +-3.5 (sigmoid gaps >= 0.1 x 0.029) and a bias under 0.001: no near-ties,
    so the order is the model's, not rounding's."""
    K = min(K, E)
    g = torch.Generator().manual_seed(seed)
    logits = torch.stack([(torch.randperm(E, generator=g) - E / 2) * 0.1 for _ in range(T)])
    bias = (torch.rand(E, generator=g) - 0.5) * 1e-3
    ids, wts = torch.empty(T, K, dtype=torch.long), torch.empty(T, K)
    router.route(logits.numpy(), bias.numpy(), 2.5, ids.numpy(), wts.numpy())
    want_ids, want_wts = _torch_form(logits, bias, K, 2.5)
    assert torch.equal(ids, want_ids)
    assert float((wts.double() - want_wts).abs().max()) < 2.5 * 4e-7 * K


def test_ties_go_to_the_lower_expert_best_first():
    logits = torch.zeros(2, 6)
    logits[0, [1, 3, 4]] = 1.0                      # three equal, best
    logits[1, [5, 2]] = 2.0
    bias = torch.zeros(6)
    ids, wts = torch.empty(2, 4, dtype=torch.long), torch.empty(2, 4)
    router.route(logits.numpy(), bias.numpy(), 1.0, ids.numpy(), wts.numpy())
    assert ids.tolist() == [[1, 3, 4, 0], [2, 5, 0, 1]]
    assert np.allclose(wts.sum(-1).numpy(), 1.0)


@pytest.mark.parametrize("T,K,seed", [(1, 6, 0), (5, 4, 1), (8, 8, 2)])
def test_with_row_is_the_numpy_concatenation(T, K, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 12, (T, K)).astype(np.int64)
    wts = rng.random((T, K)).astype(np.float32)
    sub, w, n = router.with_row(ids, wts, 32)
    np.testing.assert_array_equal(sub, np.concatenate([ids, np.full((T, 1), 32)], 1))
    np.testing.assert_array_equal(w, np.concatenate([wts, np.ones((T, 1), np.float32)], 1))
    assert sub.dtype == np.int64 and w.dtype == np.float32 and n == len(np.unique(ids))
