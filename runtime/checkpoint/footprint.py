"""Footprint: where a checkpoint's bytes sit, from its shard headers (or, for planning without
files, from the layout a config implies). Every figure is a sum over real tensor byte counts or a
stated formula over them; nothing is quoted.

Per-token figures:
  routed_bytes_per_decode_token = K x sum over MoE layers of one expert's bytes      (V4.1: 4.51 GB)
  encoder_pass_bytes            = all routed experts of the encoder layers           (one bounded_replay pass)
  full_pass_bytes               = all routed experts of every layer                  (one `full` prefill pass)
  engram_bytes_per_token        = Engram layers x (max_ngram-1) x heads x row bytes  (V4.1: 12,672 B)
  dense_bytes_per_token         = dense/attention (incl. Engram gate projections) + shared experts +
                                  LM head: what every decoded token reads outside the routed experts
                                  (Engram tables and the drafter excluded)
  widened_bytes                 = {"cpu", "device"}: bytes the runtime holds for the dense path
                                  (dense class + LM head) beyond their stored bytes (`held_bytes`)
  drafter_widened_bytes         = the same for the drafter's dense tensors
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields

from runtime.checkpoint.layout import CLASSES, tensor_specs
from runtime.config import ModelConfig


@dataclass
class Footprint:
    model: str
    geometry_hash: str
    n_tensors: int
    n_shards: int
    total_bytes: int
    bytes_by_class: dict
    routed_bytes_by_layer: list          # [L] all routed experts of layer i
    other_bytes_by_layer: list           # [L] dense + shared of layer i
    expert_bytes: int
    n_routed_experts: int
    n_routed_expert_tensors: int
    routed_expert_bytes_total: int
    routed_bytes_per_decode_token: int
    encoder_pass_bytes: int
    full_pass_bytes: int
    engram_bytes_total: int
    engram_rows_total: int
    engram_row_bytes: int
    engram_bytes_per_token: int
    kv_bytes_per_token: float
    dense_bytes_per_token: int
    drafter_expert_bytes: int
    drafter_dense_bytes: int = 0          # the drafter's non-expert tensors (loaded with the dense weights)
    expert_dtype: str = "fp4"             # the experts' format (runtime/config.py EXPERT_FORMATS)
    # geometry the cost model needs (from the config; kept here so the model needs no torch)
    hidden_size: int = 0
    moe_intermediate_size: int = 0
    num_layers: int = 0
    num_encoder_layers: int = 0
    top_k: int = 0
    window_size: int = 0
    index_ratios: list = field(default_factory=list)    # per index layer: the ratio of the rows it scores
    kv_ratios: list = field(default_factory=list)       # compress ratio of each kv source layer
    kv_lora_rank: int = 0
    num_attention_heads: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    vocab_size: int = 0
    q_lora_rank: int = 0
    engram_floats_per_token: int = 0                    # Engram rows one token reads, as floats (all layers)
    engram_layer_ids: list = field(default_factory=list)
    dspark_num_layers: int = 0
    dspark_n_routed_experts: int = 0
    shared_rides: bool = False                          # the shared expert computed in the routed CPU call (config.py)
    shard_bytes: dict = field(default_factory=dict)   # shard file name -> bytes
    widened_bytes: dict = field(default_factory=lambda: {"cpu": 0, "device": 0})
    drafter_widened_bytes: dict = field(default_factory=lambda: {"cpu": 0, "device": 0})

    @property
    def geometry(self) -> str:
        """Expert geometry label, e.g. '5120x2304' (the CPU-MoE figure is keyed on it)."""
        return f"{self.hidden_size}x{self.moe_intermediate_size}"

    def n_blocks_max(self, context: int) -> int:
        """Largest number of compressed positions any index layer scores at this context."""
        return max((-(-context // r) for r in self.index_ratios), default=0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Footprint":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def build(cls, cfg: ModelConfig, sizes: dict[str, int], shard_bytes: dict | None = None) -> "Footprint":
        """cfg + {tensor name: bytes} (from headers, or from the layout for a config alone)."""
        specs = {s.name: s for s in tensor_specs(cfg)}
        by_class = {c: 0 for c in CLASSES}
        L = cfg.num_hidden_layers
        routed, other = [0] * L, [0] * L
        n_expert_tensors = 0
        per_expert = defaultdict(int)
        for name, nb in sizes.items():
            s = specs[name]
            by_class[s.cls] += nb
            if s.cls == "routed_experts":
                routed[s.layer] += nb
                n_expert_tensors += 1
                per_expert[name.rsplit(".", 2)[0]] += nb   # layers.i.ffn.experts.e
            elif s.layer is not None and s.cls in ("dense", "shared_expert"):   # incl. Engram gate projections
                other[s.layer] += nb
        expert_sizes = set(per_expert.values())
        expert_bytes = max(expert_sizes) if expert_sizes else 0
        drafter_experts = [v for k, v in sizes.items() if k.startswith("mtp.") and ".ffn.experts.0." in k]
        K = cfg.num_experts_per_tok
        enc = cfg.num_encoder_layers
        head = sizes.get("head.weight", 0)
        path = [n for n in sizes if specs[n].cls == "dense" or n == "head.weight"]
        drafter = [n for n in sizes if n.startswith("mtp.") and ".experts." not in n and ".shared_experts." not in n]

        def widened(names):
            return {tier: sum(held_bytes(specs[n], sizes[n], tier == "cpu") - sizes[n] for n in names) for tier in ("cpu", "device")}
        return cls(
            model=cfg.name, geometry_hash=cfg.geometry_hash(), n_tensors=len(sizes), expert_dtype=cfg.expert_dtype,
            n_shards=len(shard_bytes or {}), total_bytes=sum(sizes.values()), bytes_by_class=by_class,
            routed_bytes_by_layer=routed, other_bytes_by_layer=other,
            expert_bytes=expert_bytes, n_routed_experts=cfg.n_routed_experts,
            n_routed_expert_tensors=n_expert_tensors, routed_expert_bytes_total=by_class["routed_experts"],
            routed_bytes_per_decode_token=K * sum(r // cfg.n_routed_experts for r in routed),
            encoder_pass_bytes=sum(routed[:enc]), full_pass_bytes=sum(routed),
            engram_bytes_total=by_class["engram_tables"], engram_rows_total=sum(cfg.engram_num_embeddings),
            engram_row_bytes=cfg.engram_row_bytes,
            engram_bytes_per_token=len(cfg.engram_layer_ids) * cfg.engram_slots * cfg.engram_row_bytes,
            kv_bytes_per_token=cfg.kv_bytes_per_token,
            dense_bytes_per_token=sum(other) + sizes.get("norm.weight", 0) + head,
            drafter_expert_bytes=sum(drafter_experts),
            drafter_dense_bytes=sum(v for k, v in sizes.items() if k.startswith("mtp.") and ".experts." not in k
                                    and ".shared_experts." not in k),
            hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
            num_layers=L, num_encoder_layers=enc, top_k=K, window_size=cfg.window_size,
            index_ratios=[cfg.compress_ratios[cfg.kv_source_of(i)] for i in cfg.index_source_layers],
            kv_ratios=[cfg.compress_ratios[i] for i in cfg.kv_source_layers], kv_lora_rank=cfg.kv_lora_rank,
            num_attention_heads=cfg.num_attention_heads, index_n_heads=cfg.index_n_heads,
            index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, vocab_size=cfg.vocab_size,
            q_lora_rank=cfg.q_lora_rank, engram_floats_per_token=len(cfg.engram_layer_ids) * cfg.engram_slots * cfg.engram_head_dim,
            engram_layer_ids=list(cfg.engram_layer_ids), dspark_num_layers=cfg.dspark_num_layers,
            dspark_n_routed_experts=cfg.dspark_n_routed_experts, shared_rides=cfg.shared_rides,
            shard_bytes=dict(shard_bytes or {}),
            widened_bytes=widened(path), drafter_widened_bytes=widened(drafter),
        )

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "Footprint":
        """The footprint a checkpoint in our layout would have (for planning without the files)."""
        return cls.build(cfg, {s.name: s.nbytes for s in tensor_specs(cfg)})


def held_bytes(spec, nbytes: int, on_cpu: bool) -> int:
    """Bytes the runtime holds for a dense tensor stored in `nbytes` (runtime/model/weights.py
    load_dense, the forms a plan's run uses): fp8 linears, their scales and the embedding table as
    stored; BF16 matrices as stored on the CPU (`Bf16Weight`), float32 copies on a device; BF16 vectors
    (norms) float32; I32 int64; F32 as stored."""
    if spec.dtype == "BF16" and spec.name != "embed.weight" and (len(spec.shape) == 1 or not on_cpu):
        return 2 * nbytes
    return 2 * nbytes if spec.dtype == "I32" else nbytes
