"""dsv41-tune export: every plan knob lands in the other engine's launch line or in a comment."""
import json
import shlex

import pytest

from autotune.cli import main as tune_main
from autotune.export import export, render
from runtime.checkpoint.footprint import Footprint
from runtime.config import ModelConfig
from runtime.plan import Plan

CFG = ModelConfig.preset("deepseek-v4.1-flash")
EB = Footprint.from_config(CFG).expert_bytes


def _line(plan, engine, card=31.84):
    words, env, notes = export(plan, CFG, engine, expert_bytes=EB, card_gib=card)
    return words, env, notes, render(words, env, notes, "t")


def _flag(words, name):
    return words[words.index(name) + 1]


@pytest.mark.parametrize("engine", ["sglang", "vllm", "llama.cpp"])
def test_context_and_chunk_always_map_and_the_line_parses(engine):
    plan = Plan(max_context=65536, prefill_chunk=1024, dspark=True, draft_length=3, prefill_mode="bounded_replay",
                engram_placement="nvme_direct", engram_io_depth=32, host_expert_budget_gib=100.0, slot_cache_experts=600,
                moe_strategy="hybrid", cpu_threads=30)
    words, env, notes, text = _line(plan, engine)
    flags = {"sglang": ("--context-length", "--chunked-prefill-size"), "vllm": ("--max-model-len", "--max-num-batched-tokens"),
             "llama.cpp": ("-c", "-ub")}[engine]
    assert _flag(words, flags[0]) == "65536" and _flag(words, flags[1]) == "1024"
    body = " ".join(line.rstrip("\\") for line in text.splitlines() if not line.startswith("#"))
    assert shlex.split(body) == [f"{k}={v}" for k, v in env.items()] + words                 # the printed line is the command
    said = " ".join(words) + " " + " ".join(notes)
    for knob in ("dspark" if engine != "sglang" else "DSPARK", "bounded-replay" if engine != "llama.cpp" else "bounded",
                 "nvme_direct", "host_expert_budget_gib", "600", "cpu_moe_streams", "cpu_moe_inputs",
                 "cpu_moe_fetch"):
        assert knob in said, (engine, knob)


def test_sglang_expresses_dspark_bounded_replay_host_engram_and_vram():
    words, env, notes, _ = _line(Plan(dspark=True, draft_length=4, prefill_mode="bounded_replay", vram_budget_gib=16.0), "sglang")
    assert _flag(words, "--speculative-algorithm") == "DSPARK" and _flag(words, "--speculative-dspark-block-size") == "4"
    assert "--enable-decoder-swa-bounded-replay" in words and env == {}
    assert json.loads(_flag(words, "--engram-config")) == {"placement": "cpu"}
    assert _flag(words, "--mem-fraction-static") == "0.50"
    exact, *_ = _line(Plan(), "sglang")
    assert "--enable-decoder-swa-bounded-replay" not in exact and "--speculative-algorithm" not in exact


@pytest.mark.parametrize("placement", ["nvme_direct", "nvme_mmap"])
def test_sglang_line_for_an_nvme_engram_plan_carries_the_placement_it_needs(placement):
    """SGLang's default keeps the 189 GiB of tables on the GPU; the nearest tier to an NVMe plan is host memory."""
    words, _, notes, _ = _line(Plan(engram_placement=placement), "sglang")
    assert json.loads(_flag(words, "--engram-config"))["placement"] == "cpu"
    assert any(placement in n and "no NVMe tier" in n for n in notes)


def test_vllm_expresses_dspark_and_states_bounded_replay_either_way():
    words, _, notes, _ = _line(Plan(dspark=True, draft_length=3), "vllm")
    assert json.loads(_flag(words, "--speculative-config")) == {"method": "dspark", "num_speculative_tokens": 3}
    assert "--no-swa-bounded-replay" in words and "--swa-bounded-replay" not in words      # exact: explicitly off
    assert not any("dspark" in n for n in notes)
    words, *_ = _line(Plan(prefill_mode="bounded_replay"), "vllm")
    assert "--swa-bounded-replay" in words and "--no-swa-bounded-replay" not in words
    assert "--speculative-config" not in words


def test_llama_cpp_pins_whole_layers_for_the_slot_cache():
    words, *_ = _line(Plan(moe_strategy="cpu"), "llama.cpp")
    assert "--cpu-moe" in words and "--n-cpu-moe" not in words
    three_layers = 3 * CFG.n_routed_experts + 5
    words, _, notes, _ = _line(Plan(moe_strategy="offload", slot_cache_experts=three_layers, cpu_threads=12), "llama.cpp")
    assert _flag(words, "--n-cpu-moe") == str(CFG.num_hidden_layers - 3) and _flag(words, "-t") == "12"
    assert any("3 layers of experts on the GPU" in n for n in notes)


def test_vllm_offload_size_counts_the_experts_not_in_slots():
    words, *_ = _line(Plan(moe_strategy="offload", slot_cache_experts=0), "vllm")
    total = CFG.num_hidden_layers * CFG.n_routed_experts * EB
    assert abs(int(_flag(words, "--cpu-offload-gb")) - total / 2**30) <= 1


def test_cli_prints_the_shipped_plan_and_refuses_another_geometry(shipped, capsys):
    assert tune_main(["export", "--profile", str(shipped), "--to", "sglang"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# sglang launch line") and "# not expressible:" in out
    assert tune_main(["export", "--profile", str(shipped), "--to", "vllm", "--config", "tiny"]) == 2
    assert "geometry" in capsys.readouterr().err
