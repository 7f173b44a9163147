"""kernels/lab/load_width.c (one thread's stream read by load width, with 512-bit work beside it): builds, refuses
a size of nothing, and reports its four variants."""
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels.cpu_moe import MODE

SRC = Path(__file__).resolve().parents[2] / "kernels" / "lab" / "load_width.c"


@pytest.mark.skipif(MODE not in (3, 4), reason="the lab needs AVX-512 VNNI (this host's path is another)")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this host")
def test_the_load_width_lab_builds_and_reports_every_variant(tmp_path):
    exe = tmp_path / "load_width"
    subprocess.run(["gcc", "-O2", "-march=native", "-fopenmp", str(SRC), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe), "16"], capture_output=True, text=True, env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("1 thread(s), 16 MiB")
    assert [ln.split()[0] for ln in lines[1:]] == ["zmm", "ymm", "ymm+add", "ymm+dp"]
    assert all(float(ln.split()[1]) > 0 for ln in lines[1:])
    bad = subprocess.run([str(exe), "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "MiB must be >= 1" in bad.stderr
