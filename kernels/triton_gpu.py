"""GPU kernels (Triton): ds_fp4 experts in the device slot cache, and fp8 dense with block scales.

1. `fp4_slot_matmul(x, codes, scales, slots)`: for m = 0..M-1, y[m] = x^[m] @ W_{slots[m]}^T with W in
   ds_fp4 read in place from the slot cache (codes [S, N, K/2] u8, scales [S, N, K/32] u8); x [M, T, K]
   holds the tokens routed to that slot (T = 1 for decode, up to the DSpark block for verify), x^ its
   int8-per-32 quantization (kernels/formats.py). The CPU kernel's arithmetic (kernels/fp4_i8.py): per
   32-block the integer sum of 2 E2M1 x q (two exact float32 dots of 16 products, |.| < 2^17), times
   s/2 x 2^(b - 127) (the scale built in the exponent bits), summed over the blocks in float32. Each
   block's term is the CPU's bit for bit; only the order of the K/32 terms' sum differs.
   Bytes: reads N*K*(1/2 + 1/32) per slot and M*T*K inputs, writes M*T*N.
2. `fp8_block_matmul(x, w, scale, block)`: y = x @ (w * scale)^T with w [N, K] float8_e4m3fn and
   one ue8m0 scale per BxB block (32x32 for V4.1, 128x128 for V4) applied per tile, so the fp8 dense
   weights are never dequantized to bf16 up front. Bytes: N*K (+ N*K/B^2 scales) read once per M tile.

E2M1 decode in-kernel is integer arithmetic (no table gather): 2|v| = m if e == 0 else (2 + m) << (e - 1).
Both kernels run on CPU tensors under TRITON_INTERPRET=1 (how the tests check them here); on a GPU
they are the slot-cache and dense paths. References: kernels.formats.
"""
from __future__ import annotations

import torch

from kernels.formats import act_parts

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install without triton: the GPU path is simply unavailable
    triton = None


if triton is not None:
    @triton.jit
    def _e2m1_x2(c):
        """2 x E2M1 of a code as an exact integer in [-12, 12] (float32), in integer ops alone."""
        c = c.to(tl.int32)
        e = (c >> 1) & 3
        m = c & 1
        mag = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
        return tl.where((c & 8) != 0, -mag, mag).to(tl.float32)

    @triton.jit
    def _e8m0(b):
        return tl.where(b == 255, float("nan"), tl.exp2(b.to(tl.float32) - 127.0))   # 255 is NaN

    @triton.jit
    def _e8m0_bits(b):
        """2^(b - 127) built in the exponent bits, as the CPU kernel builds it (255: NaN; 0 flushes to 0)."""
        bits = tl.where(b == 255, 0x7FC00000, b.to(tl.int32) << 23)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _fp4_slot_kernel(q_ptr, r_ptr, c_ptr, s_ptr, slot_ptr, y_ptr, T, N, K,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
        m = tl.program_id(0)
        pid_n = tl.program_id(1)
        slot = tl.load(slot_ptr + m).to(tl.int64)
        offs_t = tl.arange(0, BLOCK_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_j = tl.arange(0, 16)                                    # code byte within a 32-block
        nmask, tmask = offs_n < N, offs_t < T
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        c_base = c_ptr + slot * N * (K // 2)
        s_base = s_ptr + slot * N * (K // 32)
        q_base = q_ptr + m * T * K
        r_base = r_ptr + m * T * (K // 32)
        for g in range(0, K // 32):                                  # one 32-block of inputs per step
            if GROUP == 0:                                           # rows in order
                c_at = offs_n[:, None] * (K // 2) + g * 16 + offs_j[None, :]
                s_at = offs_n * (K // 32) + g
            else:                                                    # lanes as rows: dword 4g + j/4 of GROUP rows together
                lane = offs_n % GROUP
                c_at = ((offs_n - lane) * (K // 2) + lane * 4)[:, None] + (4 * g + offs_j // 4)[None, :] * (4 * GROUP) + (offs_j % 4)[None, :]
                s_at = (offs_n - lane) * (K // 32) + g * GROUP + lane
            codes = tl.load(c_base + c_at, mask=nmask[:, None], other=0)
            q_even = tl.load(q_base + offs_t[:, None] * K + 32 * g + 2 * offs_j[None, :], mask=tmask[:, None], other=0.0)
            q_odd = tl.load(q_base + offs_t[:, None] * K + 32 * g + 2 * offs_j[None, :] + 1, mask=tmask[:, None], other=0.0)
            lane = tl.dot(q_even, tl.trans(_e2m1_x2(codes & 15)), input_precision="ieee") \
                + tl.dot(q_odd, tl.trans(_e2m1_x2(codes >> 4)), input_precision="ieee")   # [BLOCK_T, BLOCK_N] exact integers
            ws = _e8m0_bits(tl.load(s_base + s_at, mask=nmask, other=127))
            xr = tl.load(r_base + offs_t * (K // 32) + g, mask=tmask, other=0.0)          # s / 2
            acc += lane * (xr[:, None] * ws[None, :])
        ymask = tmask[:, None] & nmask[None, :]
        tl.store(y_ptr + m * T * N + offs_t[:, None] * N + offs_n[None, :], acc, mask=ymask)

    @triton.jit
    def _fp8_block_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, SK,
                          B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, B)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, B):                                    # one scale column per K tile
            kmask = (k0 + offs_k) < K
            x = tl.load(x_ptr + offs_m[:, None] * K + k0 + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & kmask[None, :], other=0.0).to(tl.float32)
            wb = tl.load(w_ptr + offs_n[:, None] * K + k0 + offs_k[None, :],
                         mask=(offs_n[:, None] < N) & kmask[None, :], other=0)
            w = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            sc = tl.load(s_ptr + (offs_n // B) * SK + k0 // B, mask=offs_n < N, other=127)
            w = w * _e8m0(sc)[:, None]
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _require_triton():
    if triton is None:
        raise RuntimeError("triton is not installed: the GPU kernels are unavailable")


def fp4_slot_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor,
                    block_n: int = 32, group: int = 0) -> torch.Tensor:
    """x [M, T, K], codes [S, N, K/2] u8, scales [S, N, K/32] u8, slots [M] -> y [M, T, N] float32, y[m]
    = quantize_act(x[m]) @ W_{slots[m]}^T: x quantized per 32-block (kernels/formats.py act_parts). group:
    the bytes' layout, 0 rows in order, R lanes as rows (kernels/fp4_lanes.py: the CPU banks' layout on
    paths that take it, so a gather copies bytes as they are)."""
    _require_triton()
    M, T, K = x.shape
    S, N, Kh = codes.shape
    if Kh * 2 != K or scales.shape != (S, N, K // 32) or slots.shape != (M,) or K % 32 or (group and N % group):
        raise ValueError(f"fp4_slot_matmul: x {tuple(x.shape)}, codes {tuple(codes.shape)}, "
                         f"scales {tuple(scales.shape)}, slots {tuple(slots.shape)} do not fit")
    q, s = act_parts(x)
    block_t = max(16, triton.next_power_of_2(T))
    y = torch.empty(M, T, N, dtype=torch.float32, device=x.device)
    grid = (M, triton.cdiv(N, block_n))
    _fp4_slot_kernel[grid](q.contiguous(), (s * 0.5).contiguous(), codes.contiguous(), scales.contiguous(),
                           slots.to(torch.int32).contiguous(), y, T, N, K, BLOCK_T=block_t, BLOCK_N=block_n, GROUP=group)
    return y


def fp8_block_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     block_m: int = 16, block_n: int = 32) -> torch.Tensor:
    """x [M, K], w [N, K] float8_e4m3fn, scale [ceil(N/B), ceil(K/B)] u8 ue8m0 -> y [M, N] float32."""
    _require_triton()
    bn, bk = block
    if bn != bk:
        raise ValueError(f"fp8_block_matmul needs square blocks, got {block}")
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or scale.shape != (-(-N // bn), -(-K // bk)):
        raise ValueError(f"fp8_block_matmul: x {tuple(x.shape)}, w {tuple(w.shape)}, scale {tuple(scale.shape)} "
                         f"do not fit {bn}x{bk} blocks")
    block_n = max(block_n, 16)
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _fp8_block_kernel[grid](x.contiguous(), w.contiguous().view(torch.uint8), scale.contiguous(), y, M, N, K,
                            scale.shape[1], B=bn, BLOCK_M=block_m, BLOCK_N=block_n)
    return y
