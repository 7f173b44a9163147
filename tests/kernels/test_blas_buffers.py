"""torch's BLAS holds no GEMM buffers between calls in a dsv41 process (kernels/__init__.py), and where
torch came first the runtime hands them back after each forward (kernels/threads.py). Each case runs in a
fresh interpreter: MKL reads its setting once, when torch loads it."""
import json
import subprocess
import sys

import pytest

from kernels import threads

if threads._mkl() is None:
    pytest.skip("this torch build exports no MKL memory calls (no MKL, or not x86): nothing keeps GEMM buffers",
                allow_module_level=True)

GEMMS = """
import ctypes, json, torch
libc = ctypes.CDLL("libc.so.6")
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MI
def in_use():
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd
torch.set_num_threads(2)
x, w = torch.randn(3000, 1024), torch.randn(1024, 1024)
u0 = in_use()
for n in (300, 700, 1500, 3000):            # GEMMs big enough to pack both operands, as a prefill's are
    y = x[:n] @ w
    del y
from kernels.threads import blas_keeps_buffers, release_blas_buffers
kept, held = blas_keeps_buffers(), in_use() - u0
print(json.dumps({"kept": kept, "held": held, "released": release_blas_buffers(), "after": in_use() - u0}))
"""


def _run(first: str) -> dict:
    out = subprocess.run([sys.executable, "-c", first + GEMMS], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if k != "MKL_DISABLE_FAST_MM"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_a_dsv41_process_keeps_no_gemm_buffers():
    r = _run("import kernels\n")
    assert not r["kept"] and not r["released"]
    assert r["held"] < 256 << 10, r                  # the GEMMs' outputs are freed: nothing stays allocated


def test_where_torch_came_first_the_kept_buffers_are_handed_back():
    r = _run("import torch\nimport kernels\n")
    assert r["kept"] and r["released"]
    assert r["held"] > 1 << 20, r                    # MKL kept MBs of packing buffers (4.3 MB a thread on the AMX Xeon VM)
    assert r["after"] < 256 << 10, r


def test_this_test_process_keeps_none():
    """conftest imports dsv41 before torch, so the in-process memory tests measure what a CLI's run holds."""
    assert not threads.blas_keeps_buffers()
