"""CPU expert FFN against a float64 torch reference on fresh random inputs.

Tolerance (against the reference of the same arithmetic: int8-per-32 inputs, tests/kernels/test_act_quant.py
holds it against the float model): the kernel accumulates in float32 over K <= 512 products per dot, so its error against
the float64 reference is ~1e-6 relative; we allow 2e-5 (norm-wise) and 1e-4 (element-wise, of the
output's scale). The dense prefill path rounds weights and inputs to bf16: 2e-2.
"""
import json
import os
import subprocess
import sys
import zlib

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
    ("superblocks-and-tails", 6, 1024, 576, 3, 2, False),       # rows of 2 superblocks; 1 + a 32-byte tail
    ("superblock-verify", 8, 640, 320, 7, 3, False),            # 1 superblock + a 64-byte vector; up to 7 inputs a row
    ("superblock-wide", 3, 640, 320, 13, 2, False),             # 13 tokens on 3 experts: several blocks of inputs per row
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


THREADS_SCRIPT = """
import numpy as np, sys
from kernels.cpu_moe import Fp4Bank, expert_ffn
bank = Fp4Bank.random(4, 256, 128, seed=4)
rng = np.random.default_rng(0)
x = rng.standard_normal((16, 256)).astype(np.float32)
ids = rng.integers(0, 4, (16, 6)); w = rng.random((16, 6)).astype(np.float32)
np.save(sys.argv[1], np.stack([expert_ffn(x, ids, w, bank, threads=t, streams=s, inputs=n, fetch=f)
                               for t in (1, 3, 4) for s, n in ((4, 4), (1, 4), (1, 8)) for f in ("far", "near")]))
"""


def test_bit_identical_for_any_thread_count(tmp_path):
    """1, 3 and 4 threads (numba runs 4 threads on any host, one core included), each row layout
    (one DRAM stream per thread or four), rows in order 4 or 8 inputs per row decode (~24 inputs
    an expert here), and either fetching give the same bits."""
    out = tmp_path / "y.npy"
    env = dict(os.environ, NUMBA_NUM_THREADS="4")
    p = subprocess.run([sys.executable, "-c", THREADS_SCRIPT, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    y = np.load(out)
    assert all(np.array_equal(y[0], y[i]) for i in range(1, len(y))) and np.abs(y[0]).sum() > 0
    with pytest.raises(ValueError, match="streams"):
        bank = Fp4Bank.random(2, 64, 32)
        expert_ffn(np.ones((1, 64), np.float32), np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32), bank, streams=2)
    with pytest.raises(ValueError, match="fetch must be one of"):
        expert_ffn(np.ones((1, 64), np.float32), np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32), bank, fetch="l2")


def test_dense_prefill_path():
    bank, x, ids, w = _case(5, 8, 128, 64, 64, 4)
    ref = expert_ffn_reference(x, ids, w, bank)
    _check(expert_ffn_dense(x, ids, w, bank, dtype=torch.float32), ref)
    _check(expert_ffn_dense(x, ids, w, bank), ref, rtol=2e-2)


def test_kernels_release_the_gil():
    """Python keeps running while one long kernel call runs in another thread (the runtime overlaps
    them): the longest pause of a Python loop is far below the call's length (a held GIL: all of it)."""
    import threading
    import time
    bank = Fp4Bank.random(16, 1024, 512, seed=2)
    x = np.random.default_rng(1).standard_normal((256, 1024)).astype(np.float32)
    ids = np.tile(np.arange(16), (256, 1))
    w = np.ones((256, 16), np.float32)
    expert_ffn(x, ids, w, bank, threads=1)                       # compiled before timing
    t0 = time.perf_counter()
    expert_ffn(x, ids, w, bank, threads=1)
    call = time.perf_counter() - t0
    assert call > 0.05, call
    th = threading.Thread(target=expert_ffn, args=(x, ids, w, bank), kwargs={"threads": 1})
    gaps, last = [], time.perf_counter()
    th.start()
    while th.is_alive():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    th.join()
    assert max(gaps) < 0.5 * call, (max(gaps), call)


def test_bad_inputs_named():
    bank, x, ids, w = _case(6, 4, 64, 32, 1, 2)
    with pytest.raises(ValueError, match="out of range"):
        expert_ffn(x, ids + 10, w, bank)
    with pytest.raises(ValueError, match="do not fit"):
        expert_ffn(x[:, :32], ids, w, bank)
    with pytest.raises(ValueError, match="w2_codes"):
        Fp4Bank(bank.w13_codes, bank.w13_scales, bank.w2_codes[:, :-1], bank.w2_scales)
    with pytest.raises(ValueError, match=r"inputs must be one of \(4, 8\), got 5"):
        expert_ffn(x, ids, w, bank, inputs=5)
    h, d = cpu_moe.ffn_scratch(ids, bank.inter, bank.hidden)               # the compiled call's scratch checked
    assert h.shape == (ids.size, 2 * bank.inter) and d.shape == (ids.size, bank.hidden)
    y = np.zeros_like(x)
    for bad in ((h[1:], d), (h, d[1:]), (np.empty((len(h), 2 * bank.inter - 1), np.float32), d)):
        with pytest.raises(ValueError, match="scratch does not fit"):
            cpu_moe._ffn(x, ids, w, bank.w13_codes, bank.w13_scales, bank.w2_codes, bank.w2_scales, 1, 4,
                         cpu_moe.l1_input_bytes(), 1, False, y, *bad)
    ids[0, 0] = -1                                                          # no assignment: no scratch row
    assert cpu_moe.ffn_scratch(ids, bank.inter, bank.hidden)[0].shape[0] == ids.size - 1


ISA_SCRIPT = """
import os
import numpy as np
from kernels.cpu_moe import ISA, Fp4Bank, expert_ffn, expert_ffn_reference, dequant_experts
from kernels.formats import dequantize_mxfp4
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
assert ISA == {isa!r}, ISA
rng = np.random.default_rng(0)
errs = []
for H, I in ((160, 96), (1024, 576)):           # every row in tail steps; superblocks, vectors and 16-byte steps
    bank = Fp4Bank.random(6, H, I, seed=1)
    x = rng.standard_normal((3, H)).astype(np.float32)
    ids = np.array([[0, 5], [5, 2], [1, 1]]); w = rng.random((3, 2)).astype(np.float32)
    y = expert_ffn(x, ids, w, bank); r = expert_ffn_reference(x, ids, w, bank).numpy()
    assert np.array_equal(y, expert_ffn(x, ids, w, bank, streams=1)), "row layouts differ"
    errs.append(np.linalg.norm(y - r) / np.linalg.norm(r))
    xs, ids7, w7 = rng.standard_normal((7, H)).astype(np.float32), np.ones((7, 1), np.int64), np.ones((7, 1), np.float32)
    fits = [expert_ffn(xs, ids7, w7, bank, streams=1, inputs=n) for n in (4, 8)]
    os.environ["DSV41_L1D_KIB"] = "1"           # 7 inputs pass 7/8 KiB: _matvecs_wide on this path, the same bits
    assert all(np.array_equal(fits[0], expert_ffn(xs, ids7, w7, bank, streams=s, inputs=n)) for s, n in ((1, 4), (1, 8), (4, 4))), "wide slot"
    del os.environ["DSV41_L1D_KIB"]
    assert np.array_equal(fits[0], fits[1])
err = max(errs)
d = dequant_experts(bank.w2_codes, bank.w2_scales, [4], bank.group)[0]          # the bank's layout, rows in order
dr = dequantize_mxfp4(*(torch.from_numpy(a) for a in bank.rows("w2", 4))).numpy()
print(err, np.array_equal(d, dr))
"""


def _runnable_isas():
    from hostinfo import runnable_isas
    return runnable_isas()


ISAS = ["avx512vbmi", "avx512vnni", "avx512", "avx2vnni", "avx2", "scalar"]


def _isa_case(isa):
    if isa not in _runnable_isas():
        pytest.skip(f"this CPU cannot run the {isa} path")
    env = dict(os.environ, DSV41_CPU_ISA=isa)
    return subprocess.run([sys.executable, "-c", ISA_SCRIPT.format(isa=isa)], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def isa_runs(request, start_cases):
    """Every path's process started at once, two at a time (each mostly compiling its kernels cold)."""
    with start_cases(request, {isa: (_isa_case, isa) for isa in ISAS}) as runs:
        yield runs


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_path_this_cpu_can_run(isa_runs, isa):
    out = isa_runs[isa].result()
    assert out.returncode == 0, out.stderr[-2000:]
    err, exact = out.stdout.split()
    assert float(err) < RTOL and exact == "True"


def test_batch_invariant_a_token_alone_or_in_a_verify_batch():
    """DSpark's lossless greedy verify needs each token's output to be the same bits whether it is
    computed alone (plain decode) or in a batch sharing experts (the 4-token decode reuse)."""
    for T in (5, 6, 7, 8, 11):                               # 11 = 8 + 3 (AVX-512) or 4 + 4 + 3 inputs sharing row decodes
        bank, x, ids, w = _case(8 + T, 6, 640, 64, T, 3)
        ids[:, 0] = 2                                        # every token shares expert 2
        batch = expert_ffn(x, ids, w, bank)
        for t in range(len(x)):
            assert np.array_equal(batch[t], expert_ffn(x[t:t + 1], ids[t:t + 1], w[t:t + 1], bank)[0]), (T, t)


@pytest.mark.parametrize("l1d_kib", [32, 48])
def test_a_wide_slot_takes_its_inputs_block_by_block_over_the_rows_with_the_same_bits(monkeypatch, l1d_kib):
    """Where a slot's inputs pass 7/8 of the L1D (the host fact, overridden here), a block of them passes
    over the chunk's rows, then the next (`_matvecs_wide`), 8 to a row decode where 8 fit, else 4; the
    w2 pass's short rows (K = 64) fit and take `_matvecs`. 13 tokens on the same two experts: every
    layout and inputs choice gives the reference's values and the bits each token gets alone."""
    monkeypatch.setenv("DSV41_L1D_KIB", str(l1d_kib))
    H, T = 4096, 13
    assert cpu_moe.l1_input_bytes() == l1d_kib * 896 and T * H > cpu_moe.l1_input_bytes() >= T * 64
    assert (8 * H > cpu_moe.l1_input_bytes()) == (l1d_kib == 32)  # w13's inputs 4 at a time at 32 KiB, 8 at 48
    bank, x, _, w = _case(21, 3, H, 64, T, 2)
    ids = np.tile(np.array([1, 2]), (T, 1))
    ys = [expert_ffn(x, ids, w, bank, streams=s, inputs=n) for s, n in ((1, 8), (1, 4), (4, 4))]
    _check(ys[0], expert_ffn_reference(x, ids, w, bank))
    assert all(np.array_equal(ys[0], y) for y in ys[1:])
    for t in (0, 4, 8, 12):
        assert np.array_equal(ys[0][t], expert_ffn(x[t:t + 1], ids[t:t + 1], w[t:t + 1], bank, inputs=8)[0]), t


def test_unassigned_entries_are_skipped_not_computed():
    """-1 marks no assignment (a split call's other experts): nothing is computed for it. Expert 0 has
    NaN scales here, so computing it with weight 0 (the old masking) would poison the output."""
    bank, x, ids, w = _case(10, 6, 128, 64, 5, 3)
    bank.w13_scales[0] = 255                                 # E8M0 255 = NaN
    ids = np.where(ids == 0, 1, ids)
    ids[:, 0] = -1
    y = expert_ffn(x, ids, w, bank)
    assert np.isfinite(y).all()
    keep = ids >= 0
    _check(y, expert_ffn_reference(x, np.where(keep, ids, 1), np.where(keep, w, 0).astype(np.float32), bank))


def test_a_forced_simd_path_caches_its_code_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """numba keys cached code by CPU, not by the SIMD path it was compiled for: each forced path
    ($DSV41_CPU_ISA) gets its own directory, named by the kernels' sources as the host's is."""
    import kernels
    monkeypatch.setenv("DSV41_KERNEL_CACHE", str(tmp_path))
    host, avx2, scalar = (kernels._salted_cache_dir(i) for i in (None, "avx2", "scalar"))
    assert len({host, avx2, scalar}) == 3 and avx2.name == host.name + "-avx2" and host.parent == tmp_path


def test_forcing_the_cpus_own_path_shares_the_hosts_cache_and_a_narrower_one_does_not(tmp_path):
    """The host's widest path forced compiles the host's code, so it reuses the host's directory (one
    compile of every kernel fewer in the suite); a narrower path keeps its own; both are cached."""
    from hostinfo.machine import native_isa
    code = ("import kernels; from numba.core import config; import json; "
            "print(json.dumps([config.CACHE_DIR, kernels.ISA_CACHE, kernels._salted_cache_dir(None).as_posix()]))")
    def run(forced):
        env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "DSV41_CPU_ISA")}
        env.update(DSV41_KERNEL_CACHE=str(tmp_path), **({"DSV41_CPU_ISA": forced} if forced else {}))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    host_dir, cached, host = run(None)
    assert host_dir == host and not cached
    same_dir, cached, _ = run(native_isa())
    assert same_dir == host and cached
    if native_isa() != "scalar":
        own_dir, cached, _ = run("scalar")
        assert own_dir == host + "-scalar" and cached


def _modes_gemv(mode):
    """Every row of codes [N, K/2] through fp4_i8_dot on instruction path `mode` -> out [4, N]: rows 0-2
    inputs 0-2 (4 rows at a time, 3 inputs a row decode), row 3 input 1 again, each row alone."""
    from kernels.fp4_i8 import fp4_i8_dot

    @numba.njit
    def f(codes, scales, xq, xc, xr, K, out):
        N = codes.shape[0]
        for r in range(0, N, 4):
            fp4_i8_dot(4, 3, mode, codes, r * (K // 2), K // 2, scales, r * (K // 32), K // 32, xq, xc, xr, 0, K, out, r, N, 1)
        for r in range(N):
            fp4_i8_dot(1, 1, mode, codes, r * (K // 2), 0, scales, r * (K // 32), 0, xq, xc, xr, 1, K, out, 3 * N + r, 0, 0)
    return f


@pytest.mark.parametrize("path, mode, same_as", [("avx512vbmi", 4, 3), ("avx2vnni", 5, 1)])
def test_a_path_that_computes_the_same_integers_gives_the_same_bits(path, mode, same_as):
    """avx512vbmi (mode 4) decodes the nibbles with `vpermb` instead of `vpandq` + `vpshufb` (avx512vnni,
    mode 3); avx2vnni (mode 5) sums the products with AVX-VNNI's `vpdpbusd` instead of `vpmaddubsw` +
    `vpmaddwd` (avx2, mode 1). The same integers per lane, so every output must be the other path's
    bits. Rows of superblocks, vector steps and 16-byte steps (K = 5120, 2304, 1056, 96), 4 rows x 3
    inputs a call and 1 x 1, fresh random codes and inputs, NaN scales included."""
    from hostinfo import runnable_isas
    if path not in runnable_isas():
        pytest.skip(f"this CPU cannot run the {path} path")
    from kernels.cpu_moe import _prepare, random_bytes
    from kernels.fp4_i8 import STEP, superblock_bytes
    assert STEP[mode] == STEP[same_as]
    ours, theirs = _modes_gemv(mode), _modes_gemv(same_as)
    rng = np.random.default_rng()
    for K in (5120, 2304, 1056, 96):
        codes = random_bytes(rng, (8, K // 2))
        scales = rng.integers(110, 140, (8, K // 32), dtype=np.uint8)
        scales[5, -1] = 255                                   # E8M0 NaN: NaN in that row's outputs on both paths
        x = rng.standard_normal((3, K)).astype(np.float32)
        xq, xc, xr = (a.reshape(-1) for a in _prepare(x, np.arange(3), superblock_bytes(mode)))
        outs = [np.full((4, 8), -1.0, np.float32) for _ in range(2)]
        theirs(codes, scales, xq, xc, xr, K, outs[0].reshape(-1))
        ours(codes, scales, xq, xc, xr, K, outs[1].reshape(-1))
        assert np.isnan(outs[0][:, 5]).all() and np.isfinite(np.delete(outs[0], 5, axis=1)).all(), K
        assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), K
        assert np.array_equal(outs[0][3].view(np.uint32), outs[0][1].view(np.uint32)), K   # alone: the bits it gets beside others


def _rows_gemv(mode, R, T):
    """Every row of codes [N, K/2] through fp4_i8_dot on path `mode`, R adjacent rows x T inputs a call -> out [T, N]."""
    from kernels.fp4_i8 import fp4_i8_dot

    @numba.njit
    def f(codes, scales, xq, xc, xr, K, out):
        N = codes.shape[0]
        for r in range(0, N, R):
            fp4_i8_dot(R, T, mode, codes, r * (K // 2), K // 2, scales, r * (K // 32), K // 32, xq, xc, xr, 0, K, out, r, N, 1)
    return f


@pytest.mark.parametrize("path, mode", [("avx2", 1), ("avx512vnni", 3)])
def test_rows_a_call_and_the_order_they_take_change_no_bit(path, mode):
    """A call of R rows decodes them before loading its inputs where they fit half the registers
    (ROWS_FIRST: 2 rows with 64-byte vectors, 1 with 32-byte ones), else loads the inputs first; the
    cpu_moe kernel takes rows in pairs on 64-byte paths (PAIRS). Neither the rows a call nor the order
    may move a bit: 1, 2 and 4 rows a call (both orders on either width) x 3 inputs, fresh random rows of
    superblocks, vector steps and 16-byte steps (K = 5120, 1056), against 1 row a call."""
    from hostinfo import runnable_isas
    if path not in runnable_isas():
        pytest.skip(f"this CPU cannot run the {path} path")
    from kernels import cpu_moe
    from kernels.cpu_moe import _prepare, random_bytes
    from kernels.fp4_i8 import ROWS_FIRST, STEP, superblock_bytes
    assert {R <= ROWS_FIRST[mode] for R in (1, 2, 4)} == {True, False}
    assert cpu_moe.PAIRS == (cpu_moe.MODE > 0 and STEP[cpu_moe.MODE] == 64) and (STEP[mode] == 64) == (ROWS_FIRST[mode] == 2)
    fs = {R: _rows_gemv(mode, R, 3) for R in (1, 2, 4)}
    rng = np.random.default_rng()
    for K in (5120, 1056):
        codes = random_bytes(rng, (8, K // 2))
        scales = rng.integers(110, 140, (8, K // 32), dtype=np.uint8)
        xq, xc, xr = (a.reshape(-1) for a in _prepare(rng.standard_normal((3, K)).astype(np.float32), np.arange(3), superblock_bytes(mode)))
        outs = {R: np.full((3, 8), np.nan, np.float32) for R in fs}
        for R, f in fs.items():
            f(codes, scales, xq, xc, xr, K, outs[R].reshape(-1))
        assert np.isfinite(outs[1]).all(), K
        assert all(np.array_equal(outs[1].view(np.uint32), o.view(np.uint32)) for o in outs.values()), K


def test_the_threads_take_spans_of_equal_work_not_equal_counts():
    """`_spans`: contiguous spans of (slot, row chunk) items covering every item once, each thread's cost
    (ITEM_READ + the slot's inputs, per item) within one item of an equal share, whatever the slots'
    widths; a call whose busy experts come first no longer leaves one thread the most of it."""
    rng = np.random.default_rng()
    for _ in range(200):
        S, per, nt = int(rng.integers(1, 40)), int(rng.integers(1, 90)), int(rng.integers(1, 9))
        widths = rng.integers(1, 60, S) if rng.random() < 0.5 else np.sort(rng.integers(1, 60, S))[::-1]
        off = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
        b = cpu_moe._spans(off, per, nt)
        assert b[0] == 0 and b[-1] == S * per and (np.diff(b) >= 0).all()
        cost = np.repeat(cpu_moe.ITEM_READ + widths, per)                   # item c's cost
        shares = np.add.reduceat(np.append(cost, 0), b[:-1]) * (np.diff(b) > 0)
        assert (np.abs(shares - cost.sum() / nt) <= cost.max()).all(), (widths, b, shares)
    assert (cpu_moe._spans(np.zeros(1, np.int64), 5, 3) == 0).all()       # no slot: nothing to split


@numba.njit
def _take(taken, c):
    return cpu_moe._claim(taken, c)                                     # an intrinsic: callable from compiled code


@settings(max_examples=300, deadline=None)
@given(spans=st.lists(st.integers(0, 12), min_size=1, max_size=6), seed=st.integers(0, 2**32 - 1))
def test_the_threads_finish_together_taking_every_item_once_in_any_interleaving(spans, seed):
    """`_next` (with `_claim`): each thread its own span from the front, then the others' from their ends,
    leaving a span at the first item it finds taken. Threads stepped in a random interleaving (one item a
    step, the scheduler's worst cases included: a thread that never runs until the rest are done, two
    thieves at one span): every item is taken exactly once, none skipped; and the intrinsic claims an
    item once and reports it taken after."""
    nt = len(spans)
    b = np.concatenate([[0], np.cumsum(spans)]).astype(np.int64)
    taken, by = np.zeros(b[nt], np.int32), np.full(b[nt], -1)
    state = [(0, 0) for _ in range(nt)]                                  # per thread: span k, index i of its next try
    live, rng = list(range(nt)), np.random.default_rng(seed)
    while live:
        t = live[rng.integers(len(live))]
        c, k, i = cpu_moe._next(taken, b, t, *state[t])
        if c < 0:
            live.remove(t)
            continue
        assert by[c] == -1
        by[c], state[t] = t, (k, i + 1)
    assert (by >= 0).all() and (taken == 1).all()
    assert not any(_take(taken, c) for c in range(b[nt]))                # a taken item stays taken


@settings(max_examples=200, deadline=None)
@given(T=st.integers(0, 9), K=st.integers(1, 8), E=st.integers(1, 20), seed=st.integers(0, 2**32 - 1))
def test_assignments_are_grouped_by_expert_in_token_order_whatever_the_banks_size(T, K, E, seed):
    """`_plan_slots` against a plain grouping: experts ascending, each slot's (token, k) in order, -1
    skipped; the same answer for a bank of 2**40 experts (the plan reads nothing the size of the bank: a
    probe's bank of hundreds of thousands of tiny experts once paid for a count over all of them)."""
    ids = np.random.default_rng(seed).integers(-1, E, (T, K))
    want = {}
    for t in range(T):
        for k in range(K):
            if ids[t, k] != -1:
                want.setdefault(int(ids[t, k]), []).append((t, k))
    for n in (E, 2**40):
        experts, off, tok, kk = cpu_moe._plan_slots(ids, n)
        assert list(experts) == sorted(want) and off[0] == 0 and off[-1] == len(tok) == len(kk)
        for s, e in enumerate(experts):
            assert list(zip(tok[off[s]:off[s + 1]], kk[off[s]:off[s + 1]])) == want[e]
    with pytest.raises(ValueError, match="out of range"):
        cpu_moe._plan_slots(np.full((1, K), E, np.int64), E)
