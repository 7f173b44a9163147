"""Routing traces: which experts each MoE layer call read, in the order the runtime read them.

`PlacedExperts.trace` (a RoutingTrace, when recording) gets one entry per routed() call: the layer, the
phase (`prefill` or `decode`, set by the engine) and the ids [T, K] the router chose (hash layers
included). The cost model turns a trace into the slot cache's hit rate for every slot count and the
expected union of experts for c tokens (autotune/routing.py). Saved as .npz: small and exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class RoutingTrace:
    num_layers: int
    n_experts: int
    top_k: int
    geometry_hash: str = ""
    phase: str = "prefill"
    calls: list = field(default_factory=list)      # (layer, phase, ids [T, K] int16)

    def record(self, layer: int, ids: np.ndarray) -> None:
        self.calls.append((int(layer), self.phase, np.asarray(ids, dtype=np.int16).copy()))

    def tokens(self, phase: str) -> int:
        """Tokens routed in `phase` (counted at layer 0's calls)."""
        return sum(len(ids) for layer, ph, ids in self.calls if ph == phase and layer == 0)

    def save(self, path) -> None:
        path = Path(path)
        layers = np.array([c[0] for c in self.calls], np.int32)
        phases = np.array([c[1] == "decode" for c in self.calls], bool)
        lens = np.array([len(c[2]) for c in self.calls], np.int32)
        ids = np.concatenate([c[2] for c in self.calls]) if self.calls else np.zeros((0, self.top_k), np.int16)
        np.savez_compressed(path, layers=layers, decode=phases, lens=lens, ids=ids,
                            shape=np.array([self.num_layers, self.n_experts, self.top_k]),
                            geometry=np.array(self.geometry_hash))

    @classmethod
    def load(cls, path) -> "RoutingTrace":
        try:
            z = np.load(path)
            L, E, K = (int(v) for v in z["shape"])
            t = cls(L, E, K, str(z["geometry"]))
            off = 0
            for layer, dec, n in zip(z["layers"], z["decode"], z["lens"]):
                t.calls.append((int(layer), "decode" if dec else "prefill", z["ids"][off:off + n]))
                off += int(n)
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a routing trace ({e})") from e
        return t
