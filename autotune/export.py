"""A dsv41 plan as the launch line of another engine, for the parts that engine can express.

  dsv41-tune export --profile P --to sglang|vllm|llama.cpp [--config PRESET|config.json] [--model-path M]

Each engine gets its own translator: plan + config -> (command words, environment, comments). A
knob with no equivalent is never dropped silently: it becomes a `# not expressible:` comment naming
the knob, its value here and what the engine does instead. An exact plan says so where the engine has
an inexact default-off switch (bounded replay explicitly off). The flags and their meaning follow each
engine's documentation for V4.1 (docs/export.md cites each one); they are a starting point on that
engine, not a measured plan: re-measure there (dsv41-bench --url works against any OpenAI-compatible server).
"""
from __future__ import annotations

import json
import shlex

from runtime.config import ModelConfig
from runtime.plan import Plan

HF_ID = "deepseek-ai/DeepSeek-V4.1-Flash"
GGUF = "DeepSeek-V4.1-Flash-Q2_K-00001-of-00007.gguf"
GIB = 1 << 30


def _common_notes(plan: Plan, notes: list, engine: str) -> None:
    if plan.engram_placement in ("nvme_direct", "nvme_mmap") and engine != "llama.cpp":
        notes.append(f"engram_placement={plan.engram_placement}: {engine} keeps the Engram tables in memory (host or GPU); "
                     f"no NVMe tier, no row cache (engram_row_cache_mib={plan.engram_row_cache_mib}), no I/O depth or engine knob "
                     f"(engram_io_depth={plan.engram_io_depth}, engram_io_engine={plan.engram_io_engine})")
    if plan.host_expert_budget_gib is not None:
        notes.append(f"host_expert_budget_gib={plan.host_expert_budget_gib:.1f} (experts past it read from NVMe, "
                     f"{plan.expert_nvme_path}): {engine} has no NVMe expert tier")


def _kernel_notes(plan: Plan, notes: list, engine: str) -> None:
    if plan.moe_strategy != "offload":
        notes.append(f"cpu_moe_streams={plan.cpu_moe_streams}: dsv41's CPU-MoE row layout measured best on this host (batch 1 and a verify of 8); "
                     f"{engine}'s own CPU kernels pick their access order themselves")
        notes.append(f"cpu_moe_inputs={plan.cpu_moe_inputs}: the most inputs one row decode of dsv41's CPU-MoE kernel "
                     f"serves, measured faster on this host; {engine}'s own CPU kernels block their inputs themselves")
        notes.append(f"cpu_moe_fetch={plan.cpu_moe_fetch}: how dsv41's CPU-MoE kernel prefetches one input's weights, "
                     f"measured faster on this host; {engine}'s own CPU kernels fetch their weights themselves")


def _vram_share(plan: Plan, card_gib: float | None) -> str | None:
    if plan.vram_budget_gib is None or not card_gib:
        return None
    return f"{min(plan.vram_budget_gib / card_gib, 0.95):.2f}"


def sglang(plan: Plan, cfg: ModelConfig, model: str, card_gib: float | None = None):
    words = ["sglang", "serve", "--trust-remote-code", "--model-path", model, "--context-length", str(plan.max_context),
             "--chunked-prefill-size", str(plan.prefill_chunk)]
    env, notes = {}, []
    # SGLang's tables live on the GPU by default; every dsv41 placement keeps them off the GPU, so the line
    # asks for pinned host memory (the GPU reads rows in place). An NVMe plan needs the RAM for the whole
    # table there: SGLang has no NVMe tier (the note below says so).
    words += ["--engram-config", json.dumps({"placement": "cpu"}, separators=(",", ":"))]
    if plan.dspark:
        words += ["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", str(plan.draft_length)]
    if plan.prefill_mode == "bounded_replay":
        words += ["--enable-decoder-swa-bounded-replay"]             # inexact, as in dsv41
    if share := _vram_share(plan, card_gib):
        words += ["--mem-fraction-static", share]
    notes.append(f"moe_strategy={plan.moe_strategy} with {plan.slot_cache_experts} GPU expert slots and {plan.cpu_threads or 'all'} "
                 f"CPU-MoE threads: SGLang computes every expert on the GPU (expert parallelism across GPUs); it has no "
                 f"CPU expert path or slot cache, so the weights must fit the GPUs")
    _common_notes(plan, notes, "SGLang")
    _kernel_notes(plan, notes, "SGLang")
    return words, env, notes


def vllm(plan: Plan, cfg: ModelConfig, model: str, expert_bytes: int, card_gib: float | None = None):
    # Engram placement host is vLLM's default (pinned host memory, read over UVA): no flag
    words = ["vllm", "serve", model, "--max-model-len", str(plan.max_context), "--enable-chunked-prefill",
             "--max-num-batched-tokens", str(plan.prefill_chunk)]
    env, notes = {}, []
    if share := _vram_share(plan, card_gib):
        words += ["--gpu-memory-utilization", share]
    if plan.moe_strategy in ("offload", "hybrid"):
        host = (cfg.num_hidden_layers * cfg.n_routed_experts - plan.slot_cache_experts) * expert_bytes
        words += ["--cpu-offload-gb", str(max(1, round(host / GIB)))]
        notes.append(f"moe_strategy={plan.moe_strategy}: --cpu-offload-gb streams the offloaded weights over PCIe on every "
                     f"forward pass (no LRU slot cache of {plan.slot_cache_experts} experts, no CPU compute)")
    else:
        notes.append(f"moe_strategy=cpu ({plan.cpu_threads or 'all'} threads): vLLM does not compute experts on the CPU; "
                     f"the closest is --cpu-offload-gb, which streams them to the GPU instead")
    if plan.dspark:                                    # the draft ships in the checkpoint (mtp.{0,1,2}.*): no model path
        words += ["--speculative-config", json.dumps({"method": "dspark", "num_speculative_tokens": plan.draft_length},
                                                     separators=(",", ":"))]
    # CacheConfig.swa_bounded_replay: inexact like dsv41's bounded_replay; an exact plan turns it off explicitly
    words += ["--swa-bounded-replay" if plan.prefill_mode == "bounded_replay" else "--no-swa-bounded-replay"]
    _common_notes(plan, notes, "vLLM")
    _kernel_notes(plan, notes, "vLLM")
    return words, env, notes


def llama_cpp(plan: Plan, cfg: ModelConfig, model: str):
    words = ["llama-server", "-m", model, "-ngl", "99", "-c", str(plan.max_context), "-b", str(plan.prefill_chunk),
             "-ub", str(plan.prefill_chunk), "-fa", "on"]
    env, notes = {}, []
    if plan.cpu_threads:
        words += ["-t", str(plan.cpu_threads)]
    gpu_layers = min(plan.slot_cache_experts // cfg.n_routed_experts, cfg.num_hidden_layers)
    if plan.moe_strategy == "cpu" or gpu_layers == 0:
        words += ["--cpu-moe"]
    else:
        words += ["--n-cpu-moe", str(cfg.num_hidden_layers - gpu_layers)]
    notes.append(f"{plan.slot_cache_experts} expert slots (LRU, any layer): llama.cpp pins whole layers instead; "
                 f"{'no layer fits' if gpu_layers == 0 else f'{gpu_layers} layers of experts on the GPU'}, the rest on the CPU"
                 + (f"; moe_strategy={plan.moe_strategy} (fetch fraction {plan.fetch_fraction:.2f}): llama.cpp computes "
                    f"CPU-resident experts on the CPU, it does not gather them" if plan.moe_strategy != "cpu" else ""))
    words += ["-ot", "engram_embd.weight=CPU"]                       # the tables stay in host memory
    if plan.engram_placement != "host":
        words += ["-lm", "mmap"]                                      # mapped, rows paged in on demand (the branch's recipe)
    if plan.engram_placement == "nvme_direct":
        notes.append(f"engram_placement=nvme_direct (O_DIRECT, depth {plan.engram_io_depth} through "
                     f"{plan.engram_io_engine}, row cache "
                     f"{plan.engram_row_cache_mib} MiB): llama.cpp only maps the tables (page cache)")
    if plan.dspark:
        notes.append(f"dspark (draft length {plan.draft_length}): the V4.1 branch has no DSpark drafter (one contributor's port only)")
    if plan.prefill_mode == "bounded_replay":
        notes.append("prefill_mode=bounded_replay: not in llama.cpp (full prefill)")
    _kernel_notes(plan, notes, "llama.cpp")
    if plan.host_expert_budget_gib is not None:
        notes.append(f"host_expert_budget_gib={plan.host_expert_budget_gib:.1f}: llama.cpp maps the file; experts past RAM "
                     f"are paged from disk by the kernel, not read in batches")
    return words, env, notes


ENGINES = ("sglang", "vllm", "llama.cpp")


def export(plan: Plan, cfg: ModelConfig, engine: str, model_path: str | None = None, expert_bytes: int = 0,
           card_gib: float | None = None):
    """-> (words, env, notes) for `engine`."""
    if engine == "sglang":
        return sglang(plan, cfg, model_path or HF_ID, card_gib)
    if engine == "vllm":
        return vllm(plan, cfg, model_path or HF_ID, expert_bytes, card_gib)
    if engine == "llama.cpp":
        return llama_cpp(plan, cfg, model_path or GGUF)
    raise ValueError(f"--to must be one of {ENGINES}, got {engine!r}")


def render(words, env, notes, header: str) -> str:
    lines = [f"# {header}"]
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    cmd, i = [], 0
    while i < len(words):                                   # one flag (with its value) per line
        if i + 1 < len(words) and words[i].startswith("-") and not words[i + 1].startswith("-"):
            cmd.append(f"{words[i]} {shlex.quote(words[i + 1])}")
            i += 2
        else:
            cmd.append(shlex.quote(words[i]))
            i += 1
    head = " ".join(cmd[:2] if words[0] != "llama-server" else cmd[:1])
    rest = cmd[2:] if words[0] != "llama-server" else cmd[1:]
    lines.append((prefix + " " if prefix else "") + head + (" \\" if rest else ""))
    lines += [f"  {c}" + (" \\" if k < len(rest) - 1 else "") for k, c in enumerate(rest)]
    lines += [f"# not expressible: {n}" for n in notes]
    return "\n".join(lines)
