"""The host fingerprint: hard fields (a mismatch refuses the profile's plan here) and soft fields
(a mismatch warns). Paths are recorded relative to the checkpoint or by role, never absolute."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from hostinfo import machine as hf


def _gpu():
    if not hf.cuda_available():
        return "", 0.0, ""
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


def commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def dirty() -> bool | None:
    """Does the working tree differ from the commit (uncommitted changes to tracked files)? None: unknown."""
    try:
        root = Path(__file__).resolve().parent.parent
        r = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, timeout=10)
        return bool(r.stdout.strip()) if r.returncode == 0 else None
    except Exception:
        return None


def fingerprint(checkpoint_dir: Path, geometry_hash: str) -> dict:
    import numba
    import numpy
    import torch
    gpu, vram, link = _gpu()
    return {
        "name": platform.node() or "host",
        "hard": {"cpu_model": hf.cpu_model(), "isa": hf.cpu_flags() or [hf.arch()], "physical_cores": hf.usable_cores(),
                 "numa_nodes": hf.numa_nodes(), "ram_gib": round(hf.ram_total_bytes() / 2**30, 4), "gpu_name": gpu,
                 "gpu_vram_gib": vram, "pcie_link": link, "llc_mib": round(hf.llc_bytes() / 2**20),
                 "llc_domains": len(hf.llc_domains()), "kernel_isa": hf.isa()},
        "soft": {"commit": commit(), "kernel": platform.release(),
                 "versions": {"python": platform.python_version(), "torch": torch.__version__, "numba": numba.__version__,
                              "numpy": numpy.__version__, "dsv41": "0.1.0"},
                 "storage": _storage(checkpoint_dir), "geometry_hash": geometry_hash,
                 "host_overrides": list(hf.overrides()), "numba_threading_layer": hf.numba_threading_layer()},
    }


def compare(profile_host: dict, here: dict) -> tuple[list[str], list[str]]:
    """-> (hard differences, soft differences), each as 'field: profile vs here'."""
    hard = [f"{k}: {profile_host['hard'].get(k)!r} vs {v!r}" for k, v in here["hard"].items()
            if k not in ("llc_mib", "llc_domains", "kernel_isa") and profile_host["hard"].get(k) != v]
    ps, hs = profile_host.get("soft", {}), here["soft"]
    soft = [f"{k}: {ps.get(k)!r} vs {hs[k]!r}" for k in ("commit", "kernel", "versions") if ps.get(k) != hs.get(k)]
    return hard, soft
