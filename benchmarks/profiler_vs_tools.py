"""The profiler's probes beside public tools, on this machine, in one run.

  python benchmarks/profiler_vs_tools.py [--depths 1 2 4 8 16 32 64] [--seconds 3] [--json]

NVMe: the profiler's random 4 KiB O_DIRECT probe (the runtime's BatchedReader) against fio on the same
file at the same depths: `--ioengine=libaio --iodepth=D` and `--ioengine=psync --numjobs=D` are the
like-for-like references (D reads in flight), io_uring is printed beside. DRAM: the profiler's stream
probe against a compiled C/OpenMP read reduction over the same buffer size (benchmarks/ref/stream_read.c,
built here with gcc). Each line prints the ratio probe / reference. Goals: within 15% of fio at every
depth, within 10% of the reference for DRAM. fio comes from Debian (`apt-get install fio`).
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
from hostinfo import usable_cores  # noqa: E402
from autotune.probes import nvme  # noqa: E402
from kernels.stream import dram_stream_read, stream_buffer_bytes  # noqa: E402


def fio(path, engine, depth, seconds):
    jobs = depth if engine == "psync" else 1
    cmd = ["fio", "--name=p", f"--filename={path}", "--direct=1", "--rw=randread", "--bs=4k", f"--ioengine={engine}",
           f"--iodepth={1 if engine == 'psync' else depth}", f"--numjobs={jobs}", f"--runtime={seconds}", "--time_based",
           "--group_reporting", "--output-format=json"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return out["jobs"][0]["read"]["iops"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=list(nvme.DEPTHS))
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--dir", default=".", help="directory on the filesystem to probe (a 1 GiB scratch file)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    path, scratch = nvme.probe_file(None, Path(args.dir))
    try:
        if shutil.which("fio") is None:
            print("fio is not installed (apt-get install fio): NVMe comparison skipped")
        else:
            print(f"{'QD':>3} {'probe IOPS':>11} {'fio libaio':>11} {'fio psync':>10} {'io_uring':>9}  probe/libaio  probe/psync")
            for d in args.depths:
                ours = nvme.randread_4k(path, d, max(4000, 8000 * min(d, 8)))["iops"]
                ref = {e: fio(path, e, d, args.seconds) for e in ("libaio", "psync", "io_uring")}
                r = {"qd": d, "probe_iops": ours, **{f"fio_{e}_iops": v for e, v in ref.items()},
                     "ratio_libaio": ours / ref["libaio"], "ratio_psync": ours / ref["psync"]}
                rows.append(r)
                print(f"{d:>3} {ours:>11,.0f} {ref['libaio']:>11,.0f} {ref['psync']:>10,.0f} {ref['io_uring']:>9,.0f}"
                      f"  {r['ratio_libaio']:>11.2f}  {r['ratio_psync']:>11.2f}")
    finally:
        if scratch:
            path.unlink(missing_ok=True)
    (nbytes, _), threads = stream_buffer_bytes(), usable_cores()
    dram = None
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "stream_read"
        src = Path(__file__).parent / "ref" / "stream_read.c"
        ok = subprocess.run(["gcc", "-O3", "-march=native", "-ffast-math", "-fopenmp", str(src), "-o", str(exe)],
                            capture_output=True).returncode == 0
        if ok:
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="spread")
            lines = subprocess.run([str(exe), str(nbytes), "7"], capture_output=True, text=True, env=env, check=True).stdout.split("\n")
            ref = {k: sorted(float(line.split()[1]) for line in lines if line.startswith(k)) for k in ("one", "four")}
            best = max(ref["one"][-1], ref["four"][-1])
            probe = dram_stream_read(threads, nbytes)
            dram = {"probe_gbs": probe.median, "probe_max_gbs": probe.max, "reference_one_stream_best": ref["one"][-1],
                    "reference_four_streams_best": ref["four"][-1], "ratio": probe.median / best}
            print(f"DRAM stream read, {threads} threads, {nbytes / 2**30:.1f} GiB: probe {probe.median:.2f} GB/s (max {probe.max:.2f}); "
                  f"C/OpenMP best-of-7: one stream/thread {ref['one'][-1]:.2f}, four streams/thread {ref['four'][-1]:.2f} GB/s; "
                  f"ratio to the better {dram['ratio']:.2f}")
        else:
            print("gcc with OpenMP unavailable: DRAM comparison skipped")
    if args.json:
        print(json.dumps({"nvme": rows, "dram": dram}))


if __name__ == "__main__":
    main()
