"""The device prefill path (`prefill_moe_path = "device"`): a wide prefill call streams each layer's
experts through a staging buffer of `prefill_buffer_mib` on the device and computes them there,
instead of on the CPU kernel. The slot cache is left alone (a prefill chunk touches nearly every expert
and would flush the decode working set). On a CUDA host the buffer is device memory (Triton slots);
on a CPU host the same code runs on the stand-in device (numba or Triton slots), which is how it is
tested here.

  buffer experts  n = prefill_buffer_mib MiB // expert_bytes (>= 1, else the plan is refused)
  per layer       ceil(distinct experts / n) rounds: copy n experts in (phase `prefill_stream`),
                  compute them for their tokens (phase `device_moe`), accumulate
"""
from __future__ import annotations

import time

import numpy as np

MIN_TOKENS = 16          # calls with at least this many tokens take the device path (prefill chunks)


class PrefillStream:
    def __init__(self, plan, cfg, device: str, kernel, slot_memory):
        self.n = plan.prefill_buffer_mib * (1 << 20) // cfg.expert_bytes
        if self.n < 1:
            raise ValueError(f"plan field 'prefill_buffer_mib' = {plan.prefill_buffer_mib} holds no expert of "
                             f"{cfg.expert_bytes / 2**20:.3f} MiB: prefill_moe_path 'device' needs at least one")
        self.mem = slot_memory(self.n, cfg.hidden_size, cfg.moe_intermediate_size, device, kernel)

    def wants(self, tokens: int) -> bool:
        return tokens >= MIN_TOKENS

    def run(self, placed, layer: int, x, ids, wts, experts: list) -> np.ndarray:
        """All of `experts` for the call's tokens, n at a time through the buffer. -> y [T, H]"""
        y = np.zeros_like(x)
        for r0 in range(0, len(experts), self.n):
            t0 = time.perf_counter()
            loaded = []                                   # experts in buffer-slot order
            for bank, part, rows in placed._groups(layer, experts[r0:r0 + self.n]):
                for e, r in zip(part, rows):
                    self.mem.put(len(loaded), bank, r)
                    loaded.append(e)
                del bank                      # one NVMe batch alive at a time
            placed.seconds["prefill_stream"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            _, sub_ids, sub_w = placed._subset(x, ids, wts, loaded, list(range(len(loaded))), None)
            y += self.mem.compute(x, sub_ids, sub_w)
            placed.seconds["device_moe"] += time.perf_counter() - t0
        return y
