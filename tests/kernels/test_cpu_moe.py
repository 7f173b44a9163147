"""CPU expert FFN against a float64 torch reference on fresh random inputs.

Tolerance: the kernel accumulates in float32 over K <= 512 products per dot, so its error against
the float64 reference is ~1e-6 relative; we allow 2e-5 (norm-wise) and 1e-4 (element-wise, of the
output's scale). The dense prefill path rounds weights and inputs to bf16: 2e-2.
"""
import os
import subprocess
import sys
import zlib

import numba
import numpy as np
import pytest
import torch

from kernels import cpu_moe
from kernels.cpu_moe import Fp4Bank, expert_ffn, expert_ffn_dense, expert_ffn_reference

RTOL = 2e-5


def _case(seed, E, H, I, T, K, dup=False):
    rng = np.random.default_rng(seed)
    bank = Fp4Bank.random(E, H, I, seed=seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    if dup:
        ids[:, 1] = ids[:, 0]
    w = rng.random((T, K)).astype(np.float32)
    return bank, x, ids, w


def _check(y, ref, rtol=RTOL):
    ref = ref.numpy()
    assert np.isfinite(y).all()
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err < rtol, err
    assert np.abs(y - ref).max() < 5 * rtol * np.abs(ref).max()


@pytest.mark.parametrize("name,E,H,I,T,K,dup", [
    ("decode", 16, 256, 128, 1, 6, False),
    ("verify-overlap", 8, 256, 128, 6, 4, False),
    ("odd-shape", 5, 160, 96, 3, 2, False),
    ("many-tokens", 12, 128, 64, 40, 4, False),
    ("duplicate-experts", 6, 128, 64, 5, 3, True),
    ("one-expert-bank", 1, 64, 32, 2, 1, False),
])
def test_expert_ffn_matches_reference(name, E, H, I, T, K, dup):
    bank, x, ids, w = _case(zlib.crc32(name.encode()), E, H, I, T, K, dup)
    _check(expert_ffn(x, ids, w, bank), expert_ffn_reference(x, ids, w, bank))


def test_accumulates_into_out():
    bank, x, ids, w = _case(3, 8, 128, 64, 2, 2)
    base = np.random.default_rng(9).standard_normal(x.shape).astype(np.float32)
    out = base.copy()
    expert_ffn(x, ids, w, bank, out=out)
    _check(out - base, expert_ffn_reference(x, ids, w, bank))


def test_bit_identical_for_any_thread_count():
    bank, x, ids, w = _case(4, 16, 256, 128, 6, 6)
    numba.set_num_threads(1)
    y1 = expert_ffn(x, ids, w, bank)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    yn = expert_ffn(x, ids, w, bank, threads=numba.config.NUMBA_NUM_THREADS)
    assert np.array_equal(y1, yn)


def test_dense_prefill_path():
    bank, x, ids, w = _case(5, 8, 128, 64, 64, 4)
    ref = expert_ffn_reference(x, ids, w, bank)
    _check(expert_ffn_dense(x, ids, w, bank, dtype=torch.float32), ref)
    _check(expert_ffn_dense(x, ids, w, bank), ref, rtol=2e-2)


def test_kernels_release_the_gil():
    for f in (cpu_moe._matvecs, cpu_moe._dequant_experts, cpu_moe._swiglu_inputs):
        assert f.targetoptions.get("nogil"), f


def test_bad_inputs_named():
    bank, x, ids, w = _case(6, 4, 64, 32, 1, 2)
    with pytest.raises(ValueError, match="out of range"):
        expert_ffn(x, ids + 10, w, bank)
    with pytest.raises(ValueError, match="do not fit"):
        expert_ffn(x[:, :32], ids, w, bank)
    with pytest.raises(ValueError, match="w2_codes"):
        Fp4Bank(bank.w13_codes, bank.w13_scales, bank.w2_codes[:, :-1], bank.w2_scales)


ISA_SCRIPT = """
import numpy as np
from kernels.cpu_moe import ISA, Fp4Bank, expert_ffn, expert_ffn_reference, dequant_experts
from kernels.formats import dequantize_mxfp4
import torch
assert ISA == {isa!r}, ISA
rng = np.random.default_rng(0)
bank = Fp4Bank.random(6, 160, 96, seed=1)
x = rng.standard_normal((3, 160)).astype(np.float32)
ids = np.array([[0, 5], [5, 2], [1, 1]]); w = rng.random((3, 2)).astype(np.float32)
y = expert_ffn(x, ids, w, bank); r = expert_ffn_reference(x, ids, w, bank).numpy()
err = np.linalg.norm(y - r) / np.linalg.norm(r)
d = dequant_experts(bank.w2_codes, bank.w2_scales, [4])[0]
dr = dequantize_mxfp4(torch.from_numpy(bank.w2_codes[4]), torch.from_numpy(bank.w2_scales[4])).numpy()
print(err, np.array_equal(d, dr))
"""


def _runnable_isas():
    from hostinfo import isa
    host = isa()
    return {"avx512": ["avx512", "avx2", "scalar"], "avx2": ["avx2", "scalar"]}.get(host, ["scalar"])


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_every_isa_path_this_cpu_can_run(isa):
    if isa not in _runnable_isas():
        pytest.skip(f"this CPU cannot run the {isa} path")
    env = dict(os.environ, DSV41_CPU_ISA=isa)
    out = subprocess.run([sys.executable, "-c", ISA_SCRIPT.format(isa=isa)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    err, exact = out.stdout.split()
    assert float(err) < RTOL and exact == "True"


def test_batch_invariant_a_token_alone_or_in_a_verify_batch():
    """DSpark's lossless greedy verify needs each token's output to be the same bits whether it is
    computed alone (plain decode) or in a batch sharing experts (the 4-token decode reuse)."""
    bank, x, ids, w = _case(8, 6, 128, 64, 7, 3)
    ids[:, 0] = 2                                            # every token shares expert 2
    batch = expert_ffn(x, ids, w, bank)
    for t in range(len(x)):
        assert np.array_equal(batch[t], expert_ffn(x[t:t + 1], ids[t:t + 1], w[t:t + 1], bank)[0])
