"""GPU kernels vs the device's own memory bandwidth, measured in the same run (needs CUDA).

  python benchmarks/gpu_kernels.py [--json]

Device copy bandwidth (a large device-to-device copy: bytes read + written / time) is the roofline;
then the ds_fp4 slot-cache kernel at the V4.1 geometry (decode: 1 token x 6 slots; verify: 5 tokens)
and the fp8 32x32-block matmul at dense shapes (M = 1, 16, 256), each as GB/s of weight bytes and the
ratio to the copy bandwidth. Timing: triton.testing.do_bench (CUDA events, median).
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402,F401  (before torch: it sets the process up for it, kernels/__init__.py)
import torch



def main():
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (this script is for a lent GPU machine)")
        return 0
    import triton.testing
    from kernels.formats import quantize_fp8_block
    from kernels.triton_gpu import fp4_slot_matmul, fp8_block_matmul
    dev, rows = "cuda", []
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    copy_gbs = 2 * src.numel() / ms / 1e6
    print(f"device copy: {copy_gbs:.0f} GB/s")
    H, I, S = 5120, 2304, 64
    codes = torch.randint(0, 256, (S, 2 * I, H // 2), dtype=torch.uint8, device=dev)
    scales = torch.full((S, 2 * I, H // 32), 120, dtype=torch.uint8, device=dev)
    for T in (1, 5):
        x = torch.randn(6, T, H, device=dev)
        slots = torch.arange(6, device=dev, dtype=torch.int32) * 7 % S
        ms = triton.testing.do_bench(lambda: fp4_slot_matmul(x, codes, scales, slots), return_mode="median")
        gbs = 6 * 2 * I * H * 17 / 32 / ms / 1e6
        rows.append({"kernel": "fp4_slot_matmul", "tokens": T, "gbs": gbs, "ratio": gbs / copy_gbs})
    for N, K in ((32768, 1024), (5120, 32768)):
        q, s = quantize_fp8_block(torch.randn(N, K), (32, 32))
        q, s = q.to(dev), s.to(dev)
        for M in (1, 16, 256):
            x = torch.randn(M, K, device=dev)
            ms = triton.testing.do_bench(lambda: fp8_block_matmul(x, q, s, (32, 32)), return_mode="median")
            gbs = N * K * (1 + 1 / 1024) / ms / 1e6
            rows.append({"kernel": "fp8_block_matmul", "shape": f"{M}x{K}x{N}", "gbs": gbs, "ratio": gbs / copy_gbs,
                         "tflops": 2 * M * N * K / ms / 1e9})
    for r in rows:
        print(r)
    print(json.dumps({"copy_gbs": copy_gbs, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
