"""kernels/fp4_lanes.py: the lanes layout keeps every row's bytes, and the lanes-as-rows kernel on every SIMD
path this CPU runs against float64 products of the quantized inputs, its bits the same whatever the
inputs, groups, threads or slot beside each output.

Tolerance: each block's term is an exact integer times exact power-of-two and input scales (float32
products of <= 2 rounding steps), summed in float32 over K/32 blocks: |y - ref| <= 8 (K/32) 2^-24 x
sum |x^| max |w| (as tests/kernels/test_triton_gpu.py holds the device kernel)."""
import itertools

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostinfo import runnable_isas
from kernels import cpu_moe
from kernels.cpu_moe import Fp4Bank, _prepare, expert_ffn, expert_ffn_reference, random_bytes
from kernels.formats import dequantize_mxfp4, quantize_act
from kernels.fp4_i8 import STEP
from kernels.fp4_lanes import BLOCK_ENTRIES, fp4_lanes_dot, group_rows, to_lanes, to_rows

PATHS = {"avx2": 1, "avx512": 2, "avx512vnni": 3, "avx512vbmi": 4, "avx2vnni": 5}


@settings(max_examples=30, deadline=None)
@given(group=st.sampled_from([8, 16]), n=st.integers(1, 4), blocks=st.integers(1, 6), lead=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_the_lanes_layout_moves_every_rows_bytes_and_back(group, n, blocks, lead, seed):
    rng = np.random.default_rng(seed)
    N, K = n * group, 32 * blocks
    codes = random_bytes(rng, (lead, N, K // 2))
    scales = rng.integers(0, 256, (lead, N, K // 32), dtype=np.uint8)
    c, s = to_lanes(codes, scales, group)
    assert c.shape == codes.shape and s.shape == scales.shape
    cv, sv = c.reshape(lead, n, K // 8, group, 4), s.reshape(lead, n, K // 32, group)
    for e, r in ((0, 0), (lead - 1, N - 1), (lead // 2, N // 2)):
        for d in (0, K // 8 - 1):
            assert cv[e, r // group, d, r % group].tolist() == codes[e, r, 4 * d:4 * d + 4].tolist()
        assert sv[e, r // group, :, r % group].tolist() == scales[e, r].tolist()
    back = to_rows(c, s, group)
    assert np.array_equal(back[0], codes) and np.array_equal(back[1], scales)


def test_the_lanes_inputs_are_the_in_order_inputs_with_one_entry_a_block():
    """`_prepare(.., BLOCK_ENTRIES)`: the q bytes of the layout without superblocks, and entry b the sum of
    that layout's 4 offset shares of block b with its scale; a non-finite block keeps its NaN scale."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((3, 352)) * 10.0 ** rng.integers(-4, 4, (3, 1))).astype(np.float32)
    x[2, 100] = np.nan
    rows = np.array([0, 2, 1, 2])
    q0, c0, r0 = _prepare(x, rows, 0)
    q1, c1, r1 = _prepare(x, rows, BLOCK_ENTRIES)
    nb = 352 // 32
    assert np.array_equal(q0, q1)
    assert c1.shape == r1.shape == (4, nb)                      # one entry a block, nothing unused
    assert np.array_equal(c1, c0.reshape(4, nb, 4).sum(-1))
    assert np.array_equal(r1, r0[:, ::4], equal_nan=True) and np.isnan(r1[1, 3]) and np.isnan(r1[3, 3])


def _gemv(mode, G, T, fetch=0):
    """Every row of a lanes bank [N, K/2] through fp4_lanes_dot, G groups x T inputs a call -> out [T, N]
    (fetch: the calls' literal, fp4_lanes FAR / FAR_ALONE / NEAR)."""
    R = group_rows(mode)

    @numba.njit
    def f(codes, scales, xq, xc, xr, K, out):
        N = out.shape[1]
        for r in range(0, N, G * R):
            fp4_lanes_dot(G, T, mode, fetch, codes.reshape(-1), r * (K // 2), R * (K // 2), scales.reshape(-1), r * (K // 32), R * (K // 32),
                          xq, xc, xr, 0, K, out.reshape(-1), r, N, R)
    return f


@pytest.mark.parametrize("path", list(PATHS))
def test_every_simd_path_against_float64_with_the_same_bits_for_any_groups_and_inputs_a_call(path):
    """Rows of 1, 3 and 72 blocks (K = 32, 96, 2304), 7 inputs (some in blocks of extreme scales, one
    non-finite), a NaN weight scale: 1 group x 1 input a call is the reference for the bits of 4 groups x 7
    inputs and 2 x 3 (every output one FMA chain), all against float64."""
    if path not in runnable_isas():
        pytest.skip(f"this CPU cannot run the {path} path")
    mode = PATHS[path]
    R = group_rows(mode)
    assert R == STEP[mode] // 4
    rng = np.random.default_rng()
    for K in (32, 96, 2304):
        N, T = 8 * R, 7
        codes = random_bytes(rng, (N, K // 2))
        scales = rng.integers(110, 140, (N, K // 32), dtype=np.uint8)
        scales[R + 3, K // 64] = 255                                   # E8M0 NaN: row R + 3's outputs only
        x = (rng.standard_normal((T, K)) * np.repeat(np.logspace(-3, 3, K // 32), 32)).astype(np.float32)
        x[6, 5] = np.inf                                               # input 6: NaN everywhere
        lc, ls = to_lanes(codes, scales, R)
        xq, xc, xr = (a.reshape(-1) for a in _prepare(x, np.arange(T), BLOCK_ENTRIES))
        outs = {}
        for G, Tc in ((1, 1), (4, 7), (2, 3)):
            out = np.full((T, N), -1.0, np.float32)
            f = _gemv(mode, G, Tc)
            for j in range(0, T - Tc + 1, Tc):
                f(lc, ls, xq[j * K:], xc[j * K // 32:], xr[j * K // 32:], K, out[j:])
            outs[(G, Tc)] = out
        ref = (quantize_act(torch.from_numpy(x)).double()
               @ dequantize_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), torch.float64).T).numpy()
        y = outs[(1, 1)]
        assert np.array_equal(np.isnan(y), np.isnan(ref)) and np.isnan(y[:, R + 3]).all() and np.isnan(y[6]).all(), K
        ok = ~np.isnan(ref)
        w = np.nan_to_num(dequantize_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), torch.float64).numpy())
        bound = np.abs(quantize_act(torch.from_numpy(x)).double().numpy()) @ np.ones(K) * np.abs(w).max()
        assert (np.abs(y - ref)[ok] <= 8 * K / 32 * 2 ** -24 * np.broadcast_to(bound[:, None], ref.shape)[ok]).all(), K
        assert np.array_equal(outs[(4, 7)].view(np.uint32), y.view(np.uint32)), K
        assert np.array_equal(outs[(2, 3)][:6].view(np.uint32), y[:6].view(np.uint32)), K


@pytest.mark.skipif(not cpu_moe.GROUP, reason=f"this host's path ({cpu_moe.ISA}) keeps its banks' rows in order")
def test_the_hosts_banks_are_laid_out_as_its_kernel_reads_them():
    """from_experts repacks the checkpoint's rows (the bank's memory is the same), the reference reads them
    back in rows' order, and expert_ffn on it matches float64 with the same bits for every streams,
    inputs and thread count, for a token alone or among others, in a slot of 1 or 13 inputs."""
    rng = np.random.default_rng()
    E, H, I = 4, 320, 96                                      # w2: 320 rows, a short last chunk of 64
    src = Fp4Bank.random(E, H, I, seed=int(rng.integers(1 << 30)), group=0)
    experts = [{"w1": (src.w13_codes[e, :I], src.w13_scales[e, :I]), "w3": (src.w13_codes[e, I:], src.w13_scales[e, I:]),
                "w2": (src.w2_codes[e], src.w2_scales[e])} for e in range(E)]
    bank = Fp4Bank.from_experts(experts)
    assert bank.group == cpu_moe.GROUP and not np.array_equal(bank.w13_codes, src.w13_codes)
    assert all(np.array_equal(a, b) for a, b in zip(bank.rows("w13"), (src.w13_codes, src.w13_scales)))
    assert all(np.array_equal(a, b) for a, b in zip(bank.rows("w2", 2), (src.w2_codes[2], src.w2_scales[2])))
    assert all(torch.equal(a, b) for a, b in zip(bank.expert_weights(1), src.expert_weights(1)))
    assert np.array_equal(bank.laid_out(0).w2_codes, src.w2_codes) and src.laid_out() is not src
    x = rng.standard_normal((13, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(13)])
    ids[:, 0] = 3                                             # expert 3: a slot of 13 inputs
    w = rng.random((13, 2)).astype(np.float32)
    y = expert_ffn(x, ids, w, bank)
    ref = expert_ffn_reference(x, ids, w, src).numpy()
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 2e-5
    for streams, inputs, threads in ((1, 8, 1), (4, 4, 2), (1, 4, 2)):
        assert np.array_equal(y, expert_ffn(x, ids, w, bank, streams=streams, inputs=inputs, threads=threads))
    alone = expert_ffn(x[5:6], ids[5:6], w[5:6], bank)
    assert np.array_equal(alone[0], y[5])
    with pytest.raises(ValueError, match="layout is group 0"):
        expert_ffn(x, ids, w, src)


@pytest.mark.skipif(not cpu_moe.GROUP, reason=f"this host's path ({cpu_moe.ISA}) keeps its banks' rows in order")
def test_the_weight_streams_l2_prefetch_at_one_input_follows_its_rule_and_fetching_and_changes_no_bits(monkeypatch):
    """fp4_lanes.L2_ONE_INPUT (this path's entry) and the call's fetching (FETCHES): calls of two inputs
    always emit the L2 prefetch of the codes (a prefetch whose locality is not T0's: the L1 one is); a call
    of one input fetching "far" does under "always", under "shared" only beside other threads (not alone),
    under "never" not at all, and fetching "near" never, its L1 prefetch at its own distance (other code
    than "far" alone under "never"); any other rule is refused by name. A call's outputs are the same bits
    whichever it emits."""
    from kernels import fp4_lanes, fp4_simd
    from kernels.fp4_lanes import FAR, FAR_ALONE, NEAR
    mode, R, K = cpu_moe.MODE, cpu_moe.GROUP, 2304
    rng = np.random.default_rng()
    lc, ls = to_lanes(random_bytes(rng, (2 * R, K // 2)), rng.integers(118, 130, (2 * R, K // 32), dtype=np.uint8), R)
    x = rng.standard_normal((2, K)).astype(np.float32)
    xq, xc, xr = (a.reshape(-1) for a in _prepare(x, np.arange(2), BLOCK_ENTRIES))
    outs, l2, asms = {}, {}, {}
    monkeypatch.setattr(fp4_simd, "WEIGHT_PREFETCH", 16384)
    for T, fetch, rule in itertools.product((1, 2), (FAR, FAR_ALONE, NEAR), fp4_lanes.L2_RULES):
        monkeypatch.setattr(fp4_lanes, "L2_ONE_INPUT", {**fp4_lanes.L2_ONE_INPUT, mode: rule})   # read as the kernel is emitted
        f, out = _gemv(mode, 1, T, fetch), np.zeros((T, 2 * R), np.float32)
        f(lc, ls, xq, xc, xr, K, out)
        asms[(T, fetch, rule)] = asm = "".join(f.inspect_asm().values())
        l2[(T, fetch, rule)] = sum(asm.count(p) for p in ("prefetcht1", "prefetcht2", "prefetchnta"))
        outs[(T, fetch, rule)] = out
    skipped = {(1, FAR_ALONE, "shared"), (1, FAR, "never"), (1, FAR_ALONE, "never")} | \
        {(1, NEAR, rule) for rule in fp4_lanes.L2_RULES}
    assert all(l2[k] == 0 for k in skipped)
    assert all(n > 0 for k, n in l2.items() if k not in skipped)
    assert asms[(1, NEAR, "never")] != asms[(1, FAR_ALONE, "never")]       # the L1 prefetch's distance
    for T in (1, 2):
        first = outs[(T, FAR, "always")].view(np.uint32)
        assert all(np.array_equal(first, o.view(np.uint32)) for k, o in outs.items() if k[0] == T)
    monkeypatch.setattr(fp4_lanes, "L2_ONE_INPUT", {**fp4_lanes.L2_ONE_INPUT, mode: "sometimes"})
    with pytest.raises(Exception, match="L2_ONE_INPUT.*sometimes"):
        _gemv(mode, 1, 1, 1)(lc, ls, xq, xc, xr, K, np.zeros((1, 2 * R), np.float32))
