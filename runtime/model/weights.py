"""Dense weights in compute form, and the experts' raw ds_fp4 views.

`load_dense(ck, dtype, device)` returns every non-expert, non-Engram-table tensor by name: fp8 linears
dequantized with the config's block size (the scale tensors are consumed), BF16/F32 as `dtype`.
(On a CUDA device the fp8 weights could stay in fp8 behind kernels.triton_gpu.fp8_block_matmul; the
CPU path dequantizes once at load.) Experts are never dequantized here: `expert_raw` hands the
checkpoint's codes and scales to the placement layer, which builds banks from them.
"""
from __future__ import annotations

import torch

from kernels.formats import dequantize_fp8_block
from runtime.checkpoint.layout import tensor_specs
from runtime.checkpoint.reader import Checkpoint


def load_dense(ck: Checkpoint, dtype=torch.float32, device="cpu") -> dict[str, torch.Tensor]:
    cfg, out = ck.config, {}
    for s in tensor_specs(cfg):
        if s.cls in ("routed_experts", "engram_tables") or ".experts." in s.name or ".shared_experts." in s.name:
            continue
        if s.name.endswith(".scale"):
            continue
        t = ck.tensor(s.name)
        if s.dtype == "F8_E4M3":
            scale = ck.tensor(s.name[:-7] + ".scale")
            t = dequantize_fp8_block(t, scale, cfg.fp8_block, dtype)
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


def expert_span(ck: Checkpoint, prefix: str) -> tuple[str, int, int]:
    """(shard path, offset, length): an expert's six tensors are one contiguous byte range in our
    layout, so the NVMe tier reads an expert with one request to the batched reader."""
    infos = [ck.infos[f"{prefix}.{w}.{k}"] for w in ("w1", "w2", "w3") for k in ("weight", "scale")]
    begin, end = min(i.begin for i in infos), max(i.end for i in infos)
    if end - begin != sum(i.nbytes for i in infos) or len({i.path for i in infos}) != 1:
        raise ValueError(f"expert {prefix} is not one contiguous range in its shard")
    return str(infos[0].path), begin, end - begin
