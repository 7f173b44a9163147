"""Host facts: the one place dsv41 reads anything about the machine it runs on.

ISA, AMX tiles, last-level cache (every distinct domain, not only cpu0's), L1 data cache, usable cores, RAM, NUMA nodes, O_DIRECT
support of a filesystem, CUDA. Nothing else in the project reads /proc, /sys, cpuid or psutil for these.
Each fact has an environment override, so the tests run the whole product under host shapes other
than the one they run on (docs/host-overrides.md):

  DSV41_CPU_ISA      avx512vbmi | avx512vnni | avx512 | avx2vnni | avx2 | scalar   the kernels' SIMD path (one the CPU can run)
  DSV41_LLC_MIB      MiB per last-level cache domain
  DSV41_LLC_DOMAINS  how many distinct last-level cache domains (default 1 with DSV41_LLC_MIB)
  DSV41_L1D_KIB      KiB of one core's L1 data cache
  DSV41_CPU_AMX      0: AMX tiles read as absent on a CPU that has them; 1: required (an error without them)
  DSV41_CORES        usable cores (never above what the process may really run on)
  DSV41_RAM_GIB      total RAM; available RAM is capped to it
  DSV41_NUMA_NODES   NUMA nodes
  DSV41_O_DIRECT     0: every filesystem refuses O_DIRECT (the buffered fallback runs)
  DSV41_CUDA         0: no CUDA device even where torch sees one
  DSV41_PROBE_MIB    the most memory one probe may allocate (default a quarter of the available RAM):
                     a box shared with other work, or a test that needs no GiB-sized buffers
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

# The kernels' SIMD paths, widest first, each with the LLVM CPU features it needs (kernels/fp4_i8.py
# modes 4, 3, 2, 5, 1 and the scalar loops): VNNI's integer dots on AVX-512 (with VBMI's byte permute for
# the nibbles), AVX-512BW, AVX-VNNI's on 256-bit vectors (Alder Lake and later Intel client cores without
# AVX-512), AVX2 + FMA.
PATH_FEATURES = {"avx512vbmi": ("avx512f", "avx512bw", "avx512vnni", "avx512vbmi"),
                 "avx512vnni": ("avx512f", "avx512bw", "avx512vnni"), "avx512": ("avx512f", "avx512bw"),
                 "avx2vnni": ("avx2", "fma", "avxvnni"), "avx2": ("avx2", "fma"), "scalar": ()}
ISAS = tuple(PATH_FEATURES)
AMX_PATHS = ISAS[:2]         # the paths AMX tiles go with: AVX-512 VNNI's
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
_SYS_CPU = Path("/sys/devices/system/cpu")


class HostFactError(ValueError):
    """An override is malformed or asks for more than the host has; the message names the variable."""


def _env_num(name: str, kind=int, lo: float = 1):
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        v = kind(raw)
    except ValueError:
        raise HostFactError(f"${name}={raw!r} is not a number") from None
    if v < lo:
        raise HostFactError(f"${name}={raw!r} must be >= {lo}")
    return v


# ------------------------------------------------------------------------------------------- CPU
def arch() -> str:
    return platform.machine() or "unknown"


def _cpuinfo() -> dict:
    """The first processor's fields of /proc/cpuinfo (x86: 'model name', 'flags'; arm64: 'Features')."""
    out: dict = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                if out:
                    break
                continue
            k, _, v = line.partition(":")
            out.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return out


def cpu_model() -> str:
    info = _cpuinfo()
    for k in ("model name", "Model Name", "Processor", "cpu model"):
        if info.get(k):
            return info[k]
    if info.get("CPU implementer"):           # arm64 names no model: implementer and part identify it
        return f"arm implementer {info['CPU implementer']} part {info.get('CPU part', '?')}"
    return platform.processor() or arch()


def cpu_flags() -> list[str]:
    """The ISA extensions the project cares about, as the kernel lists them (x86 only)."""
    flags = set(_cpuinfo().get("flags", "").split())
    return [f for f in ISA_FLAGS if f in flags]


@functools.lru_cache(maxsize=1)
def _llvm_features() -> dict:
    """LLVM's view of this CPU's features (asked once: every `isa()` checks every path against them)."""
    import llvmlite.binding as llvm
    return dict(llvm.get_host_cpu_features())


def _missing(path: str) -> list[str]:
    """The CPU features `path` needs that this CPU lacks (every one off x86)."""
    if arch() not in ("x86_64", "AMD64", "i686", "i386"):
        return list(PATH_FEATURES[path])
    feats = _llvm_features()
    return [f for f in PATH_FEATURES[path] if not feats.get(f)]


def runnable_isas() -> list[str]:
    """Every SIMD path this CPU can run, widest first (scalar always), whatever $DSV41_CPU_ISA says."""
    return [p for p in ISAS if not _missing(p)]


def native_isa() -> str:
    """The widest SIMD path this CPU offers, whatever $DSV41_CPU_ISA says (see `isa`)."""
    return runnable_isas()[0]


def isa() -> str:
    """The widest SIMD path the CPU kernels can take here: avx512vbmi (avx512vnni's, the nibbles decoded
    by VBMI's byte permute: the same bits, kernels/fp4_i8.py) | avx512vnni (AVX-512BW with VNNI's
    integer dot products) | avx512 | avx2vnni (AVX2 with AVX-VNNI's dot products: the same bits as
    avx2) | avx2 | scalar (any non-x86 host: scalar). DSV41_CPU_ISA picks another path the CPU can run;
    one it cannot (it would crash with SIGILL) is an error."""
    real = native_isa()
    forced = os.environ.get("DSV41_CPU_ISA")
    if not forced:
        return real
    if forced not in ISAS:
        raise HostFactError(f"$DSV41_CPU_ISA={forced!r} must be one of {ISAS}")
    missing = _missing(forced)
    if missing:
        raise HostFactError(f"$DSV41_CPU_ISA={forced!r} needs {', '.join(missing)}, which this CPU lacks "
                            f"(its widest path: {real!r})")
    return forced


def amx_tiles() -> bool:
    """Whether the CPU kernels may use AMX int8 tiles (only the lab's exact tile route does so far:
    kernels/lab/fp4_amx_tiles.py): the CPU has them (amx-tile and
    amx-int8), the SIMD path is one of AVX-512 VNNI's (`AMX_PATHS`: a $DSV41_CPU_ISA without it leaves
    them out too), Linux grants
    this process the tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once: kernels from 5.16) and
    $DSV41_CPU_AMX is not 0. $DSV41_CPU_AMX=1 on a host without them is an error."""
    want = os.environ.get("DSV41_CPU_AMX")
    if want not in (None, "", "0", "1"):
        raise HostFactError(f"$DSV41_CPU_AMX={want!r} must be 0 or 1")
    if want == "0":
        return False
    ok = isa() in AMX_PATHS and _amx_granted()
    if want == "1" and not ok:
        raise HostFactError("$DSV41_CPU_AMX=1, but this host's kernels cannot use AMX tiles "
                            f"(ISA path {isa()!r}; CPU tiles and the kernel's permission: {_amx_granted()})")
    return ok


@functools.lru_cache(maxsize=1)
def _amx_granted() -> bool:
    if arch() != "x86_64" or platform.system() != "Linux":
        return False
    feats = _llvm_features()
    if not (feats.get("amx-tile") and feats.get("amx-int8")):
        return False
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0      # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False


# ------------------------------------------------------------------------------------- caches
def _size(text: str) -> int:
    text = text.strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * mult


def llc_domains() -> list[int]:
    """Bytes of each distinct last-level cache domain (AMD: one L3 per CCX, so cpu0's index3 is one of
    several). Unknown (no sysfs, e.g. some containers): one 32 MiB domain, said in `facts().notes`."""
    mib, n = _env_num("DSV41_LLC_MIB", float, 0.0625), _env_num("DSV41_LLC_DOMAINS")
    if mib is not None or n is not None:
        real = llc_domains_sysfs() or [32 << 20]
        per = int(mib * 2**20) if mib is not None else real[0]
        return [per] * (n or 1)
    return llc_domains_sysfs() or [32 << 20]


def llc_domains_sysfs() -> list[int]:
    best_level, domains = 0, {}
    for cache in _SYS_CPU.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (cache / "type").read_text().strip() == "Instruction":
                continue
            level = int((cache / "level").read_text())
            size = _size((cache / "size").read_text())
            shared = (cache / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        if level > best_level:
            best_level, domains = level, {}
        if level == best_level:
            domains[shared] = size
    return list(domains.values())


def llc_bytes() -> int:
    """The total last-level cache over all domains: what a buffer must exceed to measure DRAM."""
    return sum(llc_domains())


def l1d_bytes() -> int:
    """One core's L1 data cache (cpu0's level-1 data cache in sysfs): what a kernel keeps its reused inputs
    under (kernels/cpu_moe.py `l1_input_bytes`). Unknown: 32 KiB, the least of any x86 core since Core 2."""
    kib = _env_num("DSV41_L1D_KIB")
    if kib is not None:
        return kib << 10
    return _l1d_sysfs() or 32 << 10


@functools.lru_cache(maxsize=1)
def _l1d_sysfs() -> int | None:
    """Read once: the CPU-MoE call asks for it on every call."""
    for cache in sorted(_SYS_CPU.glob("cpu0/cache/index[0-9]*")):
        try:
            if int((cache / "level").read_text()) == 1 and (cache / "type").read_text().strip() == "Data":
                return _size((cache / "size").read_text())
        except (OSError, ValueError):
            continue
    return None


# -------------------------------------------------------------------------------------- cores
def _cgroup_cpus() -> float | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Cores this process may keep busy: physical cores, within the affinity mask, the cgroup CPU quota
    and NUMBA_NUM_THREADS (numba refuses more threads than that); DSV41_CORES lowers it further."""
    logical = psutil.cpu_count() or os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or logical
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = logical
    limits = [physical, allowed, logical]
    quota = _cgroup_cpus()
    if quota is not None:
        limits.append(max(1, int(quota)))
    numba_max = _env_num("NUMBA_NUM_THREADS")
    if numba_max is not None:
        limits.append(numba_max)
    n = max(1, min(limits))
    forced = _env_num("DSV41_CORES")
    return min(n, forced) if forced is not None else n


def clamp_threads(requested: int, what: str = "cpu_threads") -> tuple[int, str]:
    """-> (threads to use, a warning or ''): 0 means every usable core; more than usable is clamped."""
    usable = usable_cores()
    if requested <= 0:
        return usable, ""
    if requested > usable:
        return usable, f"{what} = {requested} but this process may use {usable} cores: using {usable}"
    return requested, ""


# ------------------------------------------------------------------------------------- memory
def ram_total_bytes() -> int:
    real = psutil.virtual_memory().total
    gib = _env_num("DSV41_RAM_GIB", float, 0.001)
    return real if gib is None else min(real, int(gib * 2**30))


def ram_available_bytes() -> int:
    return min(psutil.virtual_memory().available, ram_total_bytes())


def probe_budget_bytes() -> int:
    """The most host memory any one probe may allocate: a quarter of the available RAM (after the RAM
    override), or $DSV41_PROBE_MIB where lower. Probes size their buffers within it and say so when it
    keeps a buffer inside the cache."""
    quarter, mib = ram_available_bytes() // 4, _env_num("DSV41_PROBE_MIB", float, 1)
    return quarter if mib is None else min(quarter, int(mib * 2**20))


def numa_nodes() -> int:
    forced = _env_num("DSV41_NUMA_NODES")
    return forced or len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1


# ------------------------------------------------------------------------------ storage, GPU
def o_direct_refusal(path) -> str:
    """'' when `path` (an existing file) can be opened with O_DIRECT, else why not."""
    if os.environ.get("DSV41_O_DIRECT") == "0":
        return "O_DIRECT disabled by $DSV41_O_DIRECT=0"
    if not hasattr(os, "O_DIRECT"):
        return f"no O_DIRECT on {platform.system()}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        return f"O_DIRECT refused on {os.path.basename(str(path))}: {e.strerror}"
    os.close(fd)
    return ""


def cuda_available() -> bool:
    if os.environ.get("DSV41_CUDA") == "0":
        return False
    try:
        import torch
        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def numba_threading_layer() -> str:
    """numba's threading layer in this process (tbb, omp or workqueue; NUMBA_THREADING_LAYER picks one),
    started here if no parallel kernel has run yet (numba's own start-up, no kernel compiled). workqueue
    (where neither libgomp nor tbb loads, as in slim container images) aborts the process when two
    threads launch parallel kernels at once."""
    import numba
    try:
        return numba.threading_layer()
    except ValueError:                                   # chosen when the pool first starts
        pass
    try:
        from numba.np.ufunc.parallel import _launch_threads   # numba's own start-up (not public API)
        _launch_threads()
    except ImportError:                                  # another numba: a first parallel launch starts it
        import numpy as np
        prange = numba.prange

        @numba.njit(parallel=True)
        def touch(a):
            for i in prange(a.shape[0]):
                a[i] = i
        touch(np.zeros(2))
    return numba.threading_layer()


@dataclass(frozen=True)
class HostFacts:
    arch: str
    cpu_model: str
    isa: str
    cpu_flags: tuple
    usable_cores: int
    llc_domains_mib: tuple
    l1d_kib: int
    amx: bool
    ram_gib: float
    numa_nodes: int
    cuda: bool
    overrides: tuple            # the DSV41_* variables in force, so a figure never hides its host shape

    def to_dict(self) -> dict:
        return asdict(self)


OVERRIDES = ("DSV41_CPU_ISA", "DSV41_CPU_AMX", "DSV41_LLC_MIB", "DSV41_LLC_DOMAINS", "DSV41_L1D_KIB", "DSV41_CORES", "DSV41_RAM_GIB",
             "DSV41_NUMA_NODES", "DSV41_O_DIRECT", "DSV41_CUDA", "DSV41_PROBE_MIB")


def overrides() -> tuple:
    """The DSV41_* host overrides in force ("NAME=value"), recorded with every profile."""
    return tuple(f"{k}={os.environ[k]}" for k in OVERRIDES if os.environ.get(k))


def facts() -> HostFacts:
    return HostFacts(arch(), cpu_model(), isa(), tuple(cpu_flags()), usable_cores(),
                     tuple(round(b / 2**20, 2) for b in llc_domains()), l1d_bytes() >> 10, amx_tiles(), round(ram_total_bytes() / 2**30, 1),
                     numa_nodes(), cuda_available(), overrides())
