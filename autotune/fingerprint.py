"""The host fingerprint: hard fields (a mismatch refuses the profile's plan here) and soft fields
(a mismatch warns). Paths are recorded relative to the checkpoint or by role, never absolute."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import psutil

from autotune.host import llc_bytes, physical_cores

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


def _cpu_model_and_flags():
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "", platform.processor()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return model, [f for f in ISA_FLAGS if f in flags]


def _gpu():
    try:
        import torch
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            link = ""
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=pcie.link.gen.current,pcie.link.width.current",
                                      "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
                gen, width = [s.strip() for s in out.split(",")]
                link = f"{gen}.0 x{width}"
            except Exception:
                link = "unknown"
            return p.name, round(p.total_memory / 2**30, 2), link
    except Exception:
        pass
    return "", 0.0, ""


def _storage(path: Path) -> dict:
    """Block device and filesystem holding `path` (from /proc/mounts, longest matching mount point)."""
    path = path.resolve()
    best = ("", "", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fs = line.split()[:3]
            if str(path).startswith(mnt) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fs)
    except OSError:
        pass
    return {"block_device": os.path.basename(best[0]), "filesystem": best[2]}


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def fingerprint(checkpoint_dir: Path, geometry_hash: str) -> dict:
    import numba
    import numpy
    import torch
    model, isa = _cpu_model_and_flags()
    gpu, vram, link = _gpu()
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    return {
        "name": platform.node() or "host",
        "hard": {"cpu_model": model, "isa": isa, "physical_cores": physical_cores(), "numa_nodes": nodes,
                 "ram_gib": round(psutil.virtual_memory().total / 2**30, 1), "gpu_name": gpu, "gpu_vram_gib": vram,
                 "pcie_link": link, "llc_mib": round(llc_bytes() / 2**20)},
        "soft": {"commit": _commit(), "kernel": platform.release(),
                 "versions": {"python": platform.python_version(), "torch": torch.__version__, "numba": numba.__version__,
                              "numpy": numpy.__version__, "dsv41": "0.1.0"},
                 "storage": _storage(checkpoint_dir), "geometry_hash": geometry_hash},
    }


def compare(profile_host: dict, here: dict) -> tuple[list[str], list[str]]:
    """-> (hard differences, soft differences), each as 'field: profile vs here'."""
    hard = [f"{k}: {profile_host['hard'].get(k)!r} vs {v!r}" for k, v in here["hard"].items()
            if k != "llc_mib" and profile_host["hard"].get(k) != v]
    ps, hs = profile_host.get("soft", {}), here["soft"]
    soft = [f"{k}: {ps.get(k)!r} vs {hs[k]!r}" for k in ("commit", "kernel", "versions") if ps.get(k) != hs.get(k)]
    return hard, soft
