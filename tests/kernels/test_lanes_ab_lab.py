"""kernels/lab/lanes_ab.py: each lanes copy is named by the settings it compiles under, sets the host
path's entry only, and the package's settings come back after its compiling call."""
import pytest

from kernels import cpu_moe as cm
from kernels import fp4_lanes as fl
from kernels import fp4_simd as simd
from kernels.lab.lanes_ab import compile_under, copies


def test_the_copies_carry_their_settings_and_give_the_package_s_back():
    mods = copies([2048, 4096], None, ["always", "never"])
    assert list(mods) == ["rows", "lanes@2048^always", "lanes@2048^never", "lanes@4096^always", "lanes@4096^never"]
    assert mods["rows"].emit == [] and mods["rows"].LANES_MODES == ()
    m = mods["lanes@4096^never"]
    (m1, k1, a), (m2, k2, l2) = m.emit
    assert (m1, k1, a) == (fl, "L1_AHEAD", 4096) and (m2, k2) == (fl, "L2_ONE_INPUT")
    assert l2 == {**fl.L2_ONE_INPUT, cm.MODE: "never"}         # only the host's path changed
    assert mods["lanes@2048^always"].emit[1][2] == {**fl.L2_ONE_INPUT, cm.MODE: "always"}
    before, seen = (fl.L1_AHEAD, dict(fl.L2_ONE_INPUT), simd.WEIGHT_PREFETCH), []
    compile_under(m, lambda: seen.append((fl.L1_AHEAD, dict(fl.L2_ONE_INPUT))))
    assert seen == [(4096, l2)]
    assert (fl.L1_AHEAD, fl.L2_ONE_INPUT, simd.WEIGHT_PREFETCH) == before

    def boom():
        raise RuntimeError("compile failed")
    with pytest.raises(RuntimeError):
        compile_under(m, boom)
    assert (fl.L1_AHEAD, fl.L2_ONE_INPUT, simd.WEIGHT_PREFETCH) == before
