"""Dense weights in compute form, and the experts' raw ds_fp4 views.

`load_dense(ck, dtype, device, keep_fp8)` returns every non-expert, non-Engram-table tensor by name.
With keep_fp8 fp8 linears stay as stored (1 B per weight + E8M0 block scales): on the CPU an
`Fp8Weight` computed by kernels/fp8_dense.py (numba); with fp8_kernel="triton" (the CUDA path, or CPU
tensors under TRITON_INTERPRET=1 in tests) a `DeviceFp8Weight` on `device`, computed by the Triton
kernel kernels/triton_gpu.py fp8_block_matmul (square blocks; others are dequantized). Without
keep_fp8 (the float64 reference) they are dequantized with the config's block size. BF16/F32 become
`dtype`, except with keep_fp8: the embedding table stays as stored (rows are looked up a few at a
time) and, on the CPU, the BF16 matrices (LM head, routers, indexer head weights) become `Bf16Weight`s
(as stored, 2 B per weight, computed by kernels/bf16_dense.py).
Experts are never dequantized here: `expert_raw` hands the checkpoint's codes and scales to the
placement layer, which builds banks from them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.bf16_dense import Bf16Weight, bf16_linear
from kernels.formats import dequantize_fp8_block
from kernels.fp8_dense import Fp8Weight, fp8_linear
from runtime.checkpoint.layout import tensor_specs
from runtime.checkpoint.reader import Checkpoint


@dataclass(frozen=True)
class DeviceFp8Weight:
    q: torch.Tensor          # float8_e4m3fn [N, K] on the device
    scale: torch.Tensor      # uint8 [ceil(N / B), ceil(K / B)]: E8M0
    block: tuple

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel()


def linear(x: torch.Tensor, w, dtype=torch.float32) -> torch.Tensor:
    """x [T, K] @ W.T for a weight in any form load_dense holds -> `dtype` [T, N]."""
    if isinstance(w, Fp8Weight):                       # fp8 as stored: decoded in the kernel
        return fp8_linear(x, w).to(dtype)
    if isinstance(w, Bf16Weight):                      # BF16 as stored (the CPU): widened in the kernel
        return bf16_linear(x, w).to(dtype)
    if isinstance(w, DeviceFp8Weight):                 # fp8 as stored on the device: the Triton kernel
        from kernels.triton_gpu import fp8_block_matmul
        return fp8_block_matmul(x.to(torch.float32), w.q, w.scale, w.block).to(dtype)
    return x @ w.T


def dense_tensor(w, dtype=torch.float64) -> torch.Tensor:
    """A held weight as a plain `dtype` tensor (offline work: distillation, tests)."""
    if isinstance(w, (Fp8Weight, Bf16Weight)):
        return w.reference(dtype)
    if isinstance(w, DeviceFp8Weight):
        return dequantize_fp8_block(w.q.cpu(), w.scale.cpu(), w.block, dtype)
    return w.to(dtype)


def load_dense(ck: Checkpoint, dtype=torch.float32, device="cpu", keep_fp8: bool = False, fp8_kernel: str = "numba") -> dict:
    cfg, out = ck.config, {}
    triton = keep_fp8 and fp8_kernel == "triton" and cfg.fp8_block[0] == cfg.fp8_block[1]
    for s in tensor_specs(cfg):
        if s.cls in ("routed_experts", "engram_tables") or ".experts." in s.name or ".shared_experts." in s.name:
            continue
        if s.name.endswith(".scale"):
            continue
        t = ck.tensor(s.name)
        if s.dtype == "F8_E4M3" and triton:            # as stored, on the device
            out[s.name] = DeviceFp8Weight(t.to(device, copy=True), ck.tensor(s.name[:-7] + ".scale").to(device, copy=True),
                                          tuple(cfg.fp8_block))
            continue
        if s.dtype == "F8_E4M3" and keep_fp8 and fp8_kernel == "numba":   # anonymous copies, as stored (not the mapping)
            out[s.name] = Fp8Weight(np.array(ck.raw(s.name)).reshape(s.shape), np.array(ck.raw(s.name[:-7] + ".scale"))
                                    .reshape(ck.infos[s.name[:-7] + ".scale"].shape), tuple(cfg.fp8_block))
            continue
        if s.dtype == "F8_E4M3":
            scale = ck.tensor(s.name[:-7] + ".scale")
            t = dequantize_fp8_block(t, scale, cfg.fp8_block, dtype)
        elif s.name == "embed.weight" and keep_fp8:    # looked up a few rows at a time: kept as stored
            t = t.clone()
        elif s.dtype == "BF16" and len(s.shape) == 2 and keep_fp8 and fp8_kernel == "numba":
            out[s.name] = Bf16Weight.from_tensor(t)     # as stored: the BF16 GEMV reads 2 B per weight
            continue
        elif s.dtype == "I32":
            t = t.to(torch.int64)
        else:
            t = t.to(dtype)
        out[s.name] = t.to(device)
    return out


def expert_raw(ck: Checkpoint, prefix: str) -> dict:
    """{w1, w2, w3: (codes u8 [out, in/2], scales u8 [out, in/32])} for one expert (numpy views)."""
    return {w: (ck.tensor(f"{prefix}.{w}.weight").numpy(), ck.tensor(f"{prefix}.{w}.scale").numpy())
            for w in ("w1", "w2", "w3")}


EXPERT_PARTS = tuple((w, k) for w in ("w1", "w2", "w3") for k in ("weight", "scale"))


def expert_span(ck: Checkpoint, prefix: str) -> tuple[str, int, int]:
    """(shard path, offset, length): the byte range covering an expert's six tensors, so the NVMe tier
    reads an expert with one request to the batched reader. Any order of the tensors in the shard is
    fine (they are sliced by their own header offsets, `expert_from_span`); all six must share a shard
    and the range may hold at most as many foreign bytes as the expert's own."""
    infos = [ck.infos[f"{prefix}.{w}.{k}"] for w, k in EXPERT_PARTS]
    begin, end = min(i.begin for i in infos), max(i.end for i in infos)
    own = sum(i.nbytes for i in infos)
    if len({i.path for i in infos}) != 1 or end - begin > 2 * own:
        raise ValueError(f"expert {prefix}: its tensors are spread over shards or far apart in "
                         f"{infos[0].path.name}; the NVMe expert tier reads an expert as one range")
    return str(infos[0].path), begin, end - begin


def expert_from_span(ck: Checkpoint, prefix: str, blob, begin: int) -> dict:
    """expert_raw's dict from the bytes of `expert_span` (read from file offset `begin`): each tensor
    sliced at its own header offset and shaped by its own header shape."""
    out = {}
    for w, k in EXPERT_PARTS:
        i = ck.infos[f"{prefix}.{w}.{k}"]
        shape = (i.shape[0], i.shape[1] // 2) if i.dtype == "F4" else i.shape      # packed codes: 2 per byte
        out.setdefault(w, [None, None])[k == "scale"] = blob[i.begin - begin:i.end - begin].reshape(shape)
    return {w: tuple(v) for w, v in out.items()}
