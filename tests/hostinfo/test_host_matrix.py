"""The host matrix: `dsv41-tune --quick` end to end on tiny (profile -> search -> validation -> one
served request) under host shapes unlike this one, each in its own process with hostinfo's overrides.
A shape this machine cannot take (an ISA wider than its CPU, no tmpfs) is skipped with the reason.
Every case caps what one probe allocates ($DSV41_PROBE_MIB, PROBE): the figures are not what these
tests check, and a VM can take seconds per GiB the first time a process touches fresh memory.

The cases run two at a time (`matrix`, tests/conftest.py start_cases)."""
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.costmodel import OS_HEADROOM
from autotune.search import CHUNKS, CONTEXTS
from runtime.budget import host_bytes
from runtime.checkpoint.synth import make_checkpoint
from runtime.config import ModelConfig
from runtime.plan import Plan
from hostinfo import isa, o_direct_refusal, runnable_isas
from runtime.checkpoint.reader import Checkpoint

CASE = Path(__file__).with_name("host_case.py")
NATIVE = isa()
PROBE = {"DSV41_PROBE_MIB": "512"}          # above the V4.1 probe bank's floor (2 top_k + 8 experts, 359 MiB)


def run_case(ck: Path, out: Path, env: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    full.update({**PROBE, **env})
    p = subprocess.run([sys.executable, str(CASE), str(ck), str(out)], env=full, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, f"{env}: {p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def check_common(r: dict, env: dict) -> None:
    choice, n = r["completion"]["choices"][0], r["completion"]["usage"]["completion_tokens"]
    assert r["status"] == 200 and choice["text"]
    assert n == 3 or (1 <= n < 3 and choice["finish_reason"] == "stop")   # the plan the tune picked may meet EOS first
    m = r["measurements"]
    assert m["dram_stream_read_gbs"]["median"] > 0
    probe_mib = float({**PROBE, **env}["DSV41_PROBE_MIB"])
    assert m["probe_memory_budget_bytes"] <= probe_mib * 2**20
    assert f"DSV41_PROBE_MIB={probe_mib:g}" in r["host"]["soft"]["host_overrides"]
    if probe_mib < 1024:                                   # tiny's Engram shard is small: a scratch file, within the budget
        assert all(f"{probe_mib:g} MiB: the probe memory budget" in e["path"] for e in m["nvme_randread_4k"])
    for e in m["cpu_moe_gbs"]:                            # every geometry measured, with its own top_k's bank floor
        assert "skipped" in e or (e["median"] > 0 and e["extra"]["bank_experts"] >= 2 * e["extra"]["top_k"] + 8), e
    for k, v in env.items():
        if k.startswith("DSV41_"):
            assert f"{k}={v}" in r["host"]["soft"]["host_overrides"]
    assert r["plan"]["cpu_threads"] <= r["facts"]["usable_cores"]


@contextlib.contextmanager
def read_only(d: Path):
    """A directory no process here can write to, root included (chattr +i), else chmod a-w."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
            pytest.skip("cannot make a read-only directory as root here (chattr +i refused)")
        try:
            yield d
        finally:
            subprocess.run(["chattr", "-i", str(d)], check=True)
    else:
        d.chmod(0o555)
        try:
            yield d
        finally:
            d.chmod(0o755)


# the scalar case also has a probe budget under the V4.1 and V4-Flash probe banks' floors (359 and 255 MiB;
# 192 MiB is a whole number of the NVMe scratch file's 64 MiB chunks): those geometries are skipped with the
# reason, and the row layout is left at its default
ISA_CASES = [pytest.param("scalar", {"DSV41_CPU_ISA": "scalar", "DSV41_LLC_MIB": "2", "DSV41_PROBE_MIB": "192"},
                          id="scalar-llc2mib-probe192mib"),
             pytest.param("avx2", {"DSV41_CPU_ISA": "avx2", "DSV41_LLC_MIB": "32", "DSV41_LLC_DOMAINS": "4"},
                          id="avx2-llc32mib-x4domains")]
BIG_CACHE = {"DSV41_LLC_MIB": "1024", "DSV41_RAM_GIB": "9", "DSV41_PROBE_MIB": "768"}


def isa_case(ck: Path, out: Path, want_isa: str, env: dict):
    if want_isa not in runnable_isas():
        pytest.skip(f"this CPU cannot run the {want_isa} path (its widest: {NATIVE})")
    return run_case(ck, out, env), env


def one_core_case(tmp: Path):
    """One usable core; RAM that holds only half the routed experts beside the leanest plan, so the tune
    puts the rest on the NVMe tier; and a checkpoint directory nothing may write into. tiny's experts
    (0.8 MB) vanish beside a chunk's temporaries: a tiny geometry with 54 MB of them."""
    cfg = ModelConfig.preset("tiny").replace(name="tiny-big-experts", moe_intermediate_size=1024, n_routed_experts=64)
    ck = make_checkpoint(cfg, tmp / "ro" / "ck", seed=0)
    fp = Checkpoint(ck).footprint()
    # what the leanest plan the search offers needs besides its experts (runtime/budget.py: the smallest
    # chunk and context; Engram in RAM, so any placement fits) + half the experts
    lean = Plan(host_expert_budget_gib=0.0, prefill_chunk=min(CHUNKS), max_context=min(CONTEXTS))
    ram = OS_HEADROOM + host_bytes(lean, fp, dense_on_host=True) + fp.routed_expert_bytes_total // 2
    before = sorted(p.name for p in ck.iterdir())
    env = {"DSV41_CORES": "1", "NUMBA_NUM_THREADS": "1", "DSV41_LLC_MIB": "2", "DSV41_RAM_GIB": f"{ram / 2**30:.7f}"}
    with read_only(ck):
        r = run_case(ck, tmp / "out", env)
    return r, env, fp.routed_expert_bytes_total, before, sorted(p.name for p in ck.iterdir()), list(ck.parent.glob(".dsv41-probe-*"))


def native_case(tiny: Path, tmp: Path):
    """An LLC of 1 GiB in 9 GiB of RAM; the checkpoint on tmpfs (or without O_DIRECT); numba's workqueue."""
    shm = Path("/dev/shm")
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    on_tmpfs = any(m[1] == str(shm) and m[2] == "tmpfs" for m in mounts)
    if on_tmpfs:                          # the NVMe probe's scratch file (the probe budget) goes beside the checkpoint
        st = os.statvfs(shm)
        on_tmpfs = st.f_bavail * st.f_frsize > 2 * float(BIG_CACHE["DSV41_PROBE_MIB"]) * 2**20
    root = Path(subprocess.check_output(["mktemp", "-d", "-p", str(shm)], text=True).strip()) if on_tmpfs else tmp / "fs"
    try:
        ck = root / "tiny"
        shutil.copytree(tiny, ck)
        env = {**BIG_CACHE, "NUMBA_THREADING_LAYER": "workqueue"}
        if not o_direct_refusal(next(ck.glob("*.safetensors"))):
            env["DSV41_O_DIRECT"] = "0"
        return run_case(ck, tmp / "out", env), env
    finally:
        if on_tmpfs:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def matrix(request, start_cases, tiny_dir, tmp_path_factory):
    """{case id: future of its result}, longest first (on this VM: avx2 ~80 s, scalar ~60, native ~45,
    one core ~40, each cold)."""
    tmp = tmp_path_factory.mktemp("matrix")
    jobs = {p.id: (isa_case, tiny_dir, tmp / p.values[0], *p.values) for p in reversed(ISA_CASES)}   # avx2 first
    jobs.update({"native": (native_case, tiny_dir, tmp / "native"), "one-core": (one_core_case, tmp / "one-core")})
    with start_cases(request, jobs, lambda item: item.callspec.id if hasattr(item, "callspec") else TEST_CASE[item.originalname]) as cases:
        yield cases


@pytest.mark.parametrize("want_isa,env", ISA_CASES)
def test_isa_and_cache_shapes(matrix, request, want_isa, env):
    r, env = matrix[request.node.callspec.id].result()
    check_isa_and_cache(r, want_isa, env)


def check_isa_and_cache(r: dict, want_isa: str, env: dict) -> None:
    check_common(r, env)
    llc_mib = float(env["DSV41_LLC_MIB"]) * int(env.get("DSV41_LLC_DOMAINS", 1))
    assert r["facts"]["isa"] == want_isa and r["host"]["hard"]["kernel_isa"] == want_isa
    assert r["host"]["hard"]["llc_mib"] == round(llc_mib) and r["host"]["hard"]["llc_domains"] == int(env.get("DSV41_LLC_DOMAINS", 1))
    m = r["measurements"]
    budget = m["probe_memory_budget_bytes"]
    assert budget <= min(float(env.get("DSV41_RAM_GIB", 1e9)) * 2**30 / 4, float({**PROBE, **env}["DSV41_PROBE_MIB"]) * 2**20)
    for e in m["cpu_moe_gbs"]:
        ebytes = 3 * 17 * int(e["geometry"].split("x")[0]) * int(e["geometry"].split("x")[1]) // 32
        if "skipped" in e:                                # only where its bank's floor (2 top_k + 8 experts) does not fit
            floor = re.search(r"needs (\d+) experts", e["skipped"])
            assert "over the probe memory budget" in e["skipped"] and floor and int(floor[1]) * ebytes > budget, e
            continue
        n = e["extra"]["bank_experts"]
        assert n * ebytes <= budget
        if n * ebytes < 4 * llc_mib * 2**20:              # the budget kept the bank small: the figure says so
            assert "probe memory budget" in e["note"], e
    if budget < 255 * 2**20:                              # nothing real-sized measured: the default row layout
        assert not {"cpu_moe_streams", "cpu_moe_inputs", "cpu_moe_fetch"} & set(m) and {e["geometry"] for e in m["cpu_moe_gbs"] if "skipped" in e} >= {"5120x2304", "4096x2048"}
    if llc_mib >= 1024:
        assert any("probe memory budget" in e["note"] for e in m["cpu_moe_gbs"])
        assert "probe memory budget" in m["dram_stream_read_gbs"]["note"]


def test_one_core_small_ram_and_a_read_only_checkpoint_directory(matrix):
    """Three shapes in one process (each costs a whole quick tune): see `one_core_case`."""
    r, env, routed, before, after, scratch = matrix["one-core"].result()
    check_common(r, env)
    assert r["facts"]["usable_cores"] == 1 and r["host"]["hard"]["physical_cores"] == 1
    assert {e["threads"] for e in r["measurements"]["cpu_moe_gbs"] if "threads" in e} == {1}
    budget = r["plan"]["host_expert_budget_gib"]
    assert budget is not None and budget * 2**30 < routed                # part of the experts live on NVMe
    assert after == before                                            # nothing written into the checkpoint
    assert not scratch                                                # the probe's scratch directory is gone


def test_native_path_a_1gib_cache_and_9gib_on_tmpfs_without_o_direct_on_workqueue(matrix):
    """Three shapes in one process (each costs a whole quick tune), on the CPU's own path:
    - an LLC of 1 GiB in 9 GiB of RAM: the probe budget keeps the banks and the stream buffer under 4x
      the cache, and the figures say so;
    - the checkpoint on tmpfs, which refused O_DIRECT until Linux 6.6; where this kernel's tmpfs takes it
      (or there is no tmpfs with room for the probe's scratch file), the refusal of an older kernel or a
      network filesystem is reproduced with $DSV41_O_DIRECT=0;
    - numba on its workqueue layer, as a slim container image without libgomp or tbb runs it (not
      threadsafe): the profile records it, the cost model reads it (tests/autotune/test_costmodel.py),
      the runtime's CPU shares then run in turn (tests/runtime/test_runtime.py)."""
    r, env = matrix["native"].result()
    check_isa_and_cache(r, NATIVE, env)
    assert r["host"]["soft"]["numba_threading_layer"] == "workqueue"
    curve = r["measurements"]["nvme_randread_4k"]
    assert all(e["io_path"] == "buffered" and "O_DIRECT" in e["fallback"] for e in curve)
    assert r["info_io"]["profile"].startswith("buffered (")          # shown by dsv41-serve's /dsv41/info too


TEST_CASE = {test_one_core_small_ram_and_a_read_only_checkpoint_directory.__name__: "one-core",
             test_native_path_a_1gib_cache_and_9gib_on_tmpfs_without_o_direct_on_workqueue.__name__: "native"}
