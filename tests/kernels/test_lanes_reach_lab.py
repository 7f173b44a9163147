"""kernels/lab/lanes_reach.c (one thread's reach from DRAM with the lanes kernel): builds, its scales-
interleaved layout gives the same outputs as the package's (it exits 1 otherwise), and it reports every
variant beside the stream it is held against."""
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels.cpu_moe import MODE

SRC = Path(__file__).resolve().parents[2] / "kernels" / "lab" / "lanes_reach.c"


@pytest.mark.skipif(MODE != 4, reason="the lab kernel needs AVX-512 VNNI + VBMI (this host's path is another)")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this host")
def test_the_reach_lab_builds_checks_its_layouts_and_reports_every_variant(tmp_path):
    exe = tmp_path / "lanes_reach"
    subprocess.run(["gcc", "-O2", "-march=native", "-fopenmp", str(SRC), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe), "48"], capture_output=True, text=True, env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split()[0] for line in out.stdout.splitlines()[1:]]
    assert rows == ["read", "stream", "none", "pkg", "l1x", "load", "inter", "l2", "t2", "l3", "l1x32", "stream32", "now", "nowh"]
    assert "/ stream 1.000" in out.stdout
