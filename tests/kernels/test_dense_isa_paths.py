"""The dense kernels (FP8 as stored, BF16 as stored) on every SIMD path this CPU can run, forced
through $DSV41_CPU_ISA in a fresh process: against float64 over the same weights, and bit-identical
for 1, 3 and 4 threads."""
import os
import subprocess
import sys

import pytest

from hostinfo import isa, runnable_isas

RTOL = 1e-5          # fp32 sums of exact products (or of <= a few hundred per FP8 block) against float64
WEIGHTS = {
    "fp8": """
from kernels.fp8_dense import Fp8Weight, fp8_linear as linear
rng = np.random.default_rng(7)
q = rng.integers(0, 256, (96, 320)).astype(np.uint8)
q[(q & 0x7F) == 0x7F] = 0x38                                  # no NaN codes
w = Fp8Weight(q, (118 + rng.integers(0, 10, (3, 10))).astype(np.uint8), (32, 32))
""",
    "bf16": """
from kernels.bf16_dense import Bf16Weight, bf16_linear as linear
w = Bf16Weight.from_tensor((torch.randn(96, 320, generator=torch.Generator().manual_seed(7)) * 0.05).bfloat16())
""",
}
SCRIPT = """
import numpy as np, torch
{weight}
x = torch.randn(3, 320, generator=torch.Generator().manual_seed(2))
ys = [linear(x, w, threads=t).numpy() for t in (1, 3, 4)]
ref = (x.double() @ w.reference().T).numpy()
print(float(np.linalg.norm(ys[0] - ref) / np.linalg.norm(ref)), all(np.array_equal(ys[0], y) for y in ys))
"""


PATHS = ["avx512", "avx2", "scalar"]


def _case(kernel, path):
    if path not in runnable_isas():
        pytest.skip(f"this CPU cannot run the {path} path (its widest: {isa()})")
    env = dict(os.environ, DSV41_CPU_ISA=path, NUMBA_NUM_THREADS="4")
    return subprocess.run([sys.executable, "-c", SCRIPT.format(weight=WEIGHTS[kernel])], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(request, start_cases):
    """Every (path, kernel) process started at once, two at a time (each mostly compiling cold)."""
    jobs = {f"{path}-{kernel}": (_case, kernel, path) for path in PATHS for kernel in WEIGHTS}
    with start_cases(request, jobs) as started:
        yield started


@pytest.mark.parametrize("kernel", list(WEIGHTS))
@pytest.mark.parametrize("path", PATHS)
def test_every_isa_path_and_thread_count(runs, request, kernel, path):
    out = runs[request.node.callspec.id].result()
    assert out.returncode == 0, out.stderr[-2000:]
    err, same = out.stdout.split()
    assert float(err) < RTOL and same == "True"


def test_the_warm_up_compiles_on_the_scalar_path():
    """kernels/warm.py (what `dsv41-run` calls first) on a host without SIMD: the fused decode's calls
    take the SIMD GEMVs only, so they are not compiled there (they would not type without lanes)."""
    env = dict(os.environ, DSV41_CPU_ISA="scalar", NUMBA_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", "from kernels.warm import warm_up; warm_up(1); print('warm')"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["warm"], out.stderr[-2000:]
