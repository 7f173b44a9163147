"""The V4.1 checkpoint layout: every tensor's name, logical shape, safetensors dtype and class.

One function, `tensor_specs(config)`, is the naming scheme; the synthetic writer, the header
validator and the loader all read it, so they cannot disagree. Documented in docs/checkpoint-layout.md.

Dtypes: dense/attention linears F8_E4M3 [out, in] + `.scale` F8_E8M0 [ceil(out/B), ceil(in/B)];
experts (routed and shared) F4 [out, in] (two E2M1 codes per byte, so out*in/2 bytes) + `.scale`
F8_E8M0 [out, in/32]; Engram table codes F8_E4M3 [rows, D] + scales F8_E8M0 [rows, D/32]; norms, router,
embeddings and head BF16; router bias F32; hash-routing table I32. Packed experts stored as U8/I8
[out, in/2] (other converters' habit) are accepted too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from runtime.config import FP4_GROUP, ModelConfig

DTYPE_BYTES = {"F4": 0.5, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "BF16": 2, "F16": 2,
               "F32": 4, "I32": 4, "I64": 8, "F64": 8, "BOOL": 1, "I16": 2, "U16": 2, "U32": 4, "U64": 8}

CLASSES = ("routed_experts", "shared_expert", "dense", "embeddings", "engram_tables", "drafter", "vision")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple
    dtype: str
    cls: str            # one of CLASSES
    layer: int | None   # backbone layer, None for top-level and drafter tensors
    group: str          # shard group: "backbone" or "engram:<layer>"

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return int(n * DTYPE_BYTES[self.dtype])


def _cdiv(a, b):
    return -(-a // b)


class _Builder:
    def __init__(self, cfg: ModelConfig):
        self.cfg, self.specs = cfg, []

    def add(self, name, shape, dtype, cls, layer=None, group="backbone"):
        self.specs.append(TensorSpec(name, tuple(shape), dtype, cls, layer, group))

    def fp8(self, prefix, out, inp, cls, layer=None, group="backbone"):
        bn, bk = self.cfg.fp8_block
        self.add(f"{prefix}.weight", (out, inp), "F8_E4M3", cls, layer, group)
        self.add(f"{prefix}.scale", (_cdiv(out, bn), _cdiv(inp, bk)), "F8_E8M0", cls, layer, group)

    def fp4(self, prefix, out, inp, cls, layer=None):
        self.add(f"{prefix}.weight", (out, inp), "F4", cls, layer)
        self.add(f"{prefix}.scale", (out, inp // FP4_GROUP), "F8_E8M0", cls, layer)

    def expert_linear(self, prefix, out, inp, cls, layer=None):
        """One expert matrix in the config's expert format (runtime/config.py EXPERT_FORMATS)."""
        fmt = self.cfg.expert_dtype
        if fmt in ("fp4", "mxfp4"):
            self.fp4(prefix, out, inp, cls, layer)
        elif fmt == "nvfp4":
            self.add(f"{prefix}.weight", (out, inp), "F4", cls, layer)
            self.add(f"{prefix}.scale", (out, inp // 16), "F8_E4M3", cls, layer)
            self.add(f"{prefix}.scale_2", (out,), "F32", cls, layer)
        elif fmt == "fp8":
            self.add(f"{prefix}.weight", (out, inp), "F8_E4M3", cls, layer)
            self.add(f"{prefix}.scale", (_cdiv(out, 128), _cdiv(inp, 128)), "F32", cls, layer)
        else:
            self.add(f"{prefix}.weight", (out, inp), "BF16", cls, layer)

    def expert(self, prefix, inter, cls, layer=None):
        H = self.cfg.hidden_size
        self.expert_linear(f"{prefix}.w1", inter, H, cls, layer)   # gate  [I, H]
        self.expert_linear(f"{prefix}.w2", H, inter, cls, layer)   # down  [H, I]
        self.expert_linear(f"{prefix}.w3", inter, H, cls, layer)   # up    [I, H]

    def block(self, p, layer, cls_dense, n_experts, index_source, kv_source, expert_cls, hash_routed=False):
        """One transformer block's attention + MoE under prefix p."""
        c = self.cfg
        H, C = c.hidden_size, c.kv_lora_rank
        self.add(f"{p}.attn_norm.weight", (H,), "BF16", cls_dense, layer)
        self.fp8(f"{p}.attn.wq_a", c.q_lora_rank, H, cls_dense, layer)                 # x -> q latent
        self.fp8(f"{p}.attn.wq_b", c.num_attention_heads * C, c.q_lora_rank, cls_dense, layer)
        self.fp8(f"{p}.attn.wkv", C, H, cls_dense, layer)                               # window K=V latent
        self.add(f"{p}.attn.kv_norm.weight", (C,), "BF16", cls_dense, layer)
        if kv_source:
            self.fp8(f"{p}.attn.wkv_c", C, H, cls_dense, layer)                         # compressed latent
            self.fp8(f"{p}.attn.wi_k", c.index_head_dim, H, cls_dense, layer)           # index keys
        if index_source:
            self.fp8(f"{p}.attn.wi_q", c.index_n_heads * c.index_head_dim, c.q_lora_rank, cls_dense, layer)
            self.add(f"{p}.attn.wi_w.weight", (c.index_n_heads, H), "BF16", cls_dense, layer)
        self.fp8(f"{p}.attn.wo", H, c.num_attention_heads * C, cls_dense, layer)
        self.add(f"{p}.ffn_norm.weight", (H,), "BF16", cls_dense, layer)
        if hash_routed:
            self.add(f"{p}.ffn.tid2eid", (c.vocab_size, c.num_experts_per_tok), "I32", cls_dense, layer)
        else:
            self.add(f"{p}.ffn.gate.weight", (n_experts, H), "BF16", cls_dense, layer)
            self.add(f"{p}.ffn.gate.bias", (n_experts,), "F32", cls_dense, layer)
        for e in range(n_experts):
            self.expert(f"{p}.ffn.experts.{e}", c.moe_intermediate_size, expert_cls, layer)
        if c.n_shared_experts:
            self.expert(f"{p}.ffn.shared_experts", c.n_shared_experts * c.moe_intermediate_size,
                        "shared_expert" if expert_cls == "routed_experts" else expert_cls, layer)


_SPEC_CACHE: dict = {}


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of a checkpoint for `cfg`, in write order (backbone first, Engram last).
    Cached per geometry (the full layout has ~95k tensors)."""
    key = json.dumps(cfg.to_dict(), sort_keys=True)
    if key not in _SPEC_CACHE:
        _SPEC_CACHE.clear()
        _SPEC_CACHE[key] = _build_specs(cfg)
    return _SPEC_CACHE[key]


def _build_specs(cfg: ModelConfig) -> list[TensorSpec]:
    b = _Builder(cfg)
    H, V = cfg.hidden_size, cfg.vocab_size
    b.add("embed.weight", (V, H), "BF16", "embeddings")
    for i in range(cfg.num_hidden_layers):
        b.block(f"layers.{i}", i, "dense", cfg.n_routed_experts, i in cfg.index_source_layers,
                i in cfg.kv_source_layers, "routed_experts", hash_routed=i < cfg.n_hash_layers)
    b.add("norm.weight", (H,), "BF16", "dense")
    b.add("head.weight", (V, H), "BF16", "embeddings")
    for k in range(cfg.dspark_num_layers):
        p = f"mtp.{k}"
        if k == 0:  # the first drafter layer fuses the last token's embedding with the target hiddens
            b.add(f"{p}.enorm.weight", (H,), "BF16", "drafter")
            b.add(f"{p}.hnorm.weight", (H,), "BF16", "drafter")
            b.fp8(f"{p}.eh_proj", H, H * (1 + len(cfg.dspark_target_layer_ids)), "drafter")
        b.block(p, None, "drafter", cfg.dspark_n_routed_experts, False, False, "drafter")
    if cfg.dspark_num_layers:
        b.add("mtp.norm.weight", (H,), "BF16", "drafter")
    for rows, i in zip(cfg.engram_num_embeddings, cfg.engram_layer_ids):
        g, D, S = f"engram:{i}", cfg.engram_head_dim, cfg.engram_slots
        b.add(f"layers.{i}.engram.embed.weight", (rows, D), "F8_E4M3", "engram_tables", i, g)
        b.add(f"layers.{i}.engram.embed.scale", (rows, D // FP4_GROUP), "F8_E8M0", "engram_tables", i, g)
        b.fp8(f"layers.{i}.engram.wk", H, S * D, "dense", i, g)   # gate key   [H, 24*D]
        b.fp8(f"layers.{i}.engram.wv", H, S * D, "dense", i, g)   # gate value [H, 24*D]
    return b.specs


SHARD_TARGET_BYTES = 6_750_000_000  # backbone shard size target: the full V4.1 layout lands on 46 + 2 shards


def shard_plan(specs: list[TensorSpec], target: int = SHARD_TARGET_BYTES) -> list[list[TensorSpec]]:
    """Backbone tensors packed in order into shards of about `target` bytes (never splitting a layer's
    expert set across more shards than needed), then one shard per Engram layer, last."""
    backbone = [s for s in specs if s.group == "backbone"]
    total = sum(s.nbytes for s in backbone)
    n = max(1, round(total / target))
    per = total / n
    shards, cur, acc = [], [], 0
    for s in backbone:
        cur.append(s)
        acc += s.nbytes
        if acc >= per * (len(shards) + 1) and len(shards) < n - 1:
            shards.append(cur)
            cur = []
    if cur:
        shards.append(cur)
    groups = []
    for s in specs:
        if s.group != "backbone" and s.group not in groups:
            groups.append(s.group)
    shards += [[s for s in specs if s.group == g] for g in groups]
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"
