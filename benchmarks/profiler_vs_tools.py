"""The profiler's probes beside public tools, on this machine, in one run.

  python benchmarks/profiler_vs_tools.py [--depths 1 2 4 8 16 32 64] [--seconds 3] [--json]

NVMe: the profiler's random 4 KiB O_DIRECT probe (the runtime's BatchedReader, each engine the kernel
opens; its figure is the fastest engine's, the one the plan's `engram_io_engine` then runs) against fio
on the same file at the same depths: `--ioengine=libaio --iodepth=D`, `--ioengine=io_uring --iodepth=D` and
`--ioengine=psync --numjobs=D` (D reads in flight), interleaved over `--nvme-rounds` rounds; the ratio
is of medians, to the best engine. DRAM: the
profiler's stream probe against a compiled C/OpenMP read reduction over the same buffer size
(benchmarks/ref/stream_read.c, built here with gcc) and likwid-bench's read kernels (`load`: one stream
per thread, `ddot`: two; every width it has, on the same thread count and size; and `read2` / `read4`: two /
four, loads only, test files of ours, benchmarks/ref/likwid/, run in likwid-bench's harness) where
installed, all interleaved over `--rounds` rounds.
One rule on every side: each variant's samples pooled over the rounds (the probe's sub-streams per
thread x load widths, the C reference's 1, 2 and 4 sub-streams per thread, likwid's kernels), the
variant with the best median compared (a best-of per sample would lift the noisier side); the ratio
is the median of the rounds' ratios (each round's probe median over the reference's median in that
round), with their spread.
Goals (issue "speed on every ISA"): NVMe >= 0.90 of the better fio engine at every depth, DRAM within
10% of both references. fio and likwid come from Debian (`apt-get install fio likwid`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402

from hostinfo import usable_cores  # noqa: E402
from autotune.probes import nvme  # noqa: E402
from kernels.stream import dram_stream_read, stream_buffer  # noqa: E402


def fio(path, engine, depth, seconds):
    jobs = depth if engine == "psync" else 1
    cmd = ["fio", "--name=p", f"--filename={path}", "--direct=1", "--rw=randread", "--bs=4k", f"--ioengine={engine}",
           f"--iodepth={1 if engine == 'psync' else depth}", f"--numjobs={jobs}", f"--runtime={seconds}", "--time_based",
           "--group_reporting", "--output-format=json"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return out["jobs"][0]["read"]["iops"]


LIKWID_OWN = Path(__file__).parent / "ref" / "likwid"   # read kernels of two and four streams a thread (.ptt)
LIKWID_KERNELS = ("load_avx512", "load_avx", "load", "ddot_avx512", "ddot_avx", "ddot", "read2_avx512", "read2_avx",
                  "read4_avx512", "read4_avx")


def likwid(threads, nbytes):
    """-> {kernel: GB/s} for likwid-bench's read kernels on `threads` threads over `nbytes` (those that run
    here): `load*` read one stream per thread, `ddot*` (a dot product of two vectors: loads only) two, and
    `read2*` and `read4*`, this repository's (benchmarks/ref/likwid/*.ptt: likwid-bench compiles a test file
    it finds under $HOME/.likwid/bench/x86-64 and runs it in its own harness: its threads, pinning,
    allocation and timer), two and four with nothing but loads: the probe's layouts (the best on the AMX
    Xeon VM and on the Zen 2 VM), which likwid ships no pure-load kernel for. Which reads DRAM faster is
    a fact of the host (the probe tries 1, 2 and 4 sub-streams per thread too)."""
    out = {}
    with tempfile.TemporaryDirectory() as home:
        own = Path(home) / ".likwid" / "bench" / "x86-64"
        own.mkdir(parents=True)
        for f in LIKWID_OWN.glob("*.ptt"):
            shutil.copy(f, own / f.name)
        env = dict(os.environ, HOME=home)
        for kernel in LIKWID_KERNELS:
            r = subprocess.run(["likwid-bench", "-t", kernel, "-w", f"N:{nbytes // 2**20}MB:{threads}"],
                               capture_output=True, text=True, env=env, cwd=home)
            rates = [float(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("MByte/s")]
            if r.returncode == 0 and rates:
                out[kernel] = rates[0] / 1e3
    return out


def dram_vs_tools(threads, rounds):
    """Probe, C reference and likwid-bench in turn, `rounds` times; medians and ratios."""
    buf, note = stream_buffer()                        # the profiler's buffer (a budget-capped one keeps its note)
    nbytes = buf.nbytes
    if note:
        print(f"note: {note}")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "stream_read"
        src = Path(__file__).parent / "ref" / "stream_read.c"
        if subprocess.run(["gcc", "-O3", "-march=native", "-ffast-math", "-fopenmp", str(src), "-o", str(exe)],
                          capture_output=True).returncode != 0:
            print("gcc with OpenMP unavailable: DRAM comparison skipped")
            return None
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="spread")
        has_likwid = shutil.which("likwid-bench") is not None
        if not has_likwid:
            print("likwid-bench is not installed (apt-get install likwid): compared with the C reference only")
        probe_by, cref_by, lk_by = {}, {}, {}         # variant -> one list of samples per round
        for _ in range(rounds):
            m = dram_stream_read(threads, repeats=2, buf=buf, note=note)
            for layout, v in m.extra["layout_samples_gbs"].items():
                probe_by.setdefault(layout, []).append(v)
            out = subprocess.run([str(exe), str(nbytes), "2"], capture_output=True, text=True, env=env, check=True).stdout
            by_round = {}
            for line in out.splitlines():
                layout, gbs = line.split()
                by_round.setdefault(layout, []).append(float(gbs))
            for layout, v in by_round.items():
                cref_by.setdefault(layout, []).append(v)
            if has_likwid:
                for kernel, gbs in likwid(threads, nbytes).items():
                    lk_by.setdefault(kernel, []).append([gbs])
    med = lambda v: float(np.median(v)) if len(v) else float("nan")  # noqa: E731
    pooled = lambda rs: [x for r in rs for x in r]  # noqa: E731
    # one rule on every side: each variant's samples pooled over the rounds, the variant with the best
    # median (the probe's and the C reference's layout, likwid's kernel); a best-of per sample or per
    # round would be biased upwards by the noise. The ratio is the median of per-round ratios: this
    # VM's DRAM moves 30-50 GB/s in phases of seconds to minutes, which a ratio of medians keeps.
    best = lambda by: max(by, key=lambda k: med(pooled(by[k])), default=None)  # noqa: E731
    p_layout, c_layout, lk_kernel = best(probe_by), best(cref_by), best(lk_by)
    p_rounds = probe_by[p_layout]

    def paired(rounds_other):
        rs = [med(p) / med(o) for p, o in zip(p_rounds, rounds_other) if len(p) and len(o)]
        return {"median": med(rs), "min": min(rs), "max": max(rs), "per_round": [round(r, 3) for r in rs]} if rs else None
    probe, cref = pooled(p_rounds), pooled(cref_by[c_layout])
    lk = pooled(lk_by[lk_kernel]) if lk_kernel else []
    r_c, r_lk = paired(cref_by[c_layout]), (paired(lk_by[lk_kernel]) if lk_kernel else None)
    dram = {"threads": threads, "buffer_bytes": nbytes, "probe_gbs": probe, "c_reference_gbs": cref, "likwid_gbs": lk,
            "likwid_kernel": lk_kernel, "likwid_gbs_by_kernel": lk_by,
            "probe_layout": p_layout, "c_reference_layout": c_layout, "probe_gbs_by_layout": probe_by,
            "c_reference_gbs_by_layout": cref_by, "probe_median": med(probe),
            "c_reference_median": med(cref), "likwid_median": med(lk),
            "ratio_c_reference": r_c and r_c["median"], "ratio_likwid": r_lk and r_lk["median"],
            "ratio_c_reference_rounds": r_c, "ratio_likwid_rounds": r_lk}
    for name, by in (("probe", probe_by), ("C/OpenMP", cref_by)):
        print(f"  {name} medians by variant (sub-streams per thread[ x load width]): "
              + ", ".join(f"{k}: {med(pooled(v)):.1f}" for k, v in by.items()))
    spread = lambda r: f"per-round ratios {r['min']:.2f}-{r['max']:.2f}"  # noqa: E731
    print(f"DRAM stream read, {threads} threads, {nbytes / 2**30:.1f} GiB, {rounds} rounds: probe {dram['probe_median']:.2f} GB/s "
          f"({p_layout}: sub-streams per thread x load width); C/OpenMP {dram['c_reference_median']:.2f} ({c_layout} "
          f"sub-stream(s) per thread): "
          f"ratio {r_c['median']:.2f} ({spread(r_c)})" + (f"; likwid-bench {dram['likwid_median']:.2f} ({lk_kernel}): ratio "
          f"{r_lk['median']:.2f} ({spread(r_lk)}; medians by kernel: " + ", ".join(f"{k} {med(pooled(v)):.1f}" for k, v in lk_by.items())
          + ")" if r_lk else ""))
    return dram


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=list(nvme.DEPTHS))
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--dir", default=".", help="directory on the filesystem to probe (a 1 GiB scratch file)")
    ap.add_argument("--rounds", type=int, default=5, help="DRAM: interleaved rounds of probe, C reference, likwid")
    ap.add_argument("--nvme-rounds", type=int, default=3, help="NVMe: interleaved rounds of probe and fio per depth (medians)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    path, scratch = nvme.probe_file(None, Path(args.dir))
    try:
        if shutil.which("fio") is None:
            print("fio is not installed (apt-get install fio): NVMe comparison skipped")
        else:
            print(f"{'QD':>3} {'probe IOPS':>11} {'fio libaio':>11} {'io_uring':>9} {'psync':>9}  probe/best")
            engines, ours_engines = ("libaio", "io_uring", "psync"), nvme.engines_here(path)[0]
            for d in args.depths:
                runs = {"probe": [], "probe_engine": [], **{e: [] for e in engines}}
                for _ in range(args.nvme_rounds):          # interleaved: probe and every engine in each round
                    p = nvme.randread_4k(path, d, max(4000, 8000 * min(d, 8)), engines=ours_engines)
                    runs["probe"].append(p["iops"])
                    runs["probe_engine"].append(p["engine"])
                    for e in engines:
                        runs[e].append(fio(path, e, d, args.seconds))
                med = {k: float(np.median(v)) for k, v in runs.items() if k != "probe_engine"}
                ours, ref = med["probe"], {e: med[e] for e in engines}
                best = max(ref, key=ref.get)
                r = {"qd": d, "probe_iops": ours, **{f"fio_{e}_iops": v for e, v in ref.items()},
                     "best_engine": best, "ratio_best": ours / ref[best], "samples": runs}
                rows.append(r)
                print(f"{d:>3} {ours:>11,.0f} {ref['libaio']:>11,.0f} {ref['io_uring']:>9,.0f} {ref['psync']:>9,.0f}"
                      f"  {r['ratio_best']:>9.2f} ({best}; ours: {'/'.join(runs['probe_engine'])})")
    finally:
        if scratch:
            path.unlink(missing_ok=True)
    dram = dram_vs_tools(usable_cores(), args.rounds)
    if args.json:
        print(json.dumps({"nvme": rows, "dram": dram}))


if __name__ == "__main__":
    main()
