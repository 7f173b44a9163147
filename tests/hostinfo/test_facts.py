"""hostinfo: every host fact, its override, and the layering it sits under."""
import ast
import os
from pathlib import Path

import numba
import pytest

import hostinfo
from hostinfo import HostFactError, machine

ROOT = Path(__file__).resolve().parents[2]


def test_llc_is_the_total_over_domains(monkeypatch):
    monkeypatch.setenv("DSV41_LLC_MIB", "32")
    monkeypatch.setenv("DSV41_LLC_DOMAINS", "4")
    assert hostinfo.llc_domains() == [32 << 20] * 4 and hostinfo.llc_bytes() == 128 << 20
    monkeypatch.delenv("DSV41_LLC_DOMAINS")
    assert hostinfo.llc_bytes() == 32 << 20


def test_sysfs_domains_are_distinct_and_of_the_last_level():
    doms = machine.llc_domains_sysfs()
    if not doms:
        pytest.skip("no cache topology in sysfs on this host")
    assert all(d > 0 for d in doms) and sum(doms) >= max(doms)


def test_l1d_is_cpu0s_level_1_data_cache_or_its_override(monkeypatch):
    monkeypatch.delenv("DSV41_L1D_KIB", raising=False)
    real = machine._l1d_sysfs()
    assert hostinfo.l1d_bytes() == (real or 32 << 10) and hostinfo.l1d_bytes() % 1024 == 0
    if real is not None:
        assert 8 << 10 <= real <= 1 << 20                     # a level-1 data cache, not L2 or an instruction cache
    monkeypatch.setenv("DSV41_L1D_KIB", "48")
    assert hostinfo.l1d_bytes() == 48 << 10 and hostinfo.facts().l1d_kib == 48
    assert "DSV41_L1D_KIB=48" in hostinfo.overrides()
    monkeypatch.setenv("DSV41_L1D_KIB", "0")
    with pytest.raises(HostFactError, match="DSV41_L1D_KIB"):
        hostinfo.l1d_bytes()


def test_amx_tiles_need_the_cpu_an_avx512_vnni_path_and_the_os_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("DSV41_CPU_AMX", raising=False)
    monkeypatch.delenv("DSV41_CPU_ISA", raising=False)
    if machine._amx_granted():                                  # granted only where the CPU lists the tiles
        assert {"amx_tile", "amx_int8"} <= set(hostinfo.cpu_flags())
    assert machine.AMX_PATHS == ("avx512vbmi", "avx512vnni")
    assert hostinfo.amx_tiles() == (machine._amx_granted() and hostinfo.isa() in machine.AMX_PATHS)
    assert hostinfo.facts().amx == hostinfo.amx_tiles()
    monkeypatch.setattr(machine, "_amx_granted", lambda: True)
    assert hostinfo.amx_tiles() == (hostinfo.isa() in machine.AMX_PATHS)
    monkeypatch.setenv("DSV41_CPU_ISA", "avx512")                  # a path without VNNI leaves the tiles out too
    assert hostinfo.amx_tiles() is False
    monkeypatch.delenv("DSV41_CPU_ISA")
    monkeypatch.setenv("DSV41_CPU_AMX", "0")
    assert hostinfo.amx_tiles() is False and hostinfo.facts().amx is False
    assert "DSV41_CPU_AMX=0" in hostinfo.overrides()
    monkeypatch.setenv("DSV41_CPU_AMX", "yes")
    with pytest.raises(HostFactError, match="DSV41_CPU_AMX"):
        hostinfo.amx_tiles()
    monkeypatch.setattr(machine, "_amx_granted", lambda: False)
    monkeypatch.setenv("DSV41_CPU_AMX", "1")
    with pytest.raises(HostFactError, match="DSV41_CPU_AMX=1"):
        hostinfo.amx_tiles()


def test_l1d_reads_the_level_1_data_cache_and_falls_back_to_32_kib(monkeypatch, tmp_path):
    """Not the instruction cache or L2 beside it in sysfs; no cache topology (a container): 32 KiB."""
    monkeypatch.delenv("DSV41_L1D_KIB", raising=False)
    for i, (level, kind, size) in enumerate([(1, "Instruction", "32K"), (1, "Data", "48K"), (2, "Unified", "2048K")]):
        d = tmp_path / "cpu0" / "cache" / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n"), (d / "type").write_text(f"{kind}\n"), (d / "size").write_text(f"{size}\n")
    monkeypatch.setattr(machine, "_SYS_CPU", tmp_path)
    machine._l1d_sysfs.cache_clear()
    try:
        assert hostinfo.l1d_bytes() == 48 << 10
        machine._l1d_sysfs.cache_clear()
        monkeypatch.setattr(machine, "_SYS_CPU", tmp_path / "absent")
        assert hostinfo.l1d_bytes() == 32 << 10
    finally:
        machine._l1d_sysfs.cache_clear()


def test_overrides_are_validated_and_named(monkeypatch):
    monkeypatch.setenv("DSV41_CORES", "zero")
    with pytest.raises(HostFactError, match="DSV41_CORES"):
        hostinfo.usable_cores()
    monkeypatch.setenv("DSV41_CORES", "0")
    with pytest.raises(HostFactError, match=">= 1"):
        hostinfo.usable_cores()
    monkeypatch.setenv("DSV41_CORES", "1")
    assert hostinfo.usable_cores() == 1
    monkeypatch.setenv("DSV41_CPU_ISA", "neon")
    with pytest.raises(HostFactError, match="DSV41_CPU_ISA"):
        hostinfo.isa()


def test_a_path_the_cpu_cannot_run_is_refused_and_every_other_is_taken(monkeypatch):
    """A path needs CPU features (machine.PATH_FEATURES): forcing one the CPU lacks would crash with
    SIGILL, so it is refused, naming what is missing; every path it can run may be forced. Off x86
    (arch monkeypatched) only the scalar path is left."""
    monkeypatch.delenv("DSV41_CPU_ISA", raising=False)
    ok = hostinfo.runnable_isas()
    assert ok[0] == hostinfo.isa() and ok[-1] == "scalar" and list(ok) == [p for p in machine.ISAS if p in ok]
    for path in machine.ISAS:
        monkeypatch.setenv("DSV41_CPU_ISA", path)
        if path in ok:
            assert hostinfo.isa() == path
        else:
            with pytest.raises(HostFactError, match="which this CPU lacks"):
                hostinfo.isa()
    monkeypatch.setattr(machine, "arch", lambda: "aarch64")
    monkeypatch.setenv("DSV41_CPU_ISA", "avx2")
    with pytest.raises(HostFactError, match="needs avx2, fma, which this CPU lacks"):
        hostinfo.isa()
    monkeypatch.delenv("DSV41_CPU_ISA")
    assert hostinfo.runnable_isas() == ["scalar"] and hostinfo.isa() == "scalar"


def test_usable_cores_never_exceed_numba_affinity_or_cores(monkeypatch):
    n = hostinfo.usable_cores()
    assert 1 <= n <= min(len(os.sched_getaffinity(0)), numba.config.NUMBA_NUM_THREADS)
    monkeypatch.setenv("DSV41_CORES", str(n + 8))                  # an override never adds cores
    assert hostinfo.usable_cores() == n
    monkeypatch.setenv("NUMBA_NUM_THREADS", "1")
    assert hostinfo.usable_cores() == 1


def test_thread_clamp_warns_with_both_numbers(monkeypatch, tiny_dir):
    monkeypatch.setenv("DSV41_CORES", "1")
    assert hostinfo.clamp_threads(0) == (1, "")
    n, why = hostinfo.clamp_threads(8)
    assert n == 1 and "8" in why and "1 cores" in why
    from runtime.checkpoint.reader import Checkpoint
    from runtime.experts import PlacedExperts
    from runtime.plan import Plan
    with pytest.warns(RuntimeWarning, match="cpu_threads = 64 but this process may use 1"):
        pe = PlacedExperts(Checkpoint(tiny_dir), Plan(cpu_threads=64))
    assert pe.threads == 1
    pe.close()


def test_ram_override_caps_total_and_available(monkeypatch):
    monkeypatch.setenv("DSV41_RAM_GIB", "2")
    assert hostinfo.ram_total_bytes() == 2 << 30 and hostinfo.ram_available_bytes() <= 2 << 30
    assert hostinfo.probe_budget_bytes() <= 512 << 20


def test_probe_override_caps_the_probe_budget_only(monkeypatch):
    monkeypatch.setenv("DSV41_RAM_GIB", "4")                              # a quarter of available: <= 1 GiB
    total, quarter = hostinfo.ram_total_bytes(), hostinfo.ram_available_bytes() // 4
    monkeypatch.setenv("DSV41_PROBE_MIB", "64")
    assert hostinfo.probe_budget_bytes() == min(quarter, 64 << 20)
    monkeypatch.setenv("DSV41_PROBE_MIB", "100000")                       # never above the quarter
    assert hostinfo.probe_budget_bytes() == quarter
    assert hostinfo.ram_total_bytes() == total                           # RAM itself is not capped
    monkeypatch.setenv("DSV41_PROBE_MIB", "64")
    assert "DSV41_PROBE_MIB=64" in hostinfo.facts().overrides
    monkeypatch.setenv("DSV41_PROBE_MIB", "0")
    with pytest.raises(hostinfo.HostFactError, match="DSV41_PROBE_MIB"):
        hostinfo.probe_budget_bytes()


def test_o_direct_override_and_cuda_override(monkeypatch, tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 8192)
    monkeypatch.setenv("DSV41_O_DIRECT", "0")
    assert "DSV41_O_DIRECT" in hostinfo.o_direct_refusal(f)
    monkeypatch.setenv("DSV41_CUDA", "0")
    assert hostinfo.cuda_available() is False
    assert "DSV41_CUDA=0" in hostinfo.facts().overrides


def test_cpu_facts_without_x86_cpuinfo(monkeypatch):
    """An aarch64 host (Grace): no 'model name' and no 'flags' in /proc/cpuinfo, scalar kernels."""
    monkeypatch.setattr(machine, "_cpuinfo", lambda: {"processor": "0", "CPU implementer": "0x41", "CPU part": "0xd4f",
                                                      "Features": "fp asimd sve2"})
    monkeypatch.setattr(machine, "arch", lambda: "aarch64")
    monkeypatch.delenv("DSV41_CPU_ISA", raising=False)
    assert machine.cpu_model() == "arm implementer 0x41 part 0xd4f"
    assert machine.cpu_flags() == [] and machine.isa() == "scalar"


# ------------------------------------------------------------------------------------------- layering
def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("package,forbidden", [("hostinfo", ("kernels", "runtime", "autotune", "reports")),
                                               ("kernels", ("runtime", "autotune", "reports")),
                                               ("runtime", ("autotune", "reports")),
                                               ("autotune", ("reports",))])
def test_imports_point_one_way(package, forbidden):
    for path in (ROOT / package).rglob("*.py"):
        bad = [m for m in _imports(path) if m.split(".")[0] in forbidden]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_reports_import_no_private_names():
    for path in (ROOT / "reports").rglob("*.py"):
        bad = [m for m in _imports(path) if m.split(".")[0] in ("autotune", "runtime", "hostinfo", "kernels")
               and m.rsplit(".", 1)[-1].startswith("_")]
        assert not bad, f"{path.relative_to(ROOT)} imports private names {bad}"


def test_no_module_reads_host_facts_behind_hostinfo():
    """/proc/cpuinfo, cache sysfs, psutil memory and affinity are read in hostinfo only."""
    needles = ("/proc/cpuinfo", "cpu0/cache", "virtual_memory()", "sched_getaffinity", "get_host_cpu_features",
               "cpu_count(")
    for pkg in ("kernels", "runtime", "autotune", "reports"):
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            hits = [n for n in needles if n in text]
            assert not hits, f"{path.relative_to(ROOT)} reads {hits} itself: go through hostinfo"
