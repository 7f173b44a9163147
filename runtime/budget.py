"""Refuse what does not fit, before loading anything: the request against the plan's context, the
plan's device bytes against its VRAM budget, the host bytes against this host's available RAM.
Every refusal names the budget and the shortfall."""
from __future__ import annotations

from hostinfo import ram_available_bytes
from runtime.checkpoint.footprint import Footprint
from runtime.plan import Plan

GIB = 1 << 30


class DoesNotFit(ValueError):
    pass


def device_bytes(plan: Plan, fp: Footprint) -> int:
    """Dense + embeddings + KV pool + slot cache (+ drafter with DSpark, + the prefill staging buffer
    on the device prefill path): what the device holds."""
    return int(fp.dense_bytes_per_token + fp.bytes_by_class["embeddings"] // 2 + fp.kv_bytes_per_token * plan.max_context
               + plan.slot_cache_experts * fp.expert_bytes + (fp.bytes_by_class["drafter"] if plan.dspark else 0)
               + staging_bytes(plan, fp))


def staging_bytes(plan: Plan, fp: Footprint) -> int:
    """The device prefill path's staging buffer, as the runtime allocates it: whole experts."""
    if plan.prefill_moe_path != "device":
        return 0
    return plan.prefill_buffer_mib * (1 << 20) // fp.expert_bytes * fp.expert_bytes


def dense_path_bytes(fp: Footprint) -> int:
    """Bytes the runtime's CPU dense path reads per decoded token, shared expert aside: the fp8 linears
    as stored (kernels/fp8_dense.py; the `dense` class, whose few BF16 norms and routers count 1x) and
    the other non-expert bytes (LM head, BF16) held as float32, 2x."""
    fp8 = fp.bytes_by_class["dense"]
    return fp8 + 2 * (fp.dense_bytes_per_token - fp.bytes_by_class["shared_expert"] - fp8)


def dense_host_bytes(fp: Footprint) -> int:
    """What the runtime holds in host RAM for the dense part on a CPU host: the path above (the LM head
    included), the shared experts as stored (ds_fp4 banks) and the token embedding table as stored
    (BF16; rows are converted as they are looked up). The `embeddings` class is the table + the head."""
    head = fp.dense_bytes_per_token - fp.bytes_by_class["shared_expert"] - fp.bytes_by_class["dense"]
    return dense_path_bytes(fp) + fp.bytes_by_class["shared_expert"] + fp.bytes_by_class["embeddings"] - head


def engram_host_bytes(plan: Plan, fp: Footprint) -> int:
    """Engram bytes in anonymous host RAM (runtime/engram_store.py): host: the whole tables; nvme_direct:
    the 8 B/row scales when kept in RAM + the row cache; nvme_mmap: none (the page cache serves it)."""
    if not fp.engram_rows_total:
        return 0
    if plan.engram_placement == "host":
        return fp.engram_bytes_total
    if plan.engram_placement == "nvme_direct":
        return (fp.engram_rows_total * 8 if plan.engram_scales_in_ram else 0) + plan.engram_row_cache_mib * (1 << 20)
    return 0


def host_bytes(plan: Plan, fp: Footprint, dense_on_host: bool = False) -> int:
    """Resident routed experts, the shared experts, Engram in RAM, the drafter with DSpark, and (CPU
    hosts: `dense_on_host`) the dense weights as the runtime holds them."""
    routed = fp.routed_expert_bytes_total
    if plan.host_expert_budget_gib is not None:
        routed = min(routed, int(plan.host_expert_budget_gib * GIB) // fp.expert_bytes * fp.expert_bytes)
    engram = engram_host_bytes(plan, fp)
    dense = dense_host_bytes(fp) if dense_on_host else fp.bytes_by_class["shared_expert"]
    return routed + engram + dense + (fp.bytes_by_class["drafter"] if plan.dspark else 0)


def check_request(plan: Plan, prompt_tokens: int, max_tokens: int) -> None:
    need = prompt_tokens + max_tokens
    if need > plan.max_context:
        raise DoesNotFit(f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) = {need} tokens exceed the plan's "
                         f"max_context {plan.max_context} by {need - plan.max_context}")


def check_plan(plan: Plan, fp: Footprint, available: int | None = None, dense_on_host: bool = True) -> None:
    if plan.geometry_hash and plan.geometry_hash != fp.geometry_hash:
        raise DoesNotFit(f"the plan was made for model geometry {plan.geometry_hash}, this checkpoint is {fp.geometry_hash}")
    dev = device_bytes(plan, fp)
    if plan.vram_budget_gib is not None and dev > plan.vram_budget_gib * GIB:
        raise DoesNotFit(f"the plan needs {dev / GIB:.3f} GiB on the device, over its vram_budget_gib "
                         f"{plan.vram_budget_gib} by {(dev - plan.vram_budget_gib * GIB) / GIB:.3f} GiB")
    host = host_bytes(plan, fp, dense_on_host)
    available = ram_available_bytes() if available is None else available
    if host > available:
        raise DoesNotFit(f"the plan keeps {host / GIB:.2f} GiB in host RAM, {available / GIB:.2f} GiB are available: "
                         f"short by {(host - available) / GIB:.2f} GiB (lower host_expert_budget_gib or move Engram to NVMe)")
