"""The one accounting: how many bytes each tier holds for a (plan, footprint), by part (`breakdown`),
as formulas over the checkpoint's real byte counts and the runtime's own allocation shapes; the cost
model, admission, validation, `dsv41-run`, `dsv41-serve` and `dsv41-checkpoint inspect --plan` read it.
Then refuse what does not fit, before loading anything: the request against the plan's context, the
device bytes against the VRAM budget, the host bytes against this host's available RAM. Every
refusal names the budget and the shortfall. Torch-free (the cost model imports it); the runtime's
shape constants below are mirrored where they act and tests hold them equal."""
from __future__ import annotations

from hostinfo import ram_available_bytes
from runtime.checkpoint.footprint import Footprint
from runtime.plan import Plan

GIB = 1 << 30
IO_BLOCK = 4096       # an O_DIRECT read's unit (runtime/io_reader.py BLOCK)
READ_ARENA_BYTES = 1 << 20   # a thread's reusable O_DIRECT read buffer (runtime/io_reader.py), reads up to this size
READ_ARENA_THREADS = 2       # threads that read through one reader: the forward's and its worker's (or prefetch's)
NVME_BATCH = 16       # NVMe-tier experts a call reads at once (runtime/experts.py): V4.1, 301 MB
Q_BLOCK = 64          # attention queries per block (runtime/model/attention.py)
FP8_TILE_ROWS = 256   # rows of an fp8 weight dequantized at once at prefill widths (kernels/fp8_dense.py TILE_ROWS)
ROWS_PER_CHUNK = 64   # rows of a CPU-MoE work item (kernels/cpu_moe.py ROWS_PER_CHUNK)
TILE_ELEMS = 1 << 24  # the indexer's relu tile [T, Hi, t]: t = TILE_ELEMS // (T Hi) keys at a time (64 MiB fp32)


class DoesNotFit(ValueError):
    pass


# ---------------------------------------------------------------- the sequence state and attention
def spare(plan: Plan) -> int:
    """Positions a rollback can take back (DSpark rejects up to draft_length drafts): the rings keep them."""
    return plan.draft_length if plan.dspark else 0


def kv_state_bytes(fp: Footprint, max_context: int, spare: int = 0, itemsize: int = 4) -> int:
    """What runtime/model/kv.py SeqState.new allocates: per kv source layer max_context // r rows of
    (C/2 + C/16 + Di + 4) B (-> Footprint.kv_bytes_per_token per token), per layer a window ring of
    R = window - 1 + spare keys and values (2 C floats) and positions (8 B), per source a tail ring of
    r + spare per-position latents and index keys ((C + Di) floats) and positions."""
    C, Di, R = fp.kv_lora_rank, fp.index_head_dim, fp.window_size - 1 + spare
    rows = sum((max_context // r) * (C // 2 + C // 16 + Di + 4) for r in fp.kv_ratios)
    rings = fp.num_layers * R * (2 * C * itemsize + 8)
    tails = sum((r + spare) * ((C + Di) * itemsize + 8) for r in fp.kv_ratios)
    return rows + rings + tails


def key_tile(T: int, heads: int, n: int) -> int:
    """Index keys scored at once by T queries of `heads` index heads: the relu tile stays TILE_ELEMS."""
    return min(n, max(1, TILE_ELEMS // (T * heads)))


def indexer_chunk_bytes(fp: Footprint, T: int, end: int, itemsize: int = 4) -> int:
    """The indexer's live bytes for T queries ending at position end - 1 (runtime/model/attention.py
    select), the largest over index layers: n = (end - window) // r visible rows. Scoring a tile holds
    score [T, n] + keys [t, Di] + relu [T, Hi, t] + part [T, t] (t = key_tile(T, Hi, n)); the selection
    holds score + idx, ok [T, k] (9 B) + one block's sort, values and int64 order [min(T, Q_BLOCK), n].
    Only the score grows with chunk x context: itemsize B per score (SGLang quotes ~6 B on GPU)."""
    best = 0
    for r in fp.index_ratios:
        n = max(0, (end - fp.window_size) // r)
        if n:
            t, k = key_tile(T, fp.index_n_heads, n), min(fp.index_topk, n)
            tile = (t * fp.index_head_dim + T * fp.index_n_heads * t + T * t) * itemsize
            sort = 9 * T * k + min(T, Q_BLOCK) * n * (itemsize + 8)
            best = max(best, T * n * itemsize + max(tile, sort))
    return best


def indexer_peak_bytes(fp: Footprint, chunk: int, prompt_tokens: int, itemsize: int = 4) -> int:
    """The indexer peak of prefilling `prompt_tokens` in chunks of `chunk` (what a run measures)."""
    return max((indexer_chunk_bytes(fp, min(chunk, prompt_tokens - c), min(c + chunk, prompt_tokens), itemsize)
                for c in range(0, prompt_tokens, chunk)), default=0)


def indexer_bound_bytes(plan: Plan, fp: Footprint) -> int:
    """What the plan budgets: a full chunk (or a DSpark verify pass) ending at max_context bounds every
    chunk of every prompt it admits."""
    return indexer_chunk_bytes(fp, max(plan.prefill_chunk, spare(plan) + 1), plan.max_context)


def attention_scratch_bytes(plan: Plan, fp: Footprint, itemsize: int = 4) -> int:
    """One attention block's temporaries (runtime/model/attention.py attend), chunk and context aside:
    window keys and values [N, C] x 2 with N = (window - 1) + Q_BLOCK + window - 1 (the ring's visible
    positions, gathered: never its spare slots); scores over N + index_topk keys x 3 (scores,
    concatenated, softmax); the block's gathered rows [B, k, C] x 3 (values, roped keys, the rope's
    halves)."""
    B, C, k = Q_BLOCK, fp.kv_lora_rank, fp.index_topk
    N = fp.window_size - 1 + B + fp.window_size - 1
    return (2 * N * C + 3 * B * fp.num_attention_heads * (N + k) + 3 * B * k * C) * itemsize


def decode_scratch_bytes(plan: Plan, fp: Footprint, itemsize: int = 4) -> int:
    """The decode tokens of up to max_num_seqs sequences in one pass (attention.attend_decode), their
    rows held in the forward's buffers (`forward_shared_bytes`): the selected rows' dequantize and
    RoPE temporaries [S, k, C] x 3, the pass's output [S, Hq, C], and one sequence at a time its
    scores and softmax over k + R + 1 rows [Hq, k + R + 1] x 2 and its output [Hq, C]. Never alongside
    `attention_scratch_bytes` (one runs after the other)."""
    S, C, k, Hq = plan.max_num_seqs, fp.kv_lora_rank, fp.index_topk, fp.num_attention_heads
    R = fp.window_size - 1 + spare(plan)
    return (3 * S * k * C + S * Hq * C + 2 * Hq * (k + R + 1) + Hq * C) * itemsize


def moe_scratch_bytes(fp: Footprint, T: int) -> int:
    """kernels/cpu_moe.py expert_ffn for T tokens: A = T (K + 1 where the shared expert rides in the
    call) assignments packed (no padding), inputs [A, H], gate/up [A, 2I], SwiGLU [A, I], down [A, H]
    in float32 + token and k ids (16 B), and a pass's work-item flags (int32, one per ROWS_PER_CHUNK
    rows of each distinct expert's widest matrix)."""
    A = T * (fp.top_k + fp.shared_rides)
    H, I = fp.hidden_size, fp.moe_intermediate_size
    items = min(A, fp.n_routed_experts + fp.shared_rides) * -(-max(2 * I, H) // ROWS_PER_CHUNK)
    return A * ((2 * H + 3 * I) * 4 + 16) + 4 * items


def nvme_fetch_bytes(plan: Plan, fp: Footprint, T: int) -> int:
    """One MoE call's experts read from the NVMe tier (runtime/experts.py _fetch): the bank they are
    copied into, and with nvme_direct the page-aligned read buffer too: the layer's non-resident
    experts, at most T K of them, NVME_BATCH at a time."""
    if plan.host_expert_budget_gib is None or not fp.n_routed_experts:
        return 0
    L, E = fp.num_layers, fp.n_routed_experts
    total = min(L * E, int(plan.host_expert_budget_gib * GIB) // fp.expert_bytes)
    n = min(E - total // L, T * fp.top_k, NVME_BATCH)
    return n * fp.expert_bytes * (2 if plan.expert_nvme_path == "nvme_direct" else 1)


def step_tokens(plan: Plan) -> int:
    """The most tokens one forward runs: a prefill chunk, or a continuous-batching step
    (runtime/scheduler.py: the step's token budget, and at least one token per running sequence, or
    its DSpark verify block of draft_length + 1)."""
    return max(plan.prefill_chunk, plan.max_batched_tokens, plan.max_num_seqs * (spare(plan) + 1))


def kv_states_bytes(plan: Plan, fp: Footprint) -> int:
    """The KV states of every sequence the plan serves at once, each at max_context."""
    return plan.max_num_seqs * kv_state_bytes(fp, plan.max_context, spare(plan))


def forward_shared_bytes(plan: Plan, fp: Footprint, itemsize: int = 4) -> int:
    """What one forward's layers share (runtime/model/transformer.py `fw`): the RoPE tables of its
    positions [T, C/2] x 2 and a decode batch's rows (keys and values [S, k + R + 1, C]: the selected
    rows, then each layer's visible window keys; R = window - 1 + spare ring slots)."""
    S, C, k = max(plan.max_num_seqs, fused_rows(plan)), fp.kv_lora_rank, fp.index_topk
    R = fp.window_size - 1 + spare(plan)
    return step_tokens(plan) * C * itemsize + S * (k + R + 1) * 2 * C * itemsize


def fused_rows(plan: Plan) -> int:
    """The most rows a fused decode step takes (runtime/model/transformer.py `_fused_step`): each running
    sequence's next token, or with DSpark its verify block of draft_length + 1, at most
    decode_layer.MAX_ROWS in all (a wider step takes the unfused path)."""
    from kernels.decode_layer import MAX_ROWS       # here: the kernels bring numba and torch, this module stays light
    return min(plan.max_num_seqs * (spare(plan) + 1), MAX_ROWS)


def decode_work_bytes(plan: Plan, fp: Footprint) -> int:
    """The fused decode's intermediates (runtime/model/decode.py `Work`), held by the model between
    forwards for its last decode width S <= `fused_rows` (rows: tokens and verify blocks), per row: a, m [H],
    q, o [Hq C], ql [q], cw, kn, lat [C], the RoPE tables [C] (cos, sin: C/2 each), qi [Hi Di], wh [Hi],
    ik [Di] floats, ids, wts [K] (12 B) and each index layer's top rows [k] (ids and flags, 9 B). Its
    decode buffers are `forward_shared_bytes`' rows."""
    S = fused_rows(plan)
    H, C, HqC = fp.hidden_size, fp.kv_lora_rank, fp.num_attention_heads * fp.kv_lora_rank
    floats = 2 * H + 2 * HqC + fp.q_lora_rank + 4 * C + fp.index_n_heads * (fp.index_head_dim + 1) + fp.index_head_dim
    return S * (4 * floats + 12 * fp.top_k + 9 * fp.index_topk * len(fp.index_ratios))


def _forward_terms(plan: Plan, fp: Footprint) -> dict:
    """The largest forward's temporaries (T = the prefill chunk, or a DSpark verify pass), by kind:
    residual  the residual stream, its norms and projections (8 [T, max(H, Hq C)] floats), the
              Engram rows prefetched for every layer (float32), the fused decode's held
              intermediates (`decode_work_bytes`), and what the forward's layers share
              (runtime/model/transformer.py): the RoPE tables [T, C] (cos and sin, C/2 each) and a
              decode batch's rows [S, k + R + 1, C] x 2 (keys, values: the selected rows, held
              through the MoE of the layers that reuse them, then each layer's window keys)
    attention the indexer peak + the block scratch (or the batched decode pass's, the larger) + one fp8
              tile of the widest linear and its output
    moe       the MoE kernel's scratch
    logits    [T, V] floats
    io        the NVMe tier's fetched experts, the 4 KiB block each Engram row read (nvme_direct)
    Attention, MoE and logits are never alive together (one is freed before the next starts), but on
    a CPU host their pages are: the allocator keeps a forward's freed temporaries (runtime/memwatch.py
    `keep_freed_memory`), and a phase's blocks that do not fit the holes the last phase left grow the
    heap past them (`transient_bytes`)."""
    T = step_tokens(plan)
    width = max(fp.hidden_size, fp.num_attention_heads * fp.kv_lora_rank, fp.q_lora_rank)
    engram_reads = (T * fp.engram_bytes_per_token // fp.engram_row_bytes * IO_BLOCK
                    if plan.engram_placement == "nvme_direct" and fp.engram_row_bytes else 0)
    return {"residual": (8 * T * width * 4 + T * fp.engram_floats_per_token * 4 + forward_shared_bytes(plan, fp)
                         + decode_work_bytes(plan, fp)),
            "attention": indexer_bound_bytes(plan, fp) + max(attention_scratch_bytes(plan, fp), decode_scratch_bytes(plan, fp))
            + (FP8_TILE_ROWS * width + T * FP8_TILE_ROWS) * 4,
            "moe": moe_scratch_bytes(fp, T), "logits": T * fp.vocab_size * 4,
            "io": nvme_fetch_bytes(plan, fp, T) + engram_reads}


def transient_bytes(plan: Plan, fp: Footprint, where: str = "cpu") -> int:
    """The largest forward's temporaries held by one tier. where: 'cpu' (a CPU host holds them all),
    'device' (a GPU host's device: attention, logits, the MoE it computes), 'host' (a GPU host's RAM:
    the CPU kernel's MoE scratch and the I/O buffers). On the CPU, attention, MoE and logits add up: a
    tiny checkpoint with 1024-wide experts at chunk 512 (tests/runtime/test_planned_vs_measured.py) rose
    48 MB in its forwards' MoE against the MoE's 33 MB and the residual's 2: the attention's 10 MB freed
    just before stayed resident below the MoE's larger blocks (glibc's heap, kept, not trimmed)."""
    f = _forward_terms(plan, fp)
    if where == "cpu":
        return f["residual"] + f["io"] + f["moe"] + f["attention"] + f["logits"]
    if where == "device":
        return f["residual"] + max(f["moe"] if plan.moe_strategy != "cpu" else 0, f["attention"], f["logits"])
    return f["io"] + (f["moe"] if plan.moe_strategy != "offload" else 0)


def device_bytes(plan: Plan, fp: Footprint) -> int:
    """What a GPU host's device holds (breakdown's parts)."""
    return sum(breakdown(plan, fp, on_cpu=False)["device"].values())


def staging_bytes(plan: Plan, fp: Footprint) -> int:
    """The device prefill path's staging buffer, as the runtime allocates it: whole experts."""
    if plan.prefill_moe_path != "device":
        return 0
    return plan.prefill_buffer_mib * (1 << 20) // fp.expert_bytes * fp.expert_bytes


def dense_path_bytes(fp: Footprint, on_cpu: bool = True) -> int:
    """Bytes the runtime's dense path reads per decoded token, shared expert aside: the `dense` class
    and the LM head as held (footprint.held_bytes): fp8 linears as stored; BF16 matrices (head, routers)
    as stored on the CPU (kernels/fp8_dense.py, kernels/bf16_dense.py), float32 copies on a device."""
    head = fp.dense_bytes_per_token - fp.bytes_by_class["shared_expert"] - fp.bytes_by_class["dense"]
    return fp.bytes_by_class["dense"] + head + fp.widened_bytes["cpu" if on_cpu else "device"]


def dense_host_bytes(fp: Footprint, on_cpu: bool = True) -> int:
    """What the runtime holds for the dense part (on the CPU, or `on_cpu` False: on the device, the shared
    experts aside): the path above (the LM head included), the shared experts as stored (ds_fp4 banks)
    and the token embedding table as stored (BF16; rows are converted as they are looked up). The
    `embeddings` class is the table + the head."""
    head = fp.dense_bytes_per_token - fp.bytes_by_class["shared_expert"] - fp.bytes_by_class["dense"]
    return dense_path_bytes(fp, on_cpu) + fp.bytes_by_class["shared_expert"] + fp.bytes_by_class["embeddings"] - head


def drafter_dense_bytes(fp: Footprint, on_cpu: bool = True) -> int:
    """The drafter's dense tensors as held (loaded with the dense weights, wherever they are)."""
    return fp.drafter_dense_bytes + fp.drafter_widened_bytes["cpu" if on_cpu else "device"]


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


def drafter_expert_bytes(plan: Plan, fp: Footprint) -> int:
    """The DSpark drafter's experts (routed and shared, host banks), loaded only when the plan drafts;
    its other tensors load with the dense weights, always."""
    return fp.bytes_by_class["drafter"] - fp.drafter_dense_bytes if plan.dspark else 0


def read_arena_bytes(plan: Plan, fp: Footprint) -> int:
    """The reusable read buffers of the O_DIRECT readers a plan runs (runtime/io_reader.py `reuse`): the
    NVMe expert tier's and Engram's, READ_ARENA_BYTES for each thread that reads through them."""
    readers = (plan.host_expert_budget_gib is not None and plan.expert_nvme_path == "nvme_direct"
               and resident_routed_bytes(plan, fp) < fp.routed_expert_bytes_total)
    readers += bool(fp.engram_rows_total) and plan.engram_placement == "nvme_direct"
    return int(readers) * READ_ARENA_THREADS * READ_ARENA_BYTES


def resident_routed_bytes(plan: Plan, fp: Footprint) -> int:
    """Routed experts in the host banks: all, or whole experts up to host_expert_budget_gib."""
    routed = fp.routed_expert_bytes_total
    if plan.host_expert_budget_gib is None:
        return routed
    return min(routed, int(plan.host_expert_budget_gib * GIB) // fp.expert_bytes * fp.expert_bytes)


def breakdown(plan: Plan, fp: Footprint, on_cpu: bool) -> dict:
    """{'host': {part: bytes}, 'device': {part: bytes}}: every byte a plan's run holds, by tier and
    part. host_bytes and device_bytes are these sums; the cost model, admission, `dsv41-run` and
    `dsv41-checkpoint inspect --plan` all read them from here."""
    host = {"routed experts (host banks)": resident_routed_bytes(plan, fp), "Engram": engram_host_bytes(plan, fp),
            "drafter experts": drafter_expert_bytes(plan, fp), "O_DIRECT read arenas": read_arena_bytes(plan, fp)}
    if on_cpu:
        host.update({"dense, shared experts, embeddings (as held)": dense_host_bytes(fp),
                     "drafter dense": drafter_dense_bytes(fp),
                     "KV states at max_context (max_num_seqs)": kv_states_bytes(plan, fp),
                     "largest forward's temporaries": transient_bytes(plan, fp, "cpu")})
        return {"host": host, "device": {}}
    host.update({"shared experts": fp.bytes_by_class["shared_expert"],
                 "forward temporaries (CPU share)": transient_bytes(plan, fp, "host")})
    device = {"dense (fp8 as stored, BF16 as float32), LM head (float32), embedding table":
              dense_host_bytes(fp, on_cpu=False) - fp.bytes_by_class["shared_expert"],
              "drafter dense": drafter_dense_bytes(fp, on_cpu=False),
              "KV states at max_context (max_num_seqs)": kv_states_bytes(plan, fp),
              "largest forward's temporaries": transient_bytes(plan, fp, "device"),
              "slot cache": plan.slot_cache_experts * fp.expert_bytes,
              "prefill staging buffer": staging_bytes(plan, fp)}
    return {"host": host, "device": device}


def host_bytes(plan: Plan, fp: Footprint, dense_on_host: bool = False) -> int:
    """What the host holds (breakdown's parts): on a CPU host (`dense_on_host`) everything; on a GPU
    host the expert banks, Engram, the drafter's experts and the CPU's share of the temporaries."""
    return sum(breakdown(plan, fp, on_cpu=dense_on_host)["host"].values())


def mapped_bytes(plan: Plan, fp: Footprint) -> int:
    """Checkpoint bytes the runtime reads through its mapping (file-backed, reclaimable page cache):
    all it copies at load, and the tiers it reads through the page cache (nvme_mmap), at most whole;
    the NVMe tiers read with O_DIRECT (nvme_direct) never touch the mapping."""
    skip = (fp.routed_expert_bytes_total - resident_routed_bytes(plan, fp)) if plan.expert_nvme_path == "nvme_direct" else 0
    skip += fp.bytes_by_class["drafter"] - fp.drafter_dense_bytes - drafter_expert_bytes(plan, fp)
    if plan.engram_placement == "nvme_direct":        # the scales kept in RAM are copied through the mapping
        skip += fp.engram_bytes_total - (fp.engram_rows_total * 8 if plan.engram_scales_in_ram else 0)
    return fp.total_bytes - skip


def planned_bytes(plan: Plan, fp: Footprint, on_cpu: bool) -> dict:
    """What a run of this plan adds, per tier: anonymous host RAM, the mapped checkpoint, the device."""
    return {"anon": host_bytes(plan, fp, dense_on_host=on_cpu), "file": mapped_bytes(plan, fp),
            "device": 0 if on_cpu else device_bytes(plan, fp)}


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
