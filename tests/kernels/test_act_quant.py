"""The int8-per-32 expert inputs: the kernel's own quantizer equals the torch definition bit for bit,
and the whole CPU expert FFN stays within a stated tolerance of the float model it approximates.

Tolerance against float inputs: one int8 step is 1/127 of a block's max, a rounding error of at most
half of it per input, ~0.3% relative per matmul for Gaussian inputs; two chained matmuls (gate/up, then
down) measure 0.5-0.9% here. We allow 2% (norm-wise)."""
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from kernels.cpu_moe import SUPERBLOCK, Fp4Bank, _prepare, expert_ffn, expert_ffn_reference
from kernels.formats import quantize_act
from kernels.fp4_i8 import OFFSET, act_slot

FLOAT_MODEL_RTOL = 2e-2


def _unpack(xq, xc, xr, K, sbb=SUPERBLOCK):
    """The kernel's layout back to input order: (q [K] int, scale per input [K], -xc per code byte's
    entry [K/2], that entry [K/2])."""
    h = K // 2
    slots = np.array([act_slot(p, h, sbb) for p in range(h)])
    at, entry = slots[:, 0], slots[:, 1]
    q = np.empty(K, np.int64)
    q[0::2], q[1::2] = xq[:h][at], xq[h:][at]
    return q, np.repeat(2 * xr[entry], 2), -xc[entry], entry


@pytest.mark.parametrize("sbb", [0, 128, 256])
@pytest.mark.parametrize("K", [64, 512, 576, 1024, 5120])
def test_the_layout_is_a_permutation_and_entries_stay_in_one_block(K, sbb):
    """Every code byte has its own place in each half of xq; an entry (xc, xr) never spans two blocks
    (one scale) and is a block in superblocks, 4 code bytes after; entries fit in K/8."""
    h = K // 2
    slots = np.array([act_slot(p, h, sbb) for p in range(h)])
    assert sorted(slots[:, 0]) == list(range(h))
    p0 = (h // sbb) * sbb if sbb else 0
    for L in np.unique(slots[:, 1]):
        ps = np.nonzero(slots[:, 1] == L)[0]
        assert len(set(ps // 16)) == 1
        assert len(ps) == (16 if ps[0] < p0 else 4)
    assert slots[:, 1].max() < K // 8


blocks = arrays(np.float32, st.integers(1, 24).map(lambda n: 32 * n),      # up to 1.5 superblocks
                elements=st.one_of(st.floats(-1e4, 1e4, width=32), st.just(np.float32(0.0)),
                                   st.floats(-2.0 ** -100, 2.0 ** -100, width=32)))


@settings(max_examples=200, deadline=None)
@given(blocks)
def test_the_kernels_quantizer_is_quantize_act(x):
    """Bit for bit, except blocks whose scale max/127 is subnormal (max |x| < 1.5e-36: the kernel keeps
    scale/2, which loses low bits there; no activation of the model is that small)."""
    K = x.shape[0]
    amax = np.abs(x).reshape(-1, 32).max(1)
    assume(((amax == 0) | (amax >= 2.0 ** -100)).all())
    want = quantize_act(torch.from_numpy(x)).numpy()
    for sbb in (0, 128, 256):                                # the layouts of scalar, AVX2, AVX-512
        xq, xc, xr = _prepare(x[None], np.zeros(1, np.int64), sbb)
        q, s, corr, entry = _unpack(xq[0], xc[0], xr[0], K, sbb)
        assert np.array_equal((q * s.astype(np.float64)).astype(np.float32), want)
        assert (np.abs(q) <= 127).all()
        # the offset's share of each entry: the q's of the code bytes it covers (2 per byte: even, odd)
        per_entry = np.bincount(entry, weights=q[0::2] + q[1::2])
        assert np.array_equal(corr, OFFSET * per_entry[entry])


@pytest.mark.parametrize("sbb", [0, 128, 256])
def test_a_token_in_several_assignments_is_quantized_once_to_the_same_bytes(sbb):
    """`_prepare` quantizes a row that several assignments name once and copies it: every assignment's
    bytes are that row's own (prepared alone), whatever rows come before or after it."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 640)).astype(np.float32)
    rows = np.array([3, 0, 3, 3, 1, 0, 4, 3, 1], np.int64)                 # token 2: no assignment
    K = x.shape[1]
    g_sb = (K // 2 // sbb) * (sbb // 16) if sbb else 0           # blocks in superblocks: an entry each, else 4
    used = g_sb + 4 * (K // 32 - g_sb)                            # xc / xr entries written (the rest: unused)
    got = _prepare(x, rows, sbb)
    for a, r in enumerate(rows):
        alone = _prepare(x[r:r + 1], np.zeros(1, np.int64), sbb)
        for g, w in zip(got, alone):
            n = K if g.shape[1] == K else used                    # xq: every byte; xc, xr: the entries written
            assert np.array_equal(g[a, :n], w[0, :n]), (a, r)


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("at", [40, 63])                          # mid-block (finite values follow it); the block's last
def test_a_non_finite_input_block_reaches_the_output_as_nan(value, at):
    bank = Fp4Bank.random(4, 128, 64, seed=3)
    x = np.random.default_rng(0).standard_normal((2, 128)).astype(np.float32)
    x[1, at] = value
    y = expert_ffn(x, np.array([[1], [1]]), np.ones((2, 1), np.float32), bank)
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()


@pytest.mark.parametrize("H,I,block", [(128, 64, 1), (1024, 576, 1), (1024, 576, 17)])   # a tail entry; a superblock's; a tail's
def test_a_nan_weight_scale_reaches_its_row(H, I, block):
    bank = Fp4Bank.random(4, H, I, seed=4, group=0)                # rows in order, then this path's layout
    bank.w2_scales[2, 5, block] = 255                             # E8M0 255 = NaN: row 5 of expert 2's down
    bank = bank.laid_out()
    x = np.random.default_rng(1).standard_normal((1, H)).astype(np.float32)
    y = expert_ffn(x, np.array([[2]]), np.ones((1, 1), np.float32), bank)[0]
    assert np.isnan(y[5]) and np.isfinite(np.delete(y, 5)).all()


def test_the_expert_ffn_stays_near_the_float_model():
    rng = np.random.default_rng(7)
    for H, I, T in ((256, 128, 1), (512, 256, 6), (160, 96, 3)):
        bank = Fp4Bank.random(8, H, I, seed=H)
        x = rng.standard_normal((T, H)).astype(np.float32)
        ids = np.stack([rng.choice(8, 4, replace=False) for _ in range(T)])
        w = rng.random((T, 4)).astype(np.float32)
        y = expert_ffn(x, ids, w, bank)
        ref = expert_ffn_reference(x, ids, w, bank, act_quant=False).numpy()
        err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        assert 1e-4 < err < FLOAT_MODEL_RTOL, (H, I, T, err)        # quantized (not the float model), and close to it
