"""Decode and prefill on the mini checkpoint beside their rooflines, measured in the same run.

  python benchmarks/decode_roofline.py [--checkpoint out/mini] [--prompt-tokens 256] [--max-tokens 24] [--rounds 3] [--json]

decode: plan `cpu`, all threads, the CPU-MoE row layout and inputs per row decode the tuner would pick
here (each timed on the checkpoint's bank; `--streams` and `--inputs` force one), warm: every expert read
once before the rounds (a server's steady state: on the AMX Xeon VM the first reads since the load ran ~0.7x
as fast as later ones), the stream read over one buffer touched once. Rooflines:
  roofline        = DRAM stream read (this run) / bytes per decoded token from the footprint
                    (routed experts K*L*expert + shared + dense/attention + head, as stored)
  kernel-bound    = 1 / sum over phases of (that phase's bytes per token / its kernel's GB/s), each
                    kernel measured standalone here from DRAM: the CPU-MoE kernel (6 fresh experts a
                    step, every layer's bank in turn), the shared expert through the same kernel, the
                    dense linears through the runtime's own kernels (the FP8 and BF16 kernels over the
                    weights as stored), over copies of them until the rotation spans 4x the total LLC
                    (within the probe budget; the note says when it does not): in the engine every
                    layer's MoE read evicts them, so a reference timed in cache would flatter the bound
  decode_kernel_ratio = measured / kernel-bound: what the runtime adds on top of its kernels
  moe_engine_vs_replay = the decode run's CPU-MoE calls replayed alone (the same banks, inputs and
                  order, right after the run) over their time inside the engine: 1.0 when the layers
                  around a call cost it nothing (cold caches, another thread pool); a ratio taken in one
                  process minutes apart at most, so this host's bandwidth phases move it less
  Each of --rounds rounds runs the engine, then measures its limits (the stream, the kernels), so a
  round's ratios divide by limits taken beside it (this host's bandwidth drifts between minutes); the
  medians are printed with their spread, every round kept in the JSON.
prefill: one chunk over the prompt; roofline = P / max(full-pass bytes / stream, P x (expert ops per token /
the host's int8 products peak + dense FLOP per token / its peak matmul FLOP/s)), both peaks measured in
this run and neither the project's kernel: the int8 peak is kernels/int8_peak.py's (the products the
CPU-MoE kernel runs, u8 x s8 into int32, at its instruction mix, all in L1: 2 ops a product), the matmul
peak the better of torch's float32 and bf16 2048^3 matmuls (the prefill's dense tiles run there; on the
scalar path, with no int8 SIMD, the experts are held to it too). Expert ops per token = routed and
shared experts (2 x 3 H I (K + shared) L), dense FLOP = 2 x the dense linears' weights; attention's
FLOP left out (the roofline is then an upper bound). An earlier form held the experts' int8 products to
the float matmul peak, a bound the run beat (1.13 on the Zen 4 VM). Also shown: the same bound at the
CPU-MoE kernel's own FLOP/s at the prompt's width. Both peaks and that rate are measured in every round
beside its prefill, the ratios are the rounds' own (medians printed): peaks taken once, after the rounds,
once met a phase of this VM's sharing that halved them, and the prefill "beat" its roofline (1.11).
The mini checkpoint is made (about 2 minutes) if absent.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402,F401  (before torch: it sets the process up for it, kernels/__init__.py)
import torch

from hostinfo import llc_bytes, probe_budget_bytes, usable_cores  # noqa: E402
from autotune.probes.cpu_moe import row_fetch, row_inputs, row_streams  # noqa: E402
from hostinfo.measure import measure  # noqa: E402
from kernels.stream import dram_stream_read, stream_buffer  # noqa: E402
from kernels.bf16_dense import Bf16Weight  # noqa: E402
from kernels.cpu_moe import GROUP, MODE, expert_ffn  # noqa: E402
from kernels.int8_peak import measure_peak  # noqa: E402
from kernels.fp8_dense import Fp8Weight  # noqa: E402
from runtime.checkpoint.reader import Checkpoint  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.model.weights import linear  # noqa: E402
from runtime.plan import Plan  # noqa: E402
from runtime.workload import make_prompt  # noqa: E402


class MoeCalls:
    """Every one-token CPU-MoE call the engine makes (bank, inputs, time), to replay alone."""

    def __init__(self, experts):
        self.calls, self._run = [], experts._run
        experts._run = self                                      # the instance's, not the class's

    def __call__(self, bank, x, ids, wts, key):
        t0 = time.perf_counter()
        y = self._run(bank, x, ids, wts, key)
        if len(x) == 1:
            self.calls.append((bank, x.copy(), ids.copy(), wts.copy(), time.perf_counter() - t0))
        return y

    def replay_ratio(self, threads, streams, inputs, fetch) -> float:
        """Replayed time / time in the engine (the plan's kernel choices), then forget the calls."""
        t0 = time.perf_counter()
        for bank, x, ids, wts, _ in self.calls:
            expert_ffn(x, ids, wts, bank, threads=threads, streams=streams, inputs=inputs, fetch=fetch)
        ratio = (time.perf_counter() - t0) / sum(c[-1] for c in self.calls)
        self.calls.clear()
        return ratio


def moe_ids(i: int, banks, K: int):
    """The MoE reference's step i: (bank, ids [1, K]): every bank in turn, K consecutive experts further on each
    time round the banks (wrapping), so its steps meet fresh experts until a bank's are all met."""
    bank = banks[i % len(banks)]
    return bank, ((np.arange(K) + K * (i // len(banks))) % bank.n_experts)[None]


def warm_steps(banks, K: int) -> int:
    """Steps of `moe_ids` from 0 that meet every expert of every bank at least once."""
    return len(banks) * max(math.ceil(b.n_experts / K) for b in banks)


MAX_COPIES = 64     # a working set that needs more (tiny's: ~0.2 MB) is call-bound, not read from DRAM


def rotation(nbytes: int) -> tuple[int, str]:
    """-> (copies, note): how many copies of an `nbytes` working set a rotation needs to span 4x the total
    LLC (each read then comes from DRAM), within the probe budget and MAX_COPIES; the note says when
    either keeps it under."""
    llc, cap = llc_bytes(), probe_budget_bytes()
    want = max(1, math.ceil(4 * llc / max(nbytes, 1)))
    fit = max(1, cap // max(nbytes, 1))
    copies = min(want, fit, MAX_COPIES)
    if copies >= want:
        return copies, ""
    why = (f"the probe memory budget ({cap / 2**20:.0f} MiB)" if fit < min(want, MAX_COPIES)
           else f"at most {MAX_COPIES} copies")
    return copies, (f"the dense reference rotates over {copies * nbytes / 2**20:.0f} MiB: {why} keeps it under 4x the "
                    f"total last-level cache ({llc / 2**20:.0f} MiB), so part of it is cache")


def held_copy(w):
    """A fresh copy of a weight as load_dense holds it (FP8 or BF16 as stored, or a tensor)."""
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.q.copy(), w.scale.copy(), w.block)
    if isinstance(w, Bf16Weight):
        return Bf16Weight(w.bits.copy())
    return w.clone()


def matmul_peak_flops(threads: int, n: int = 2048) -> float:
    """The host's peak matmul FLOP/s: the better of torch's float32 and bf16 n^3 matmuls (median of 5),
    a dtype under a quarter of the other's rate at 512^3 left out."""
    torch.set_num_threads(threads)
    best = 0.0
    small = {}
    for dt in (torch.float32, torch.bfloat16):        # a 512^3 look first: without native bf16 (Zen 2:
        a, b = torch.randn(512, 512, dtype=dt), torch.randn(512, 512, dtype=dt)   # ~1 GFLOP/s, ~25 s a
        small[dt] = 2 * 512 ** 3 / measure(lambda: a @ b, repeats=3, warmup=1).median   # 2048^3 call) it is
    for dt in (torch.float32, torch.bfloat16):                                           # not the peak
        if small[dt] < max(small.values()) / 4:
            continue
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        best = max(best, 2 * n ** 3 / measure(lambda: a @ b, repeats=5, warmup=1).median)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="out/mini")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--streams", default="measured", choices=["measured", "1", "4"],
                    help="the CPU-MoE row layout (Plan.cpu_moe_streams); measured: the faster here, as the tuner picks it")
    ap.add_argument("--inputs", default="measured", choices=["measured", "4", "8"],
                    help="the CPU-MoE inputs per row decode (Plan.cpu_moe_inputs; rows in order only); measured: as the tuner picks it")
    ap.add_argument("--fetch", default="measured", choices=["measured", "far", "near"],
                    help="how one input's CPU-MoE calls fetch weights (Plan.cpu_moe_fetch); measured: as the tuner picks it")
    ap.add_argument("--rounds", type=int, default=3, help="engine runs, each followed by its limits (stream, kernels)")
    ap.add_argument("--unfused", action="store_true",
                    help="decode layers without the fused calls (runtime/model/decode.py): what they save, measured")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.max_tokens < 2:
        ap.error(f"--max-tokens {args.max_tokens}: at least 2 (the first token comes from the prefill; decode is measured after it)")
    if args.inputs == "8" and args.streams == "4":
        ap.error("--inputs 8 needs rows in order (--streams 1 or measured): four rows apart always decode for 4 inputs")
    if not (Path(args.checkpoint) / "model.safetensors.index.json").exists():
        subprocess.run([sys.executable, "-m", "runtime.cli.checkpoint", "make", "--preset", "mini", "--out", args.checkpoint], check=True)
    ck = Checkpoint(args.checkpoint)
    cfg, fp = ck.config, ck.footprint()
    T = args.threads
    numba.set_num_threads(T)
    torch.set_num_threads(T)
    from tokenizers import Tokenizer
    prompt = make_prompt(Tokenizer.from_file(str(ck.root / "tokenizer.json")), args.prompt_tokens, seed=0)
    plan = Plan(moe_strategy="cpu", cpu_threads=T, prefill_chunk=args.prompt_tokens, max_context=args.prompt_tokens + args.max_tokens + 8)
    engine = Engine(ck, plan)
    if args.streams == "measured":                               # the layout the tuner would put in the plan here
        streams, by, wide = row_streams(engine.experts.host[0], T, cfg.num_experts_per_tok)
        print("row layout (batch 1; verify of 8): " + ", ".join(f"{k} stream(s) {v.median:.1f}; {wide[k].median:.1f} GB/s"
                                                              for k, v in by.items()) + f" -> {streams}")
    else:
        streams = int(args.streams)
    inputs = int(args.inputs) if args.inputs != "measured" else plan.cpu_moe_inputs
    if streams != 1 and inputs != plan.cpu_moe_inputs:           # measured 4 rows apart: 4 inputs a decode (Plan)
        print(f"--inputs {inputs} not used: four rows apart measured faster here, and they decode for {plan.cpu_moe_inputs}")
        inputs = plan.cpu_moe_inputs
    if args.inputs == "measured" and streams == 1:
        inputs, by = row_inputs(engine.experts.host[0], T, cfg.num_experts_per_tok)
        print("inputs per row decode (8-token verify): " + ", ".join(f"{k}: {v.median:.1f} GB/s" for k, v in by.items()) + f" -> {inputs}")
    fetch = args.fetch if args.fetch != "measured" else plan.cpu_moe_fetch
    if args.fetch == "measured":
        best, by = row_fetch(engine.experts.host[0], T, cfg.num_experts_per_tok, streams)
        if best is not None:
            fetch = best
            print("one input's fetching (batch 1): " + ", ".join(f"{k}: {v.median:.1f} GB/s" for k, v in by.items()) + f" -> {fetch}")
    if (streams, inputs, fetch) != (plan.cpu_moe_streams, plan.cpu_moe_inputs, plan.cpu_moe_fetch):
        engine.close()
        plan = plan.replace(cpu_moe_streams=streams, cpu_moe_inputs=inputs, cpu_moe_fetch=fetch)
        engine = Engine(ck, plan)
    engine.model.fuse_decode = not args.unfused
    engine.generate(prompt, 4)                                   # warm: compile, page in
    # --- standalone kernels, interleaved with the engine's runs: round i's ratios divide by round i's limits
    banks = [b for b in engine.experts.host if b is not None]   # every layer's bank in turn: fresh experts
    step = {"i": 0, "dense": 0}
    x = np.random.default_rng(0).standard_normal((1, cfg.hidden_size)).astype(np.float32)
    K = cfg.num_experts_per_tok

    def moe_step():
        i = step["i"]
        step["i"] += 1
        bank, ids = moe_ids(i, banks, K)
        expert_ffn(x, ids, np.ones_like(ids, dtype=np.float32), bank, threads=T, streams=streams, inputs=inputs, fetch=fetch)
    dense = [w for n, w in engine.model.w.items()                # what a decoded token multiplies (not the drafter)
             if len(w.shape) == 2 and n != "embed.weight" and not n.startswith("mtp.") and ".tid2eid" not in n]
    dense_bytes_rt = sum(w.nbytes for w in dense)                # as held: fp8 and BF16 as stored, the rest float32
    xs = [torch.randn(1, w.shape[1]) for w in dense]
    copies, ref_note = rotation(dense_bytes_rt)
    dense_sets = [dense] + [[held_copy(w) for w in dense] for _ in range(copies - 1)]
    moe_span = sum(b.n_experts * b.expert_bytes for b in banks)
    if moe_span < 4 * llc_bytes():
        ref_note += (" " if ref_note else "") + (f"the MoE reference rotates over {moe_span / 2**20:.0f} MiB of banks, under 4x "
                                               f"the total last-level cache ({llc_bytes() / 2**20:.0f} MiB): part of it is cache")
    print(f"reference from DRAM: MoE steps over {len(banks)} banks ({moe_span / 2**20:.0f} MiB), the dense linears over {copies} "
          f"cop{'y' if copies == 1 else 'ies'} ({copies * dense_bytes_rt / 2**20:.0f} MiB); LLC {llc_bytes() / 2**20:.0f} MiB"
          + (f"; note: {ref_note}" if ref_note else ""))

    def dense_pass():
        ws = dense_sets[step["dense"] % len(dense_sets)]
        step["dense"] += 1
        return [linear(xx, w) for xx, w in zip(xs, ws)]
    routed_b, shared_b = fp.routed_bytes_per_decode_token, fp.bytes_by_class["shared_expert"]
    bytes_tok = fp.routed_bytes_per_decode_token + fp.dense_bytes_per_token
    # prefill roofline: one pass over every expert (all touched at this width), FLOP at the peaks measured in the round
    n = max(1, args.prompt_tokens * K // cfg.n_routed_experts)
    xp = np.random.default_rng(1).standard_normal((n, cfg.hidden_size)).astype(np.float32)
    P, L = args.prompt_tokens, cfg.num_hidden_layers
    t_bytes = lambda gbs: (fp.full_pass_bytes + fp.dense_bytes_per_token) / (gbs * 1e9)   # noqa: E731
    routed_flop = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * (K + cfg.n_shared_experts) * L   # routed + shared experts
    dense_flop = 2 * sum(w.shape[0] * w.shape[1] for w in dense)

    def prefill_limits(prefill_tok_s, stream_gbs):
        """This round's prefill roofs: the host's peaks (int8 products, matmul) and the CPU-MoE kernel's FLOP/s
        at the prompt's width, measured now (a peak taken minutes away met another phase of this VM's sharing:
        one run's int8 peak came out at half, and the prefill 'beat' its roofline)."""
        mp = measure(lambda: expert_ffn(xp, np.zeros((n, 1), np.int64), np.ones((n, 1), np.float32), banks[1 % len(banks)],
                                        threads=T, streams=streams, inputs=inputs, fetch=fetch), repeats=5, warmup=1)
        flops = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * n / mp.median
        peak = matmul_peak_flops(T)
        int8_ops = 2 * measure_peak(MODE, T, lanes=bool(GROUP)).median if MODE else peak   # ops/s: 2 a product
        t_flop = P * (routed_flop / int8_ops + dense_flop / peak)
        roof = P / max(t_bytes(stream_gbs), t_flop)
        kroof = P / max(t_bytes(stream_gbs), P * routed_flop / flops + P * dense_flop / peak)
        return {"prefill_roofline_tok_s": roof, "prefill_ratio": prefill_tok_s / roof, "prefill_kernel_roofline_tok_s": kroof,
                "prefill_kernel_ratio": prefill_tok_s / kroof, "matmul_peak_gflops": peak / 1e9, "int8_peak_gops": int8_ops / 1e9,
                "cpu_moe_prefill_gflops": flops / 1e9, "prefill_bound": "flop" if t_flop > t_bytes(stream_gbs) else "bytes"}
    rounds = []
    # Every expert read once before the rounds, and one stream buffer for all of them (touched once). On the AMX
    # Xeon VM the first reads of the engine's banks since the load ran ~0.7x as fast as any later read (three
    # experiments: the first pass over every bank's experts 14-19 GB/s, then 25-27), and the reference's steps,
    # 14 a round, never left that first pass: it read 13.6-14.8 GB/s where the engine's calls ran ~24, so the run
    # "beat" its kernel-bound rate 1.39-1.59x (kernels/lab/README.md). In the engine the rounds' calls are mostly
    # later reads (the warm-up and the earlier rounds meet most experts), so the reference reads later ones too.
    for _ in range(warm_steps(banks, K)):
        moe_step()
    buf, buf_note = stream_buffer()
    calls = MoeCalls(engine.experts)
    for _ in range(args.rounds):
        calls.calls.clear()                                      # this round's decode only
        r = engine.generate(prompt, args.max_tokens)
        replay = calls.replay_ratio(T, streams, inputs, fetch)
        stream = dram_stream_read(T, repeats=3, buf=buf, note=buf_note)
        m = measure(moe_step, repeats=12, warmup=2)
        md = measure(dense_pass, repeats=max(10, 2 * len(dense_sets)), warmup=len(dense_sets))
        kernel_gbs = cfg.num_experts_per_tok * fp.expert_bytes / m.median / 1e9
        dense_gbs = dense_bytes_rt / md.median / 1e9
        t_kernel = routed_b / (kernel_gbs * 1e9) + shared_b / (kernel_gbs * 1e9) + dense_bytes_rt / (dense_gbs * 1e9)
        roof = stream.median * 1e9 / bytes_tok
        pre = prefill_limits(r.prefill_tok_s, stream.median)
        rounds.append({**pre, "decode_tok_s": r.decode_tok_s, "prefill_tok_s": r.prefill_tok_s, "stream_gbs": stream.median,
                       "moe_engine_vs_replay": replay,
                       "cpu_moe_kernel_gbs": kernel_gbs, "dense_gemv_gbs": dense_gbs, "decode_roofline_tok_s": roof,
                       "decode_kernel_bound_tok_s": 1 / t_kernel, "decode_ratio": r.decode_tok_s / roof,
                       "decode_kernel_ratio": r.decode_tok_s * t_kernel, "phases": r.phases})
    med = lambda k: float(np.median([rd[k] for rd in rounds]))   # noqa: E731
    decode, prefill, roof, kernel_gbs, dense_gbs = (med(k) for k in ("decode_tok_s", "prefill_tok_s", "decode_roofline_tok_s",
                                                                    "cpu_moe_kernel_gbs", "dense_gemv_gbs"))
    stream_gbs = med("stream_gbs")
    t_kernel = 1 / med("decode_kernel_bound_tok_s")
    last = rounds[-1]["phases"]
    prefill_roof, kernel_roof = med("prefill_roofline_tok_s"), med("prefill_kernel_roofline_tok_s")
    out = {"decode_tok_s": decode, "decode_roofline_tok_s": roof, "decode_ratio": med("decode_ratio"),
           "decode_kernel_bound_tok_s": 1 / t_kernel, "decode_kernel_ratio": med("decode_kernel_ratio"),
           "moe_engine_vs_replay": med("moe_engine_vs_replay"),
           "prefill_tok_s": prefill, "prefill_roofline_tok_s": prefill_roof, "prefill_ratio": med("prefill_ratio"),
           "matmul_peak_gflops": med("matmul_peak_gflops"), "int8_peak_gops": med("int8_peak_gops"),
           "cpu_moe_prefill_gflops": med("cpu_moe_prefill_gflops"), "prefill_kernel_roofline_tok_s": kernel_roof,
           "prefill_kernel_ratio": med("prefill_kernel_ratio"),
           "stream_gbs": stream_gbs, "cpu_moe_kernel_gbs": kernel_gbs, "dense_gemv_gbs": dense_gbs,
           "bytes_per_token_footprint": bytes_tok, "dense_bytes_runtime": dense_bytes_rt, "cpu_moe_streams": streams,
           "cpu_moe_inputs": inputs, "cpu_moe_fetch": fetch,
           "reference": {"moe_banks": len(banks), "moe_rotation_bytes": moe_span, "dense_copies": copies,
                         "dense_rotation_bytes": copies * dense_bytes_rt, "llc_bytes": llc_bytes(), "note": ref_note},
           "prefill_bound": max(("flop", "bytes"), key=[rd["prefill_bound"] for rd in rounds].count),   # most rounds'
           "threads": T, "fused_decode": not args.unfused,
           "phases_per_token_s": {k: v / (args.max_tokens - 1) for k, v in last.items() if not k.endswith("_us")},
           "outside_phases_per_layer_us": last["outside_phases_per_layer_us"],
           "rounds": [{k: v for k, v in rd.items() if k != "phases"} for rd in rounds]}
    spread = lambda k: f"{min(rd[k] for rd in rounds):.2f}-{max(rd[k] for rd in rounds):.2f}"   # noqa: E731
    print(f"decode  {decode:6.2f} tok/s | roofline {roof:6.2f} (stream {stream_gbs:.1f} GB/s / {bytes_tok / 1e9:.3f} GB) "
          f"ratio {out['decode_ratio']:.2f} ({spread('decode_ratio')}) | kernel-bound {1 / t_kernel:6.2f} "
          f"ratio {out['decode_kernel_ratio']:.2f} ({spread('decode_kernel_ratio')}) | medians of {len(rounds)} interleaved rounds")
    print(f"the decode run's CPU-MoE calls inside the engine ran at {out['moe_engine_vs_replay']:.2f} "
          f"({spread('moe_engine_vs_replay')}) of their speed replayed alone")
    if out["decode_kernel_ratio"] > 1.1:         # the AMX Xeon VM's 1.39-1.59 before the warm pass above
        out["reference"]["above"] = (f"the engine ran {out['decode_kernel_ratio']:.2f}x the kernel-bound rate: its reference read "
                                     f"the experts at {out['cpu_moe_kernel_gbs']:.1f} GB/s, below the engine's own calls (replayed "
                                     "alone above); the replay ratio is the comparison of the engine with its kernels here")
        print("note: " + out["reference"]["above"])
    print(f"prefill {prefill:6.1f} tok/s | roofline {prefill_roof:6.1f} ({out['prefill_bound']}-bound: experts at the int8 "
          f"products' peak {out['int8_peak_gops']:.0f} GOP/s, dense at the peak matmul {out['matmul_peak_gflops']:.0f} GFLOP/s) "
          f"ratio {out['prefill_ratio']:.2f} ({spread('prefill_ratio')}) | at the CPU-MoE kernel's {out['cpu_moe_prefill_gflops']:.0f} GFLOP/s: "
          f"{kernel_roof:6.1f}, ratio {out['prefill_kernel_ratio']:.2f} ({spread('prefill_kernel_ratio')}); medians of the rounds' own")
    print("per-token phases (s): " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(out["phases_per_token_s"].items()))
          + f"; outside every phase {out['outside_phases_per_layer_us']:.0f} us per layer")
    engine.close()
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
