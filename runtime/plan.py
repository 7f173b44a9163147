"""Plan: the execution plan the search produces and the runtime consumes (an immutable value).

A plan file is exactly the `plan` member of a profile (docs/profile-schema.md). Every knob is a field
with its default here, the one source of truth (CLIs read their defaults from this class). Knobs
marked exact never change greedy output; `prefill_mode = "bounded_replay"` is the opt-in that does
(the decoder replays only the last window of the prompt) and is chosen only when inexact prefill is
allowed.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

STRATEGIES = ("cpu", "offload", "hybrid")
PLACEMENTS = ("host", "nvme_direct", "nvme_mmap")
NVME_PATHS = ("nvme_direct", "nvme_mmap")
PREFILL_MODES = ("full", "bounded_replay")
PREFILL_MOE_PATHS = ("cpu", "device")
IO_ENGINES = ("auto", "uring", "aio", "threads")   # the batched reader's (runtime/io_reader.py); auto: the first of
                                                     # the others, in this order, that the kernel opens


class PlanError(ValueError):
    """A plan field is out of range or inconsistent; the message names the field."""


@dataclass(frozen=True)
class Plan:
    moe_strategy: str = "cpu"             # cpu: misses computed on the CPU; offload: gathered to the device; hybrid: split
    fetch_fraction: float = 0.5           # hybrid: share of each layer's misses gathered to the device
    slot_cache_experts: int = 0           # device slot cache size (experts, all layers together), LRU
    cpu_threads: int = 0                  # CPU-MoE threads; 0 = one per physical core
    cpu_moe_streams: int = 1              # DRAM streams per CPU-MoE thread: 1 (rows in order) | 4 (four rows apart); exact.
                                          # The default where the host was not measured (kernels/cpu_moe.py DEFAULT_STREAMS)
    cpu_moe_inputs: int = 4               # the most inputs one CPU-MoE row decode serves: 4 | 8 (rows in order only); exact.
                                          # The default where the host was not measured (kernels/cpu_moe.py DEFAULT_INPUTS)
    cpu_moe_fetch: str = "far"            # how one input's CPU-MoE calls fetch weights: far | near (kernels/fp4_lanes.py
                                          # FETCHES; the lanes paths); exact. The default where not measured (DEFAULT_FETCH)
    host_expert_budget_gib: float | None = None   # routed experts kept in host RAM; None = all; the rest on NVMe
    expert_nvme_path: str = "nvme_direct"  # experts beyond the budget: O_DIRECT batched reads | nvme_mmap: page cache
    prefill_chunk: int = 512              # prompt tokens per prefill chunk
    prefill_mode: str = "full"            # full (exact) | bounded_replay (inexact opt-in)
    prefill_moe_path: str = "cpu"         # cpu: compute on the CPU; device: stream the banks to the device (runtime/staging.py)
    prefill_buffer_mib: int = 0           # its device staging buffer (whole experts; >= one with prefill_moe_path device)
    max_context: int = 32768              # KV pool (tokens)
    vram_budget_gib: float | None = None  # enforced; None = the device's memory
    engram_placement: str = "host"        # host | nvme_direct | nvme_mmap
    engram_io_depth: int = 8              # outstanding Engram reads
    engram_io_engine: str = "auto"        # nvme_direct: the reader's engine (uring | aio | threads; auto: io_uring, else
                                          # kernel AIO, else threads); exact. The tuner puts the host's fastest at the depth
    engram_row_cache_mib: int = 0         # host row cache in front of NVMe reads
    engram_scales_in_ram: bool = True     # keep the 8 B/row scales resident: one read per row instead of two
    dspark: bool = False                  # speculative decoding with the DSpark drafter
    draft_length: int = 2                 # draft tokens per step when dspark is on
    max_num_seqs: int = 1                 # sequences served together (continuous batching, runtime/scheduler.py)
    max_batched_tokens: int = 0           # tokens per step (decode tokens + prompt chunks); 0 = prefill_chunk
    geometry_hash: str = ""               # the model geometry this plan was made for ("" = unbound)

    def __post_init__(self):
        def bad(field, why):
            raise PlanError(f"plan field '{field}' {why}")
        for name, allowed in (("moe_strategy", STRATEGIES), ("engram_placement", PLACEMENTS),
                              ("expert_nvme_path", NVME_PATHS), ("prefill_mode", PREFILL_MODES),
                              ("prefill_moe_path", PREFILL_MOE_PATHS), ("engram_io_engine", IO_ENGINES)):
            if getattr(self, name) not in allowed:
                bad(name, f"must be one of {allowed}, got {getattr(self, name)!r}")
        if self.cpu_moe_streams not in (1, 4):
            bad("cpu_moe_streams", f"must be 1 or 4, got {self.cpu_moe_streams}")
        if self.cpu_moe_inputs not in (4, 8):
            bad("cpu_moe_inputs", f"must be 4 or 8, got {self.cpu_moe_inputs}")
        if self.cpu_moe_fetch not in ("far", "near"):
            bad("cpu_moe_fetch", f"must be 'far' or 'near', got {self.cpu_moe_fetch!r}")
        if self.cpu_moe_inputs == 8 and self.cpu_moe_streams != 1:
            bad("cpu_moe_inputs", "8 needs cpu_moe_streams = 1 (rows in order); four rows apart always decode for 4 inputs")
        if not 0.0 <= self.fetch_fraction <= 1.0:
            bad("fetch_fraction", f"must be in [0, 1], got {self.fetch_fraction}")
        for name in ("slot_cache_experts", "cpu_threads", "prefill_buffer_mib", "engram_row_cache_mib"):
            if getattr(self, name) < 0:
                bad(name, f"must be >= 0, got {getattr(self, name)}")
        if self.max_batched_tokens < 0:
            bad("max_batched_tokens", f"must be >= 0 (0: the prefill chunk), got {self.max_batched_tokens}")
        for name in ("prefill_chunk", "max_context", "engram_io_depth", "max_num_seqs"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.dspark and not 1 <= self.draft_length <= 16:
            bad("draft_length", f"must be in [1, 16] with dspark on, got {self.draft_length}")
        for name in ("host_expert_budget_gib", "vram_budget_gib"):
            v = getattr(self, name)
            if v is not None and v < 0:
                bad(name, f"must be >= 0 or null, got {v}")

    @property
    def exact(self) -> bool:
        return self.prefill_mode == "full"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **kw) -> "Plan":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> "Plan":
        if not isinstance(d, dict):
            raise PlanError(f"{source}: a plan must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise PlanError(f"{source}: unknown plan field '{unknown[0]}'")
        try:
            return cls(**d)
        except TypeError as e:
            raise PlanError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path) -> "Plan":
        """A plan file, or any JSON object with a `plan` member (a profile, `dsv41-tune plan --json`)."""
        from pathlib import Path
        d = json.loads(Path(path).read_text())
        if isinstance(d, dict) and "plan" in d and "moe_strategy" not in d:
            d = d["plan"]
            if d is None:
                raise PlanError(f"{path}: the file holds no plan")
        return cls.from_dict(d, source=str(path))
