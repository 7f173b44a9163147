"""ModelConfig: the one validated description of a DeepSeek-V4.1-layout model.

Read from a Hugging Face style `config.json` (keys at the top level or nested under `text_config`,
with `quantization_config` at the top level), from a shipped preset (`runtime/presets/*.json`), or
from a checkpoint directory. Every key the runtime and the cost model need is a field here; derived
figures are properties. Unknown keys are ignored (real configs carry many), keys starting with `_`
are comments. Where the sources spell a key two ways the canonical name is the field's name and the
other spelling is accepted as an alias (`kv_source_layer_ids` -> `kv_source_layers`).

Legend for shapes used across the project: H hidden, I expert intermediate, E routed experts,
K experts per token, L layers, W window, C latent (kv_lora_rank), B fp8 block.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

PRESET_DIR = Path(__file__).parent / "presets"
PRESETS = ("deepseek-v4.1-flash", "deepseek-v4-flash", "mini", "tiny")
FP4_GROUP = 32  # ds_fp4: one E8M0 scale per 32 weights along the input dimension


class ConfigError(ValueError):
    """A config key is missing, mistyped or inconsistent; the message names the file and the key."""


# alias -> canonical key
ALIASES = {
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "num_nextn_predict_layers": "dspark_num_layers",
}


def _req(kind, **kw):
    return field(metadata={"kind": kind, "required": True}, **kw)


def _opt(kind, default):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"kind": kind, "required": False})
    return field(default=default, metadata={"kind": kind, "required": False})


# Expert formats V4.1 is published or converted in: format -> (what it stores). The dsv41 runtime's
# kernels run ds_fp4 ("fp4") only; the others are planned (their bytes) for another engine.
EXPERT_FORMATS = {
    "fp4": "ds_fp4: E2M1 codes, one E8M0 scale per 32 (the V4.1 release; the dsv41 kernels)",
    "mxfp4": "OCP MXFP4 / GGUF MXFP4: E2M1 codes, one E8M0 scale per 32 (same bytes as ds_fp4)",
    "nvfp4": "NVFP4: E2M1 codes, one E4M3 scale per 16, one float32 global per row",
    "fp8": "FP8 E4M3 with one float32 scale per 128 x 128 block",
    "bf16": "BF16, unquantized",
}


def expert_format_bytes(fmt: str, H: int, I: int) -> int:
    """Bytes of one expert (w1, w3 [I, H] and w2 [H, I]) in `fmt`; rows = 2I + H."""
    w = 3 * H * I
    if fmt in ("fp4", "mxfp4"):
        return w * 17 // 32
    if fmt == "nvfp4":
        return w // 2 + w // 16 + 4 * (2 * I + H)
    if fmt == "fp8":
        c = lambda a: -(-a // 128)  # noqa: E731
        return w + 4 * (2 * c(I) * c(H) + c(H) * c(I))
    if fmt == "bf16":
        return 2 * w
    raise ValueError(f"expert_dtype '{fmt}' is not one of {', '.join(EXPERT_FORMATS)}")


@dataclass(frozen=True)
class ModelConfig:
    # --- backbone
    vocab_size: int = _req("int")
    hidden_size: int = _req("int")                      # H
    num_hidden_layers: int = _req("int")                # L
    num_encoder_layers: int = _req("int")               # first layers form the causal encoder; 0 = decoder-only (V4)
    moe_intermediate_size: int = _req("int")            # I
    n_routed_experts: int = _req("int")                 # E
    n_shared_experts: int = _req("int")
    num_experts_per_tok: int = _req("int")              # K
    num_attention_heads: int = _req("int")
    q_lora_rank: int = _req("int")
    kv_lora_rank: int = _req("int")                     # C: the compressed latent width (512 in V4.1)
    # --- CSA2 attention
    window_size: int = _req("int")                      # W
    kv_source_layers: list = _req("intlist")
    index_source_layers: list = _req("intlist")
    compress_ratios: list = _req("intlist")             # per layer; 0 = the layer has no compressed KV
    index_topk: int = _req("int")
    index_n_heads: int = _req("int")
    index_head_dim: int = _req("int")
    # --- quantization (from quantization_config + dtype keys)
    weight_block_size: list = _req("intlist")           # [B, B]: 32x32 for V4.1, 128x128 for V4
    scale_fmt: str = _opt("str", "ue8m0")
    dtype: str = _opt("str", "fp8")
    expert_dtype: str = _opt("str", "fp4")
    # --- routing
    n_hash_layers: int = _opt("int", 0)                 # first layers routed by token-id hash (V4-Flash: 3)
    routed_scaling_factor: float = _opt("float", 1.0)
    # --- Engram (empty engram_layer_ids = no Engram)
    engram_layer_ids: list = _opt("intlist", [])
    engram_max_ngram_size: int = _opt("int", 4)
    engram_n_heads: int = _opt("int", 8)
    engram_head_dim: int = _opt("int", 256)
    engram_num_embeddings: list = _opt("intlist", [])   # table rows, one entry per Engram layer
    engram_compressed_vocab_size: int | None = _opt("int?", None)
    # --- DSpark drafter (0 layers = no drafter)
    dspark_num_layers: int = _opt("int", 0)
    dspark_block_size: int = _opt("int", 0)
    dspark_target_layer_ids: list = _opt("intlist", [])
    dspark_n_routed_experts: int = _opt("int", 0)
    # --- misc
    max_position_embeddings: int = _opt("int", 1 << 20)
    rms_norm_eps: float = _opt("float", 1e-6)
    rope_theta: float = _opt("float", 10000.0)
    name: str = _opt("str", "custom")
    source: str = field(default="<dict>", compare=False, metadata={"kind": "internal"})

    def __post_init__(self):
        def bad(key, why):
            raise ConfigError(f"{self.source}: key '{key}' {why}")

        L, H, I = self.num_hidden_layers, self.hidden_size, self.moe_intermediate_size
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "moe_intermediate_size",
                  "n_routed_experts", "num_experts_per_tok", "num_attention_heads", "q_lora_rank",
                  "kv_lora_rank", "window_size", "index_topk", "index_n_heads", "index_head_dim"):
            if getattr(self, k) <= 0:
                bad(k, f"must be positive, got {getattr(self, k)}")
        if H % FP4_GROUP or I % FP4_GROUP:
            bad("hidden_size" if H % FP4_GROUP else "moe_intermediate_size",
                f"must be a multiple of {FP4_GROUP} (one ds_fp4 scale per {FP4_GROUP} inputs)")
        if not 0 <= self.num_encoder_layers < L:
            bad("num_encoder_layers", f"must be in [0, {L}), got {self.num_encoder_layers}")
        if self.num_experts_per_tok > self.n_routed_experts:
            bad("num_experts_per_tok", f"({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})")
        if len(self.compress_ratios) != L:
            bad("compress_ratios", f"has {len(self.compress_ratios)} entries, expected one per layer ({L})")
        for name in ("kv_source_layers", "index_source_layers", "engram_layer_ids", "dspark_target_layer_ids"):
            ids = getattr(self, name)
            if any(not 0 <= i < L for i in ids) or len(set(ids)) != len(ids) or ids != sorted(ids):
                bad(name, f"must be sorted distinct layer ids in [0, {L}), got {ids}")
        for i in self.kv_source_layers + self.index_source_layers:
            if self.compress_ratios[i] <= 0:
                bad("compress_ratios", f"layer {i} is a kv/index source layer but has ratio {self.compress_ratios[i]}")
        missing = [i for i in self.kv_source_layers if i not in self.index_source_layers]
        if missing:
            bad("index_source_layers", f"must include every kv source layer (they write the index keys): missing {missing}")
        if self.kv_source_layers:
            first = self.kv_source_layers[0]
            if self.index_source_layers and self.index_source_layers[0] < first:
                bad("index_source_layers", f"layer {self.index_source_layers[0]} precedes the first kv source layer {first}")
        if len(self.weight_block_size) != 2 or min(self.weight_block_size) <= 0:
            bad("quantization_config.weight_block_size", f"must be two positive ints, got {self.weight_block_size}")
        if self.scale_fmt != "ue8m0":
            bad("quantization_config.scale_fmt", f"'{self.scale_fmt}' is not supported (ue8m0 only)")
        if self.expert_dtype not in EXPERT_FORMATS or self.dtype != "fp8":
            bad("expert_dtype" if self.expert_dtype not in EXPERT_FORMATS else "dtype",
                f"the V4.1 layout needs dtype fp8 and expert_dtype one of {', '.join(EXPERT_FORMATS)}, "
                f"got {self.dtype}/{self.expert_dtype}")
        if not 0 <= self.n_hash_layers <= L:
            bad("n_hash_layers", f"must be in [0, {L}]")
        if self.engram_layer_ids:
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                bad("engram_num_embeddings", f"has {len(self.engram_num_embeddings)} entries for "
                    f"{len(self.engram_layer_ids)} Engram layers")
            if self.engram_max_ngram_size < 2 or self.engram_n_heads <= 0 or self.engram_head_dim % FP4_GROUP:
                bad("engram_max_ngram_size", "needs max n-gram >= 2, heads > 0, head_dim a multiple of 32")
            if min(self.engram_num_embeddings) < self.engram_slots:
                bad("engram_num_embeddings", f"each table needs at least {self.engram_slots} rows")
        if self.dspark_num_layers:
            if self.dspark_block_size <= 0 or not self.dspark_target_layer_ids or self.dspark_n_routed_experts < self.num_experts_per_tok:
                bad("dspark_block_size", "a drafter needs block size > 0, target layers and at least top-k experts")

    # ---------------------------------------------------------------- derived
    @property
    def num_decoder_layers(self) -> int:
        return self.num_hidden_layers - self.num_encoder_layers

    @property
    def fp8_block(self) -> tuple[int, int]:
        return tuple(self.weight_block_size)

    @property
    def head_dim(self) -> int:
        """Query/key width per head: queries are absorbed into the latent (MLA-style), so C."""
        return self.kv_lora_rank

    @property
    def expert_bytes(self) -> int:
        """One routed expert in this config's expert format (EXPERT_FORMATS; fp4 = ds_fp4, codes + E8M0
        scales: 3*H*I*(1/2 + 1/32) B, V4.1: 18,800,640)."""
        return expert_format_bytes(self.expert_dtype, self.hidden_size, self.moe_intermediate_size)

    @property
    def shared_rides(self) -> bool:
        """One shared expert, the routed experts' shape: it rides in the layer's host bank and is computed
        in the routed experts' CPU call (runtime/experts.py); more than one: a call of their own."""
        return self.n_shared_experts == 1

    @property
    def engram_slots(self) -> int:
        """(order, head) pairs per Engram layer: (max_ngram - 1) * heads (V4.1: 24)."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads if self.engram_layer_ids else 0

    @property
    def engram_row_bytes(self) -> int:
        """fp8 codes + one E8M0 scale per 32 (V4.1: 256 + 8 = 264 B)."""
        return self.engram_head_dim + self.engram_head_dim // FP4_GROUP

    def layer_mode(self, i: int) -> str:
        """CSA2 per-layer mode: 'window' (no global attention yet), 'full' (writes the latent and
        index keys), 'reindex' (new index keys over the shared latent), 'reuse' (shares both)."""
        if not self.kv_source_layers or i < self.kv_source_layers[0]:
            return "window"
        if i in self.kv_source_layers:
            return "full"
        return "reindex" if i in self.index_source_layers else "reuse"

    def kv_source_of(self, i: int) -> int | None:
        src = [s for s in self.kv_source_layers if s <= i]
        return src[-1] if src else None

    def index_source_of(self, i: int) -> int | None:
        src = [s for s in self.index_source_layers if s <= i]
        return src[-1] if src else None

    @property
    def kv_bytes_per_token(self) -> float:
        """Persistent global KV per token (formula, our stand-in layout): each kv source layer stores one
        row per `ratio` positions: the latent in FP4 (C/2 B E2M1 codes + C/16 B E4M3 scales, one per 16
        channels) and its index key in fp8 with one fp32 scale (index_head_dim + 4 B). The sliding window
        is rebuilt, not stored. V4.1: (256 + 32 + 64 + 4) B x (1/2 + 1/2 + 1/2 + 1) = 890 B, the card's figure."""
        c = self.kv_lora_rank
        row = c // 2 + c // 16 + self.index_head_dim + 4
        return sum(row / self.compress_ratios[i] for i in self.kv_source_layers)

    def n_blocks(self, context: int, layer: int) -> int:
        """Compressed positions an index layer scores at this context: context / its compress ratio."""
        r = self.compress_ratios[layer]
        return 0 if r <= 0 else -(-context // r)

    def geometry_hash(self) -> str:
        """Hash of every field that shapes the weights or the math (not name/source): a plan made for
        one geometry is refused on another."""
        d = {k: v for k, v in self.to_dict().items() if k not in ("name", "max_position_embeddings")}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    # ---------------------------------------------------------------- io
    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("kind") != "internal"}

    def to_hf_dict(self) -> dict:
        """A Hugging Face style config.json: text_config nested, quantization_config at the top."""
        text = self.to_dict()
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic",
                 "weight_block_size": text.pop("weight_block_size"), "scale_fmt": text.pop("scale_fmt")}
        return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                "dtype": text.pop("dtype"), "expert_dtype": text.pop("expert_dtype"),
                "quantization_config": quant, "text_config": text}

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "<dict>") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        flat = dict(raw.get("text_config") or {}) if isinstance(raw.get("text_config"), dict) else {}
        prefix = "text_config." if flat else ""
        for k, v in raw.items():  # top-level keys fill what text_config lacks
            if k not in ("text_config", "vision_config"):
                flat.setdefault(k, v)
        quant = raw.get("quantization_config", flat.get("quantization_config"))
        if quant is not None:
            if not isinstance(quant, dict):
                raise ConfigError(f"{source}: key 'quantization_config' must be an object")
            for k in ("weight_block_size", "scale_fmt"):
                if k in quant:
                    flat[k] = quant[k]
        for alias, canon in ALIASES.items():
            if alias in flat:
                if canon in flat and flat[canon] != flat[alias]:
                    raise ConfigError(f"{source}: keys '{alias}' and '{canon}' disagree")
                flat.setdefault(canon, flat.pop(alias))
        kw = {}
        for f in dataclasses.fields(cls):
            kind = f.metadata.get("kind")
            if kind == "internal":
                continue
            where = "quantization_config." + f.name if f.name in ("weight_block_size", "scale_fmt") else prefix + f.name
            if f.name not in flat:
                if f.metadata.get("required"):
                    raise ConfigError(f"{source}: key '{where}' is missing")
                continue
            kw[f.name] = _check_type(flat[f.name], kind, where, source)
        return cls(**kw, source=source)

    @classmethod
    def from_json(cls, path) -> "ModelConfig":
        return cls.from_dict(read_json(path, ConfigError, "config file"), source=str(path))

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset '{name}' (known: {', '.join(PRESETS)})")
        return cls.from_json(PRESET_DIR / f"{name}.json").replace(source=f"preset:{name}")


def read_json(path, error: type, what: str):
    """Parse a JSON file; a missing file or bad JSON raises `error` naming the file (and the line)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def _check_type(v, kind, key, source):
    def bad(expected):
        raise ConfigError(f"{source}: key '{key}' must be {expected}, got {json.dumps(v)[:60]}")
    if kind in ("int", "int?"):
        if v is None and kind == "int?":
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            bad("an integer")
        return v
    if kind == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            bad("a number")
        return float(v)
    if kind == "str":
        if not isinstance(v, str):
            bad("a string")
        return v
    if kind == "intlist":
        if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            bad("a list of integers")
        return list(v)
    raise AssertionError(kind)


def load_config(spec) -> ModelConfig:
    """A preset name, a config.json path, or a checkpoint directory holding config.json."""
    p = Path(str(spec))
    if str(spec) in PRESETS and not p.exists():
        return ModelConfig.preset(str(spec))
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ConfigError(f"{spec}: neither a preset ({', '.join(PRESETS)}) nor a config file or checkpoint directory")
    return ModelConfig.from_json(p)
