"""What the runtime holds is what the plan counts (runtime/budget.py is the one accounting)."""
import pytest
import torch

from kernels.bf16_dense import Bf16Weight
from kernels.fp8_dense import Fp8Weight
from runtime.budget import dense_host_bytes, dense_path_bytes, drafter_dense_bytes, host_bytes
from runtime.engine import Engine
from runtime.plan import Plan


def _held(w: dict, drafter: bool) -> int:
    """Bytes held (Fp8Weight, Bf16Weight, DeviceFp8Weight and tensors) by the drafter's tensors or the rest."""
    return sum(t.nbytes for k, t in w.items() if k.startswith("mtp.") == drafter)


def test_dense_weights_are_held_as_fp8_and_counted(tiny_dir):
    e = Engine(tiny_dir, Plan(), device="cpu")
    try:
        fp = e.ck.footprint()
        w = e.model.w
        fp8 = [k for k, s in e.ck.infos.items() if s.dtype == "F8_E4M3" and ".engram.embed" not in k and k in w]
        assert fp8 and all(isinstance(w[k], Fp8Weight) for k in fp8)           # no float32 copy of a linear
        assert w["embed.weight"].dtype == torch.bfloat16                       # the table as stored
        bf16 = [k for k, s in e.ck.infos.items() if s.dtype == "BF16" and len(s.shape) == 2 and k in w and k != "embed.weight"]
        assert "head.weight" in bf16 and all(isinstance(w[k], Bf16Weight) for k in bf16)   # head, routers as stored
        assert _held(w, drafter=False) == dense_host_bytes(fp) - fp.bytes_by_class["shared_expert"]
        assert _held(w, drafter=True) == drafter_dense_bytes(fp) > 0
        assert fp.widened_bytes["cpu"] > 0                                     # the norms: float32
        assert host_bytes(Plan(), fp, dense_on_host=True) >= _held(w, False) + fp.routed_expert_bytes_total
    finally:
        e.close()


def test_the_device_path_holds_what_the_plan_counts(tiny_dir):
    """The device's dense weights (the Triton path's forms: on the GPU where there is one, else built on
    CPU tensors): fp8 as stored, every BF16 matrix but the embedding table a float32 copy, all counted
    by the plan's device tier."""
    from runtime.checkpoint.reader import Checkpoint
    from runtime.model.weights import DeviceFp8Weight, load_dense
    ck = Checkpoint(tiny_dir)
    fp = ck.footprint()
    w = load_dense(ck, torch.float32, "cuda" if torch.cuda.is_available() else "cpu", keep_fp8=True, fp8_kernel="triton")
    assert any(isinstance(t, DeviceFp8Weight) for t in w.values())
    routers = [k for k in w if k.endswith(".ffn.gate.weight")]
    assert routers and all(w[k].dtype == torch.float32 for k in routers)
    assert _held(w, drafter=False) == dense_host_bytes(fp, on_cpu=False) - fp.bytes_by_class["shared_expert"]
    assert _held(w, drafter=True) == drafter_dense_bytes(fp, on_cpu=False)
    head = fp.vocab_size * fp.hidden_size * 2
    assert dense_path_bytes(fp, on_cpu=False) - dense_path_bytes(fp) > head   # the head and the routers widened


def test_hash_routing_tables_are_counted_as_held(tmp_path):
    """A hash-routed layer's token -> experts table (I32 as stored) is held as int64: counted so."""
    from runtime.checkpoint.reader import Checkpoint
    from runtime.checkpoint.synth import make_checkpoint
    from runtime.config import ModelConfig
    from runtime.model.weights import load_dense
    ck = Checkpoint(make_checkpoint(ModelConfig.preset("tiny").replace(name="tiny-hash", n_hash_layers=1), tmp_path, seed=0))
    fp = ck.footprint()
    w = load_dense(ck, torch.float32, "cpu", keep_fp8=True)
    assert w["layers.0.ffn.tid2eid"].dtype == torch.int64
    assert _held(w, drafter=False) == dense_host_bytes(fp) - fp.bytes_by_class["shared_expert"]


def test_inspect_the_cost_model_and_admission_count_the_same_bytes(full_skeleton, tmp_path, capsys):
    """One accounting: `dsv41-checkpoint inspect --plan` on the V4.1 skeleton, `predict` (what
    `dsv41-tune plan` prints) and the runtime's admission all read runtime/budget.py."""
    import copy
    import json

    import pytest

    from autotune.costmodel import GRAPHS_BYTES, OS_HEADROOM, predict
    from runtime.budget import DoesNotFit, check_plan, device_bytes
    from runtime.cli.checkpoint import main
    from runtime.profile import load_profile
    from runtime.workload import Workload
    plan = Plan(max_context=65536, prefill_chunk=1024, slot_cache_experts=200, moe_strategy="hybrid",
                host_expert_budget_gib=120, engram_placement="nvme_direct", dspark=True, draft_length=3)
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_dict()))
    assert main(["inspect", str(full_skeleton), "--plan", str(tmp_path / "plan.json"), "--json"]) == 0
    tiers = json.loads(capsys.readouterr().out)["plan_bytes"]
    cpu_host, gpu_host = (sum(tiers[h]["host"].values()) for h in ("cpu_host", "gpu_host"))
    gpu_dev = sum(tiers["gpu_host"]["device"].values())
    from runtime.checkpoint.reader import Checkpoint
    fp = Checkpoint(full_skeleton).footprint()
    gpu = load_profile("profiles/5090-epyc.json")
    cpu = copy.deepcopy(gpu)
    cpu["host"]["hard"].update(gpu_name="", gpu_vram_gib=0)
    wl = Workload(4096, 64)
    assert predict(plan, gpu, fp, wl).memory["host"] == gpu_host + OS_HEADROOM
    assert predict(plan, gpu, fp, wl).memory["vram"] == gpu_dev + GRAPHS_BYTES == device_bytes(plan, fp) + GRAPHS_BYTES
    assert predict(plan.replace(slot_cache_experts=0, moe_strategy="cpu"), cpu, fp, wl).memory["host"] == \
        host_bytes(plan.replace(slot_cache_experts=0, moe_strategy="cpu"), fp, dense_on_host=True) + OS_HEADROOM
    with pytest.raises(DoesNotFit, match=f"keeps {cpu_host / 2**30:.2f} GiB in host RAM"):   # admission: the same figure
        check_plan(plan, fp, available=cpu_host - 1, dense_on_host=True)
    check_plan(plan, fp, available=cpu_host, dense_on_host=True)


def test_the_accountings_shape_constants_are_the_runtimes():
    from kernels.cpu_moe import ROWS_PER_CHUNK
    from kernels.fp8_dense import TILE_ROWS
    from runtime import budget
    from runtime.io_reader import BLOCK
    assert budget.FP8_TILE_ROWS == TILE_ROWS and budget.IO_BLOCK == BLOCK and budget.ROWS_PER_CHUNK == ROWS_PER_CHUNK


@pytest.mark.parametrize("path", ["nvme_mmap", "nvme_direct"])
def test_one_nvme_batch_of_experts_is_alive_at_a_time(tiny_dir, monkeypatch, path):
    """budget.nvme_fetch_bytes counts one batch of NVME_BATCH fetched experts; a prompt chunk that needs
    several batches must drop each bank before the next is read (mini had kept the last one alive
    through the loop's enumerate: +11% anonymous memory over the plan)."""
    import weakref

    import runtime.experts as rx
    monkeypatch.setattr(rx, "NVME_BATCH", 2)
    engine = Engine(tiny_dir, Plan(max_context=128, prefill_chunk=32, host_expert_budget_gib=0.0, expert_nvme_path=path))
    alive, most = [], [0]
    made = rx.Fp4Bank.from_experts.__func__

    def counted(cls, experts):
        bank = made(cls, experts)
        alive.append(weakref.ref(bank.w13_codes))
        most[0] = max(most[0], sum(r() is not None for r in alive))
        return bank
    monkeypatch.setattr(rx.Fp4Bank, "from_experts", classmethod(counted))
    engine.generate(list(range(3, 40)), 3)
    engine.close()
    assert len(alive) > 10                       # many batches were read
    assert most[0] == 1, f"{most[0]} fetched banks alive at once"
