"""The mix-ablation lab (kernels/lab/mix_ablation.py): every edit still finds its text in kernels/fp4_i8.py
(else the lab would time the package's loop under another name), the unedited copy is the package's
kernel bit for bit, and an edited copy compiles and computes something else."""
import numpy as np
import pytest

from kernels import fp4_i8 as fi
from kernels.cpu_moe import MODE, ROWS_PER_CHUNK, _prepare, random_bytes
from kernels.lab import mix_ablation as ma

K, R, T = 1024, 2, 3


def test_every_edit_finds_its_text_and_changes_the_source():
    package = ma.source(None)
    assert package == open(fi.__file__).read()
    for part in ma.ABLATIONS:
        assert ma.source(part) != package, part


def test_an_edit_whose_text_is_gone_stops_the_lab(monkeypatch):
    monkeypatch.setitem(ma.ABLATIONS, "gone", [("no such text in the kernel", "x")])
    with pytest.raises(RuntimeError, match="gone: kernels/fp4_i8.py no longer holds"):
        ma.source("gone")


def _run(dot):
    rng = np.random.default_rng(3)
    w, s = random_bytes(rng, (ROWS_PER_CHUNK * K // 2,)), rng.integers(118, 130, ROWS_PER_CHUNK * K // 32, dtype=np.uint8)
    x = tuple(a.reshape(-1) for a in _prepare(rng.standard_normal((T, K)).astype(np.float32), np.arange(T)))
    out = np.empty(T * ROWS_PER_CHUNK, np.float32)
    ma.gemv(R, T, K=K, dot=dot)(w, s, x, out, 0, ROWS_PER_CHUNK)
    return out


@pytest.mark.skipif(not MODE, reason="scalar ISA: the lab takes apart the SIMD kernel only")
def test_the_unedited_copy_is_the_package_and_an_edited_one_is_not():
    package = _run(fi.fp4_i8_dot)
    assert np.array_equal(_run(ma.kernel(None)).view(np.uint32), package.view(np.uint32))
    assert not np.array_equal(_run(ma.kernel("no_decode")), package)
