"""The indexer's numba steps (kernels/indexer_top.py) against torch's forms: the E4M3 index keys bit for
bit, and one decode query's selection (runtime/model/attention.py select) the same rows as the
batched torch form where the scores are exact (small integers: ties everywhere, broken the same way)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kernels import indexer_top
from kernels.formats import dequantize_fp8_rowscale
from runtime.model.attention import select
from runtime.model.kv import Compressed


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(1, 70), st.sampled_from([torch.float32, torch.float64]), st.integers(0, 2**31))
def test_index_keys_are_torchs_float8_conversion_bit_for_bit(t, Di, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (t, Di), dtype=torch.uint8, generator=g)           # every code, NaN's too
    scale = torch.rand(t, generator=g) * torch.tensor(2.0) ** torch.randint(-20, 20, (t,), generator=g)
    out = torch.empty(t, Di, dtype=dtype)
    indexer_top.index_keys(codes.numpy(), scale.numpy(), out.numpy())
    want = dequantize_fp8_rowscale(codes, scale, dtype)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(0.0), want.nan_to_num(0.0))


def test_weigh_sums_relu_times_the_head_weights_against_float64():
    rng = np.random.default_rng(1)
    act, wh = rng.standard_normal((8, 300)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    score = np.full(310, 7.0, np.float32)
    indexer_top.weigh(act, wh, score, 10)
    want = (np.maximum(act.astype(np.float64), 0) * wh[:, None]).sum(0)
    assert np.abs(score[10:] - want).max() < 1e-5 * np.abs(want).max() and (score[:10] == 7.0).all()


def _source(rng, n, Di):
    """A kv source whose n index keys are small integers (E4M3-exact, scale 1): exact scores."""
    src = Compressed(1, n + 64, 2 * 16, Di, 0, torch.float32, "cpu")
    ints = torch.from_numpy(rng.integers(-3, 4, (n, Di))).float()
    src.ik_codes[:n] = ints.to(torch.float8_e4m3fn).view(torch.uint8)
    src.ik_scale[:n] = 1.0
    return src


@pytest.mark.parametrize("n,topk", [(5, 8), (50, 8), (300, 64), (300, 300)])
def test_one_decode_query_selects_the_rows_the_batched_form_does(n, topk):
    rng = np.random.default_rng(n + topk)
    Hi, Di, window = 4, 16, 8
    src = _source(rng, n, Di)
    qi = torch.from_numpy(rng.integers(-2, 3, (1, Hi, Di))).float()
    wh = torch.from_numpy(rng.integers(0, 3, (1, Hi))).float()
    pos = torch.tensor([n + window - 1])                    # every row visible
    idx, ok, peak = select(src, qi, wh, pos, window, topk, torch.float32, "cpu")
    both, ok2, _ = select(src, qi.repeat(2, 1, 1), wh.repeat(2, 1), pos.repeat(2), window, topk, torch.float32, "cpu")
    assert torch.equal(idx[0], both[0]) and torch.equal(ok[0], ok2[0]) and bool(ok.all())
    assert idx.shape == (1, min(topk, n)) and peak > 0


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 90), st.integers(1, 6), st.integers(1, 70), st.sampled_from([torch.float32, torch.float64]), st.integers(0, 2**31))
def test_select_one_scores_against_float64_and_keeps_their_top(n, Hi, Di, dtype, seed):
    """One query in one call (kernels/indexer_top.py select_one): each score sum_h w_h relu(qi_h . ik_j)
    against float64 from the same dequantized keys, and the top k those scores order (ties to the lower row)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 0x7f, (n + 3, Di), dtype=np.uint8)            # finite E4M3 codes, rows past n unread
    scale = rng.uniform(0.01, 4, n + 3).astype(np.float32)
    np_dt = np.float32 if dtype == torch.float32 else np.float64
    qi, wh = rng.standard_normal((Hi, Di)).astype(np_dt), rng.standard_normal(Hi).astype(np_dt)
    k = int(rng.integers(1, n + 1))
    score, idx, ok = np.empty(n, np_dt), np.empty(k, np.int64), np.empty(k, np.bool_)
    indexer_top.select_one(codes, scale, indexer_top.E4M3, qi, wh, score, k, idx, ok)
    keys = np.empty((n, Di), np_dt)
    indexer_top.index_keys(codes[:n], scale[:n], keys)
    want = (np.maximum(qi.astype(np.float64) @ keys.astype(np.float64).T, 0) * wh[:, None]).sum(0)
    bound = np.abs(wh).astype(np.float64) @ (np.abs(qi).astype(np.float64) @ np.abs(keys).astype(np.float64).T)   # [n]
    assert (np.abs(score - want) <= (1e-6 if dtype == torch.float32 else 1e-14) * bound).all()
    assert list(idx) == list(np.argsort(-score, kind="stable")[:k]) and ok.all()
