"""CPU-MoE kernel vs DRAM stream read, measured in the same run.

  python benchmarks/cpu_moe.py [--threads 1 2] [--steps 24] [--quick] [--json]

For each thread count: DRAM stream read (buffer >= 4x LLC) and the kernel at batch 1 (1 token x top-6)
over a bank >= 4x LLC, fresh experts every step, in each row layout (`streams` 4: four rows a
quarter-chunk apart per thread; 1: rows in order), each also at a verify of 8 tokens and, on the lanes
paths, at batch 1 with each way of fetching one input's weights (kernels/fp4_lanes.py FETCHES), all
interleaved in rounds; the layout the profiler would pick from those (autotune/probes/cpu_moe.py
`pick_layout`: batch 1 and the verify together), then the faster fetching in it (`row_fetch`), is the
row's figure and the widths' setting; the others are kept beside it. Every ratio
is the median of per-round ratios, each round's kernel over the stream read in that round
(hostinfo.measure.paired_ratio: a VM's bandwidth can flip between phases a few seconds long), with
its spread over the rounds. Geometries: V4.1 (5120x2304,
18.80 MB/expert), V4-Flash (4096x2048) and a small one (2048x768). Also, on V4.1: widths 2-8 (GB/s of
distinct expert bytes), as a DSpark verify whose tokens' experts overlap (top-6 of a pool of 10) and
as a continuous batch of independent tokens (each token's top-6 drawn uniformly from V4.1's 384 routed
experts, the step's distinct ones on fresh bank experts: kernels/probe_bank.py `batch_ids`; the bank
holds 8 x 6 + 8 experts at least, so a host's small LLC does not turn a batch into a verify), the naive baseline (torch: dequantize to
float, then matmul) and prefill widths (tokens per expert) for the GEMV kernel and the dense path
(dequantize a tile + torch bf16 matmul), in GB/s and GFLOP/s (2 * 3 * H * I * tokens per expert).
Each width is also held against the products' roof: the host's int8 dot-product peak at the kernel's
instruction mix (kernels/int8_peak.py), times the step's distinct expert bytes per product (3 * H * I
per assignment): a wide call cannot read faster than min(stream, that roof). Both limits are measured
in every round beside the kernel (a VM's clock moves as its bandwidth does), and the ratio is the
median of the rounds' kernel / min(stream, roof).
With rows in order, widths 2-8 and the prefill GEMV run with each choice of inputs per row decode (4
or 8, kernels/cpu_moe.py ROW_INPUTS; the same bits), interleaved: the faster is the width's figure (as
the profiler picks it) and the other is printed beside it.
kernel GB/s = expert bytes moved / time. With --json the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numba
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402,F401  (before torch: it sets the process up for it, kernels/__init__.py)
import torch

from autotune.probes.cpu_moe import VERIFY_TOKENS, pick_layout  # noqa: E402
from hostinfo import llc_bytes, usable_cores  # noqa: E402
from hostinfo.measure import Measurement, measure, paired_ratio  # noqa: E402
from kernels.stream import dram_stream_read, stream_buffer  # noqa: E402
from kernels.int8_peak import measure_peak  # noqa: E402
from kernels.probe_bank import ProbeTooLarge, bank_size, batch_ids, step_ids  # noqa: E402
from runtime.config import ModelConfig  # noqa: E402
from kernels.cpu_moe import DEFAULT_FETCH, DEFAULT_INPUTS, FETCHES, GROUP, ISA, MODE, ROW_INPUTS, Fp4Bank, dequant_experts, expert_ffn, expert_ffn_dense  # noqa: E402

GEOMETRIES = {"v4.1": (5120, 2304), "v4-flash": (4096, 2048), "small": (2048, 768)}
WIDTHS = (2, 4, 6, 8)                                  # DSpark verify / continuous batching
ROUTED = ModelConfig.preset("deepseek-v4.1-flash").n_routed_experts     # a batch's tokens draw from these


def bank_for(H, I, seed=0, batch=0):
    """The profiler's sizing: >= 4x the total LLC, >= 2 * top_k + 8 experts (batch * top_k + 8 where a
    batch of independent tokens is measured, else the verify's floor, said), within the probe budget
    (ProbeTooLarge when not even the verify's floor fits)."""
    try:
        n, note = bank_size(H, I, top_k=6, batch=batch)
    except ProbeTooLarge as e:
        if not batch:
            raise
        n, note = bank_size(H, I, top_k=6)
        print(f"note: {e}: the batch widths whose experts the {n}-expert bank cannot hold apart are not measured", flush=True)
    if note:
        print(f"note: {note}", flush=True)
    return Fp4Bank.random(n, H, I, seed=seed)


def decode_step(bank, T=1, pool=None, streams=4, inputs=DEFAULT_INPUTS, routed=None, fetch=DEFAULT_FETCH):
    """A closure that runs one step on fresh experts each call (fn.bytes: distinct expert bytes per step).
    T = 1: 6 consecutive experts; `pool`: a verify (T tokens' top-6 from `pool` experts); `routed`: a batch
    of T independent tokens, each top-6 of `routed` model experts."""
    rng = np.random.default_rng(0)
    state = {"i": 0}
    x = rng.standard_normal((T, bank.hidden)).astype(np.float32)
    w = np.full((T, 6), 1 / 6, np.float32)
    E = bank.n_experts
    if routed:                                         # a batch of independent tokens
        def ids_at(i):
            return batch_ids(i, T, 6, E, routed, rng)
    elif pool is None:                                 # batch 1: 6 consecutive fresh experts
        def ids_at(i):
            return step_ids(i, 1, 6, E, 0, rng).repeat(T, 0)
    else:                                              # verify: T tokens' top-6 drawn from `pool` experts
        def ids_at(i):
            return step_ids(i, T, 6, E, pool, rng)
    plan = [ids_at(i) for i in range(64)]

    def fn():
        ids = plan[state["i"] % len(plan)]
        state["i"] += 1
        expert_ffn(x, ids, w, bank, streams=streams, inputs=inputs, fetch=fetch)
    # distinct expert bytes per step: the mean over the plan (a verify step meets 6-10 of its pool), as the
    # profiler's probe counts them (autotune/probes/cpu_moe.py), not the last step's count
    fn.bytes = float(np.mean([len(np.unique(p)) for p in plan])) * bank.expert_bytes
    fn.macs = T * 6 * 3 * bank.hidden * bank.inter                  # int8 products: gate/up H x 2I, down I x H
    return fn


def gbs(m: Measurement, nbytes: float) -> Measurement:
    return m.map(lambda s: nbytes / s / 1e9, "GB/s")


def row(**kw):
    for k, v in list(kw.items()):
        if isinstance(v, Measurement):
            kw[k] = round(v.median, 3)
            kw[k + "_min"], kw[k + "_max"] = round(v.min, 3), round(v.max, 3)
            kw[k + "_noisy"] = v.noisy
    return kw


def rounds_of(fns, rounds, steps):
    """Rounds of every fn(steps) in turn, the order reversed every other round (the machine drifts): per
    fn, its Measurement of each round, so a figure can be held against a limit timed in the same round."""
    out = [[] for _ in fns]
    for r in range(rounds):
        for i in (range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))):
            out[i].append(fns[i](steps))
    return out


def peak_at(t):
    """A round's products' peak at t threads (kernels/int8_peak.py): the compute limit of wide calls, taken
    beside the stream in every round, as a VM's clock moves too (the Zen 4 VM read 183-363 GMAC/s
    in one hour)."""
    return lambda n: measure_peak(MODE, t, seconds=0.1, repeats=2, lanes=bool(GROUP))


def stream_at(t, buf, note):
    """A round's stream read at t threads over the shared buffer (2 samples of every variant)."""
    return lambda n: dram_stream_read(t, repeats=2, buf=buf, note=note)


def pooled(ms) -> Measurement:
    """One Measurement of every round's samples."""
    return Measurement(tuple(x for m in ms for x in m.samples), ms[0].unit)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=list(range(1, usable_cores() + 1)))
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds, V4.1 geometry only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    steps, rounds = (8, 6) if args.quick else (args.steps, 12)
    rows, head = [], None
    print(f"ISA {ISA}, LLC {llc_bytes() / 2**20:.0f} MiB, threads {args.threads}; banks "
          + (f"in lanes as rows ({GROUP} rows a vector, kernels/fp4_lanes.py)" if GROUP else "with rows in order (the superblock kernel)"), flush=True)

    layouts, fetched, peak = {}, {}, None
    buf, buf_note = stream_buffer()                    # one buffer for every round's stream read (first touch once)
    for name, (H, I) in GEOMETRIES.items():
        if args.quick and name != "v4.1":
            continue
        try:
            bank = bank_for(H, I, batch=max(WIDTHS) if name == "v4.1" else 0)
        except ProbeTooLarge as e:
            print(f"{name:9s} not measured: {e}", flush=True)
            continue
        for t in args.threads:
            def kern(n, streams, t=t, **wide):
                numba.set_num_threads(t)
                step = decode_step(bank, streams=streams, **wide)
                m = measure(step, repeats=n, warmup=2)
                return gbs(m, step.bytes)
            # the profiler's verify for the layout (autotune/probes/cpu_moe.py row_streams): top-6 of 12 experts
            verify = {s_: dict(T=VERIFY_TOKENS, pool=12, inputs=max(ROW_INPUTS) if s_ == 1 else DEFAULT_INPUTS) for s_ in (4, 1)}
            # each layout with each fetching on the lanes paths (kernels/fp4_lanes.py FETCHES; rows in order fetch one way)
            fetches = FETCHES if GROUP else (DEFAULT_FETCH,)
            ks = [(s_, f) for f in fetches for s_ in (4, 1)]
            S, V4, V1, *KS = rounds_of([stream_at(t, buf, buf_note), lambda n: kern(n, 4, **verify[4]), lambda n: kern(n, 1, **verify[1])]
                                       + [lambda n, s_=s_, f=f: kern(n, s_, fetch=f) for s_, f in ks], rounds, steps)
            KS = dict(zip(ks, KS))
            s = pooled(S)
            # as the profiler picks: the layout at the default fetching (batch 1 and the verify), then the fetching
            best = pick_layout({s_: pooled(KS[(s_, DEFAULT_FETCH)]).samples for s_ in (4, 1)}, {4: pooled(V4).samples, 1: pooled(V1).samples})
            fetch = max(fetches, key=lambda f: pooled(KS[(best, f)]).median)
            layouts[(name, t)], fetched[(name, t)] = best, fetch
            K, O = KS[(best, fetch)], KS[(5 - best, fetch)]
            ratio, other_ratio = paired_ratio(K, S), paired_ratio(O, S)
            others = {f"fetch_{f}_ratio": paired_ratio(KS[(best, f)], S) for f in fetches if f != fetch}
            r = row(geometry=name, shape=f"{H}x{I}", tokens=1, threads=t, bank_gb=round(bank.n_experts * bank.expert_bytes / 1e9, 2),
                    kernel_gbs=pooled(K), stream_gbs=s, ratio=ratio, streams=best, fetch=fetch, other_layout_gbs=pooled(O),
                    other_layout_ratio=other_ratio, rounds=len(S), **others)
            rows.append(r)
            print(f"{name:9s} batch 1  threads {t}: kernel {r['kernel_gbs']:6.2f} GB/s  stream {r['stream_gbs']:6.2f}"
                  f"  ratio {r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f} over {len(S)} rounds)"
                  f"  (row streams {best}, fetching {fetch}, picked as the profiler picks; the other layout {r['other_layout_ratio']:.2f}"
                  + "".join(f", fetching {f} {r[f'fetch_{f}_ratio']:.2f}" for f in fetches if f != fetch) + ")", flush=True)
            if name == "v4.1" and t == max(args.threads):
                head = r
        if name == "v4.1":
            t = max(args.threads)
            numba.set_num_threads(t)
            peak = measure_peak(MODE, t, lanes=bool(GROUP)) if MODE else None     # the products' roof of wide calls (kernels/int8_peak.py)
            print(f"int8 products at the kernel's mix, {t} threads: {peak.median / 1e9:.0f} GMAC/s "
                  f"(spread {peak.min / 1e9:.0f}-{peak.max / 1e9:.0f}; measured again in every round of the widths, "
                  f"each width held against its rounds' own)" if peak else
                  "the scalar path has no int8 SIMD products: widths are shown against the stream only", flush=True)
            lay = layouts[(name, t)]
            choices = ROW_INPUTS if lay == 1 else (DEFAULT_INPUTS,)    # inputs per row decode: rows in order only
            for W in WIDTHS:
                for kind, what in (("verify", "verify: experts from a pool of 10"),
                                   ("batch", f"batch: independent tokens, top-6 of {ROUTED}")):
                    if kind == "batch" and bank.n_experts < W * 6:
                        print(f"{name:9s} width {W} batch : not measured, the bank of {bank.n_experts} experts (the probe "
                              f"memory budget) holds fewer than a batch's {W * 6} distinct ones", flush=True)
                        continue
                    wide = dict(pool=10) if kind == "verify" else dict(routed=ROUTED)
                    vers = {n: decode_step(bank, T=W, streams=lay, inputs=n, fetch=fetched[(name, t)], **wide) for n in choices}
                    limits = [stream_at(t, buf, buf_note)] + ([peak_at(t)] if peak else [])
                    S, *M = rounds_of(limits + [lambda k, v=v: gbs(measure(v, repeats=k, warmup=2), v.bytes) for v in vers.values()],
                                      rounds, max(4, steps // 2))
                    P, M = (M[0], M[1:]) if peak else (None, M)
                    ms = {n: pooled(m) for n, m in zip(choices, M)}
                    best = max(choices, key=lambda n: ms[n].median)
                    ver, K = vers[best], M[choices.index(best)]
                    r = row(geometry=name, shape=f"{H}x{I}", tokens=W, threads=t, kernel_gbs=ms[best], inputs=best,
                            stream_gbs=pooled(S), ratio=paired_ratio(K, S), kind=kind, note=f"{W}-token {what} (GB/s of distinct experts)",
                            **{f"inputs_{n}_gbs": ms[n] for n in choices if n != best})
                    roof = ""
                    if peak:                                  # GB/s of distinct bytes the products allow, each round's
                        cap = [p.median * ver.bytes / ver.macs / 1e9 for p in P]
                        lim = [Measurement((min(x.median, c),), "GB/s") for x, c in zip(S, cap)]
                        r.update(row(compute_roof_gbs=round(float(np.median(cap)), 3), roof_ratio=paired_ratio(K, lim),
                                     peak_gmacs=pooled(P).map(lambda v: v / 1e9, "GMAC/s")))
                        roof = f"  (products' roof {r['compute_roof_gbs']:.1f} GB/s; of min(stream, roof) {r['roof_ratio']:.2f})"
                    rows.append(r)
                    others = "".join(f"; {n}: {ms[n].median:.2f} GB/s" for n in choices if n != best)
                    print(f"{name:9s} width {W} {kind:6s} threads {t}: kernel {r['kernel_gbs']:6.2f} GB/s"
                          f"  ratio {r['ratio']:.2f}{roof}  [inputs per row decode {best}{others}]", flush=True)
            # naive baseline: torch dequantize to float then matmul, one token x 6 experts
            x = torch.randn(1, H)
            def naive(state={"i": 0}):
                for e in (np.arange(6) + 6 * state["i"]) % bank.n_experts:
                    w1, w3, w2 = bank.expert_weights(int(e), torch.float32)
                    (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
                state["i"] += 1
            torch.set_num_threads(t)
            m = measure(naive, repeats=max(3, steps // 4), warmup=1)
            r = row(geometry=name, shape=f"{H}x{I}", tokens=1, threads=t, kernel_gbs=gbs(m, 6 * bank.expert_bytes),
                    note="naive: torch dequantize to float32, then matmul")
            rows.append(r)
            print(f"{name:9s} naive    threads {t}: {r['kernel_gbs']:6.2f} GB/s", flush=True)
            # prefill widths: n tokens on one expert, GEMV kernel vs dense (dequantize + bf16 matmul)
            torch.set_num_threads(t)
            for n in ((16, 64) if args.quick else (1, 8, 16, 32, 64, 128, 256)):
                xs = np.random.default_rng(1).standard_normal((n, H)).astype(np.float32)
                ids = np.zeros((n, 1), np.int64)
                w = np.ones((n, 1), np.float32)
                flop = 2 * 3 * H * I * n
                fns = [(f"gemv{n}" if len(choices) > 1 else "gemv", lambda n=n: expert_ffn(xs, ids, w, bank, streams=lay, inputs=n))
                       for n in choices]
                for path, fn in fns + [("dense", lambda: expert_ffn_dense(xs, ids, w, bank))]:
                    m = measure(fn, repeats=max(3, steps // 4), warmup=1)
                    r = row(geometry=name, shape=f"{H}x{I}", tokens=n, threads=t, path=path,
                            kernel_gbs=gbs(m, bank.expert_bytes), gflops=m.map(lambda s: flop / s / 1e9, "GFLOP/s"),
                            note="prefill width: tokens on one expert")
                    rows.append(r)
                    print(f"{name:9s} prefill n={n:3d} {path:5s}: {r['gflops']:7.1f} GFLOP/s  {r['kernel_gbs']:6.2f} GB/s", flush=True)
            # dequantize alone (the dense path's first half)
            m = measure(lambda: dequant_experts(bank.w13_codes, bank.w13_scales, [3], bank.group), repeats=5, warmup=1)
            rows.append(row(geometry=name, shape=f"{H}x{I}", threads=t, path="dequant-w13",
                            kernel_gbs=gbs(m, bank.expert_bytes * 2 / 3), note="fp4 -> f32 tile, codes+scales read"))
        del bank
    head = head or next((r for r in rows if r.get("tokens") == 1 and "ratio" in r), None)   # V4.1's, else a smaller geometry's
    if head is None:
        print("no geometry's bank fits the probe memory budget: nothing measured", flush=True)
        out = {"isa": ISA, "bank_group": GROUP, "rows": rows}
    else:
        out = {"kernel_gbs": head["kernel_gbs"], "stream_gbs": head["stream_gbs"], "ratio": head["ratio"], "streams": head["streams"],
               "threads": head["threads"], "isa": ISA, "bank_group": GROUP, "rows": rows}
    if peak:
        out["int8_peak_gmacs"] = round(peak.median / 1e9, 1)
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
