"""Open a checkpoint directory in the V4.1 layout: index, shard headers, validation, tensor access.

`Checkpoint(dir)` reads `config.json`, `model.safetensors.index.json` and every shard header (never the
weights), and checks them against the layout the config implies: missing or extra tensors, dtypes,
shapes, scale shapes implied by the fp8 block size (a 128x128 checkpoint read with a 32x32 config is
named as such), index entries pointing at missing shards. `tensor(name)` then maps the bytes
zero-copy (numpy memmap -> torch view); nothing is loaded until asked for.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from runtime.checkpoint.footprint import Footprint
from runtime.checkpoint.layout import tensor_specs
from runtime.checkpoint.safetensors_io import CheckpointError, TensorInfo, read_header
from runtime.config import ModelConfig, load_config

INDEX = "model.safetensors.index.json"
TORCH_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.uint8, "U8": torch.uint8, "I8": torch.uint8,
                "F4": torch.uint8, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                "I32": torch.int32, "I64": torch.int64, "F64": torch.float64}


def _block_diagnosis(name, got, out, inp, cfg):
    for b in (16, 32, 64, 128, 256):
        if got == (-(-out // b), -(-inp // b)):
            return (f"tensor '{name}' has scale shape {list(got)}, the {b}x{b} block layout, but the config says "
                    f"weight_block_size {list(cfg.fp8_block)}: a wrong block size would rescale every weight")
    return None


class Checkpoint:
    def __init__(self, root, config: ModelConfig | None = None):
        self.root = Path(root)
        if not self.root.is_dir():
            raise CheckpointError(f"{root}: not a checkpoint directory")
        self.config = config or load_config(self.root)
        idx_path = self.root / INDEX
        try:
            index = json.loads(idx_path.read_text())
            weight_map = index["weight_map"]
        except FileNotFoundError:
            raise CheckpointError(f"{INDEX}: missing in {self.root}") from None
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{INDEX}: malformed ({e})") from None
        self.shards = sorted(set(weight_map.values()))
        self.infos: dict[str, TensorInfo] = {}
        for shard in self.shards:
            if not (self.root / shard).exists():
                raise CheckpointError(f"{INDEX}: lists shard '{shard}', which is absent")
            infos, _ = read_header(self.root / shard)
            for name, info in infos.items():
                if weight_map.get(name) != shard:
                    raise CheckpointError(f"{shard}: holds tensor '{name}', which the index maps to "
                                          f"{weight_map.get(name)!r}")
                self.infos[name] = info
        for name, shard in weight_map.items():
            if name not in self.infos:
                raise CheckpointError(f"{shard}: tensor '{name}' is in the index but not in the shard header")
        self._validate()
        self._maps: dict[Path, np.memmap] = {}

    def _validate(self):
        cfg, specs = self.config, {s.name: s for s in tensor_specs(self.config)}
        for name, spec in specs.items():
            info = self.infos.get(name)
            if info is None:
                raise CheckpointError(f"tensor '{name}' is missing from the checkpoint ({len(self.infos)} tensors found)")
            shard = info.path.name
            if spec.dtype == "F4" and info.dtype in ("U8", "I8"):   # packed-bytes spelling of ds_fp4
                ok = info.shape == (spec.shape[0], spec.shape[1] // 2)
            else:
                ok = info.dtype == spec.dtype and info.shape == spec.shape
            if not ok:
                msg = None
                if name.endswith(".scale") and spec.cls != "routed_experts" and (name[:-6] + ".weight") in specs:
                    w = specs[name[:-6] + ".weight"]
                    if w.dtype == "F8_E4M3" and w.cls != "engram_tables":
                        msg = _block_diagnosis(name, info.shape, *w.shape, cfg)
                raise CheckpointError(f"{shard}: " + (msg or f"tensor '{name}' is {info.dtype}{list(info.shape)}, "
                                                      f"the config implies {spec.dtype}{list(spec.shape)}"))
        extra = sorted(set(self.infos) - set(specs))
        if extra:
            raise CheckpointError(f"{self.infos[extra[0]].path.name}: tensor '{extra[0]}' is not part of the layout "
                                  f"for this config ({len(extra)} unexpected tensors)")

    # ------------------------------------------------------------------ access
    def footprint(self) -> Footprint:
        shard_bytes = {s: (self.root / s).stat().st_size for s in self.shards}
        return Footprint.build(self.config, {n: i.nbytes for n, i in self.infos.items()}, shard_bytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a copy-on-write uint8 memmap view (no copy until written)."""
        info = self.infos.get(name)
        if info is None:
            raise CheckpointError(f"tensor '{name}' is not in this checkpoint")
        mm = self._maps.get(info.path)
        if mm is None:
            mm = self._maps[info.path] = np.memmap(info.path, dtype=np.uint8, mode="c")  # private: writes never reach the file
        return mm[info.begin:info.end]

    def tensor(self, name: str) -> torch.Tensor:
        """Typed torch view: fp8 -> float8_e4m3fn; E8M0 scales and ds_fp4 codes -> uint8 (codes packed
        [out, in/2]); BF16/F32/I32 as themselves. Shares memory with the file mapping (read-only)."""
        info = self.infos[name]
        buf = torch.frombuffer(self.raw(name), dtype=torch.uint8) if info.nbytes else torch.empty(0, dtype=torch.uint8)
        t = buf.view(TORCH_DTYPES[info.dtype])
        shape = (info.shape[0], info.shape[1] // 2) if info.dtype == "F4" else info.shape
        return t.reshape(shape)

    def shard_of(self, name: str) -> Path:
        return self.infos[name].path
