"""Synthetic checkpoints in the exact V4.1 layout, with random weights (tiny for tests, mini for
benchmarks), and header-only skeletons of the full-size layout.

Each tensor's bytes come from its own generator seeded by (seed, crc32(name)), so the same seed gives
the same bytes whatever the write order. Shards stream tensor by tensor (an Engram table in row
chunks): `mini` never holds more than one expert or 64k table rows in RAM. Weight statistics:
dense fp8 ~ N(0, 1/fan_in) quantized with the config's block scales; ds_fp4 experts are uniform random
E2M1 codes with E8M0 scales chosen so the weight RMS is ~1/sqrt(fan_in) (uniform codes have RMS 2.93),
jittered by +-1 exponent per group; the router bias ~ N(0, router_skew^2) (the routing skew, a
parameter: 0.01 by default, ~uniform routing); Engram rows ~ N(0, 1) quantized per 32 values; norms 1 + N(0, .1);
token embeddings ~ N(0, EMBED_STD^2). EMBED_STD = 3 puts the current token's embedding at about the
size of everything the layers add to the residual stream, so the next token depends strongly, not
only, on the current one (as in text); with N(0, 1) a random target's next token is close to a
random function of the context and no small drafter can predict it (measured on tiny: a fitted
drafter agreed 6% of the time at std 1, 16% at 2, 31% at 3, 39% at 4, on held-out text).
The directory gets config.json (with the derived engram_compressed_vocab_size), tokenizer.json and
model.safetensors.index.json, written last, so an interrupted make leaves no loadable checkpoint.
A drafter is then distilled against the random target (runtime/checkpoint/distill.py), so DSpark's
acceptance is neither ~0 nor ~1.
"""
from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import numpy as np
import torch

from kernels.formats import quantize_fp8_block, quantize_fp8_rows
from runtime.checkpoint.layout import TensorSpec, shard_name, shard_plan, tensor_specs
from runtime.checkpoint.reader import INDEX
from runtime.checkpoint.safetensors_io import ShardWriter
from runtime.config import ModelConfig
from runtime.tokenizer import build_tokenizer, compressed_vocab

E2M1_UNIFORM_RMS = math.sqrt(sum(v * v for v in (0, .5, 1, 1.5, 2, 3, 4, 6)) / 8)   # 2.93
ROW_CHUNK = 65536
EMBED_STD = 3.0
ROUTER_SKEW = 0.01


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def tensor_chunks(spec: TensorSpec, cfg: ModelConfig, seed: int, specs: dict, router_skew: float = ROUTER_SKEW):
    """Yields the tensor's bytes (uint8 arrays) in order."""
    rng, name, shape = _rng(seed, spec.name), spec.name, spec.shape
    if spec.dtype == "F4":                                   # ds_fp4 codes, uniform over the 16 codes
        yield np.frombuffer(rng.bytes(spec.nbytes), dtype=np.uint8)
    elif spec.dtype == "F8_E8M0" and specs[name[:-6] + ".weight"].dtype == "F4":
        fan_in = specs[name[:-6] + ".weight"].shape[1]
        e = 127 + round(math.log2(1 / (math.sqrt(fan_in) * E2M1_UNIFORM_RMS)))
        yield (e + rng.integers(-1, 2, size=spec.nbytes)).astype(np.uint8)
    elif spec.cls == "engram_tables":                        # codes and scales from the same row draws
        base = name.rsplit(".", 1)[0]
        rows, D = specs[base + ".weight"].shape
        for r0 in range(0, rows, ROW_CHUNK):
            n = min(ROW_CHUNK, rows - r0)
            x = torch.from_numpy(_rng(seed, f"{base}@{r0}").standard_normal((n, D), dtype=np.float32))
            q, s = quantize_fp8_rows(x)
            yield _u8(q) if name.endswith(".weight") else s.numpy().reshape(-1)
    elif spec.dtype in ("F8_E4M3", "F8_E8M0"):               # fp8 dense weight and its block scales
        w = specs[name.rsplit(".", 1)[0] + ".weight"]
        wrng = _rng(seed, w.name)
        x = torch.from_numpy(wrng.standard_normal(w.shape, dtype=np.float32) / math.sqrt(w.shape[1]))
        q, s = quantize_fp8_block(x, cfg.fp8_block)
        yield _u8(q) if spec.dtype == "F8_E4M3" else s.numpy().reshape(-1)
    elif spec.dtype == "BF16":
        if name.endswith("norm.weight"):
            x = 1 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        elif name == "embed.weight":
            x = EMBED_STD * rng.standard_normal(shape, dtype=np.float32)
        else:                                                # router, index head weights, LM head
            x = rng.standard_normal(shape, dtype=np.float32) / math.sqrt(shape[-1])
        yield _u8(torch.from_numpy(x).to(torch.bfloat16))
    elif spec.dtype == "F32":                                # router bias: its spread is the routing skew
        yield (router_skew * rng.standard_normal(shape, dtype=np.float32)).view(np.uint8).reshape(-1)
    elif spec.dtype == "I32":                                # hash routing: K distinct experts per token id
        E = cfg.n_routed_experts
        ids = np.stack([rng.permutation(E)[:shape[1]] for _ in range(shape[0])]).astype(np.int32)
        yield ids.view(np.uint8).reshape(-1)
    else:
        raise AssertionError(f"no generator for {spec.dtype} tensor {name}")


def _atomic_write_text(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def make_checkpoint(cfg: ModelConfig, out, seed: int = 0, skeleton: bool = False, progress=None,
                    router_skew: float = ROUTER_SKEW) -> Path:
    """Write a checkpoint for `cfg` into `out`. `progress(bytes_done, bytes_total, shard)` if given.
    `router_skew`: the standard deviation of the routed layers' router bias (recorded in the index's
    metadata); scores are sigmoid(~N(0, 1)), so 0.01 leaves routing ~uniform over experts, 0.1-0.3
    makes some experts popular (measure a value's hit-rate curve with benchmarks/hit_rate.py)."""
    if cfg.expert_dtype != "fp4" and not skeleton:
        raise ValueError(f"expert_dtype '{cfg.expert_dtype}': synthetic weights are generated in ds_fp4 (fp4) only; "
                         "other formats can be written as skeletons (headers only)")
    if not 0 <= router_skew <= 10:
        raise ValueError(f"router_skew must be in [0, 10], got {router_skew}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)                    # not loadable until complete
    if not skeleton:
        tok = build_tokenizer(cfg.vocab_size)
        tok.save(str(out / "tokenizer.json"))
        if cfg.engram_layer_ids:
            cfg = cfg.replace(engram_compressed_vocab_size=int(compressed_vocab(tok).max()) + 1)
    specs = tensor_specs(cfg)
    by_name = {s.name: s for s in specs}
    shards = shard_plan(specs)
    total = sum(s.nbytes for s in specs)
    done, weight_map = 0, {}
    for i, shard in enumerate(shards):
        fname = shard_name(i, len(shards))
        w = ShardWriter(out / fname, [(s.name, s.dtype, s.shape) for s in shard],
                        {"format": "pt", "producer": "dsv41-checkpoint", "seed": str(seed)}, sparse=skeleton)
        for s in shard:
            weight_map[s.name] = fname
            if not skeleton:
                w.write(s.name, tensor_chunks(s, cfg, seed, by_name, router_skew))
                done += s.nbytes
                if progress:
                    progress(done, total, fname)
        w.close()
        if skeleton:
            done += sum(s.nbytes for s in shard)
            if progress:
                progress(done, total, fname)
    _atomic_write_text(out / "config.json", json.dumps(cfg.to_hf_dict(), indent=1))
    index = {"metadata": {"total_size": total, "producer": "dsv41-checkpoint", "seed": seed,
                          "skeleton": skeleton, "router_skew": router_skew}, "weight_map": weight_map}
    _atomic_write_text(out / INDEX, json.dumps(index, indent=0))
    if not skeleton and cfg.dspark_num_layers:
        from runtime.checkpoint.distill import distill_drafter
        _atomic_write_text(out / "dsv41-distill.json", json.dumps(distill_drafter(out), indent=1))
    return out
