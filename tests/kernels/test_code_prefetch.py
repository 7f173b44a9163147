"""The codes' L1 prefetch (kernels/fp4_i8.py CODE_L1_AHEAD): emitted as set, for the path it is set for,
and never a change of bits; the lab that times it (kernels/lab/code_prefetch.py) compiles each copy with
its own setting and gives the package's back."""
import types

import numpy as np
import pytest
from numba import njit

from kernels import fp4_i8 as fi
from kernels.cpu_moe import MODE, _prepare, random_bytes
from kernels.fp4_i8 import fp4_i8_dot
from kernels.lab.code_prefetch import POOL, TOP_K, compile_copy, ffn_copy, plans

K, ROWS, T = 1024, 6, 2                                # 512 code bytes a row: whole superblocks on every path


def _gemv():
    @njit
    def f(w, s, xq, xc, xr, out):
        for r in range(ROWS):
            fp4_i8_dot(1, T, MODE, w, r * (K // 2), 0, s, r * (K // 32), 0, xq, xc, xr, 0, K, out, r, ROWS, 0)
    return f


def _compiled(ahead):
    """A fresh GEMV compiled with CODE_L1_AHEAD = ahead for the host's path (None: the package's own), its
    output on fixed inputs and its machine code."""
    rng = np.random.default_rng(0)
    w, s = random_bytes(rng, (ROWS * K // 2,)), rng.integers(118, 130, ROWS * K // 32, dtype=np.uint8)
    x = [a.reshape(-1) for a in _prepare(rng.standard_normal((T, K)).astype(np.float32), np.arange(T))]
    out, f = np.empty(T * ROWS, np.float32), _gemv()
    with fi.emitting(fi.CODE_L1_AHEAD, MODE, fi.CODE_L1_AHEAD.get(MODE, 0) if ahead is None else ahead):
        f(w, s, *x, out)
    return out, "".join(f.inspect_asm().values())


@pytest.mark.skipif(not MODE, reason="scalar ISA: no SIMD kernel emits a prefetch")
def test_the_l1_prefetch_is_emitted_as_set_and_changes_no_bits():
    none, asm_none = _compiled(-1)
    two, asm_two = _compiled(2)
    own, asm_own = _compiled(None)
    assert asm_none.count("prefetcht0") == 0
    assert asm_two.count("prefetcht0") > 0
    assert asm_none.count("prefetcht2") == asm_two.count("prefetcht2") > 0      # the stream's L2 prefetch either way
    assert (asm_own.count("prefetcht0") > 0) == (fi.CODE_L1_AHEAD.get(MODE, 0) > 0)
    assert np.array_equal(none.view(np.uint32), two.view(np.uint32))
    assert np.array_equal(none.view(np.uint32), own.view(np.uint32))


def test_the_lab_s_copies_are_uncached_and_their_own():
    a, b = ffn_copy(2, "a"), ffn_copy(-1, "b")
    for mod in (a, b):
        for f in (mod._ffn, mod._passes, mod._matvecs, mod._matvecs_wide):
            assert type(f._cache).__name__ == "NullCache"                          # never the package's machine code
    assert a._ffn is not b._ffn and a._matvecs is not b._matvecs
    assert (a.ahead, b.ahead) == (2, -1)


def test_the_lab_compiles_a_copy_under_its_setting_and_restores_the_package_s():
    before, seen = dict(fi.CODE_L1_AHEAD), []
    mod = types.SimpleNamespace(ahead=3, _ffn=lambda *a: seen.append(dict(fi.CODE_L1_AHEAD)))
    compile_copy(mod, 1, 2)
    assert seen == [{**before, MODE: 3}]
    assert fi.CODE_L1_AHEAD == before

    def boom(*a):
        raise RuntimeError("compile failed")
    with pytest.raises(RuntimeError):
        compile_copy(types.SimpleNamespace(ahead=5, _ffn=boom))
    assert fi.CODE_L1_AHEAD == before


def test_the_lab_s_steps_are_batch_1_or_a_verify_from_a_pool():
    rng, E = np.random.default_rng(0), 40
    b1 = plans(1, E, rng, n=12)
    assert all(p.shape == (1, TOP_K) for p in b1)
    assert len(np.unique(np.concatenate(b1))) == E                                # consecutive fresh experts, wrapping
    for W in (2, 8):
        for i, p in enumerate(plans(W, E, rng, n=12)):
            assert p.shape == (W, TOP_K)
            assert all(len(set(row)) == TOP_K for row in p)                         # top-6: no expert twice a token
            assert set(((p - (POOL + 1) * i) % E).flat) <= set(range(POOL)) and p.max() < E   # one pool, wrapping
