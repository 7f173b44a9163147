"""The int8-per-32 expert inputs: the kernel's own quantizer equals the torch definition bit for bit,
and the whole CPU expert FFN stays within a stated tolerance of the float model it approximates.

Tolerance against float inputs: one int8 step is 1/127 of a block's max, a rounding error of at most
half of it per input, ~0.3% relative per matmul for Gaussian inputs; two chained matmuls (gate/up, then
down) measure 0.5-0.9% here. We allow 2% (norm-wise)."""
import numpy as np
import torch
from hypothesis import assume, given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from kernels.cpu_moe import Fp4Bank, _prepare, expert_ffn, expert_ffn_reference
from kernels.formats import quantize_act
from kernels.fp4_i8 import OFFSET

FLOAT_MODEL_RTOL = 2e-2


def _unpack(xq, xc, xr, K):
    """The kernel's layout back to input order: (q [K] int, scale per input [K], xc)."""
    q = np.empty(K, np.int64)
    q[0::2], q[1::2] = xq[:K // 2], xq[K // 2:]
    return q, np.repeat(2 * xr[0::4], 32), xc


blocks = arrays(np.float32, st.integers(1, 6).map(lambda n: 32 * n),
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
    xq, xc, xr = _prepare(x[None], np.zeros(1, np.int64))
    q, s, corr = _unpack(xq[0], xc[0], xr[0], K)
    want = quantize_act(torch.from_numpy(x)).numpy()
    assert np.array_equal((q * s.astype(np.float64)).astype(np.float32), want)
    assert (np.abs(q) <= 127).all()
    # the offset's share per 4 code bytes (8 inputs: 4 even, 4 odd)
    per_byte = (q[0::2] + q[1::2]).reshape(-1, 4).sum(1)
    assert np.array_equal(corr, OFFSET * per_byte)


def test_a_non_finite_input_block_reaches_the_output_as_nan():
    bank = Fp4Bank.random(4, 128, 64, seed=3)
    x = np.random.default_rng(0).standard_normal((2, 128)).astype(np.float32)
    x[1, 40] = np.inf
    y = expert_ffn(x, np.array([[1], [1]]), np.ones((2, 1), np.float32), bank)
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()


def test_a_nan_weight_scale_reaches_its_row():
    bank = Fp4Bank.random(4, 128, 64, seed=4)
    bank.w2_scales[2, 5, 1] = 255                                 # E8M0 255 = NaN: row 5 of expert 2's down
    x = np.random.default_rng(1).standard_normal((1, 128)).astype(np.float32)
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
