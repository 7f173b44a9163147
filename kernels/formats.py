"""Weight formats of the V4.1 checkpoint, with plain-torch reference quantizers and dequantizers.

ds_fp4 (OCP MXFP4): weights [N, K] are stored as E2M1 codes, two per byte (element 2j in the low
nibble, 2j+1 in the high nibble) -> uint8 [N, K/2], plus one E8M0 scale per 32 consecutive inputs ->
uint8 [N, K/32]. An E2M1 code is s|e1 e0|m: values 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives.
E8M0 is a bare biased exponent: 2^(b - 127); b = 255 is NaN.

fp8 dense: e4m3 (torch.float8_e4m3fn, max 448, no inf) with one ue8m0 scale per B x B block of the
[N, K] weight -> scale uint8 [ceil(N/B), ceil(K/B)] (B = 32 for V4.1, 128 for V4).

Expert inputs (`quantize_act`): every ds_fp4 expert product, on every path (the CPU kernel, the device
slot cache, the reference the runtime is tested against), multiplies the weights by its input quantized
per 32-block to int8: a = max |x| over the block (float32), q = clamp(rint(fl32(x * fl32(127 / a))),
-127, 127), x^ = q * fl32(a / 127) (a = 0: q = 0; a non-finite: x^ = NaN). The CPU kernel then sums
weight x q in integers (kernels/fp4_i8.py). Against float inputs this costs ~0.5% relative error per
expert matmul (tests/kernels state the tolerance); it is the same arithmetic for every plan, so plan
knobs stay exact.

NaN / inf: the quantizers refuse non-finite weights (a ValueError naming how many), because a
checkpoint must not contain them; the dequantizers propagate a NaN scale (E8M0 255) as NaN for its
group, as the OCP spec does. Every kernel in this package is tested against these functions.
"""
from __future__ import annotations

import functools

import torch

FP4_GROUP = 32
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float64)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_NAN = 255


def e8m0_to_float(b: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """uint8 biased exponents -> 2^(b-127) (NaN for 255)."""
    x = torch.pow(torch.tensor(2.0, dtype=torch.float64), b.to(torch.float64) - 127.0)
    return torch.where(b == E8M0_NAN, torch.nan, x).to(dtype)


def _check_finite(w: torch.Tensor, what: str):
    bad = (~torch.isfinite(w)).sum().item()
    if bad:
        raise ValueError(f"{what}: {bad} non-finite weights cannot be quantized")


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] float (K % 32 == 0) -> (codes uint8 [..., K/2], scales uint8 [..., K/32]).

    Scale exponent per group = floor(log2(amax)) - 2 (E2M1's emax), so amax/2^e lies in [4, 8) and
    values above 6 saturate; elements round to the nearest E2M1 value, ties to the even code."""
    K = w.shape[-1]
    if K % FP4_GROUP:
        raise ValueError(f"ds_fp4 needs the input dimension to be a multiple of {FP4_GROUP}, got {K}")
    _check_finite(w, "quantize_mxfp4")
    g = w.to(torch.float64).reshape(*w.shape[:-1], K // FP4_GROUP, FP4_GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-300))) - 2, torch.full_like(amax, -127))
    e = e.clamp(-127, 127)
    x = (g / torch.pow(2.0, e)).clamp(-E2M1_MAX, E2M1_MAX)
    mag = E2M1_VALUES[:8].to(x.device)
    d = (x.abs().unsqueeze(-1) - mag).abs()                      # [..., G, 32, 8]
    # nearest magnitude; on a tie prefer the even code (mantissa bit 0)
    tie_break = (torch.arange(8, dtype=torch.float64, device=x.device) % 2) * 1e-12
    code = torch.argmin(d + tie_break, dim=-1).to(torch.uint8)
    code = code | ((x < 0) & (code > 0)).to(torch.uint8) << 3
    code = code.reshape(*w.shape[:-1], K)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (e.squeeze(-1) + 127).to(torch.uint8)
    return packed.contiguous(), scales.contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes uint8 [..., K]."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(codes [..., K/2], scales [..., K/32]) -> w [..., K] in dtype (float64 for references)."""
    vals = E2M1_VALUES.to(dtype=dtype, device=packed.device)[unpack_e2m1(packed).long()]
    s = e8m0_to_float(scales, dtype).repeat_interleave(FP4_GROUP, dim=-1)
    return vals * s


def act_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % 32 == 0) -> (q [..., K], s [..., K/32]), both float32: the int8-per-32 expert
    input's two factors (module docstring), x^ = q * s per block; q integers in [-127, 127] (0 in a
    non-finite block, whose s is NaN), computed in float32 exactly as the CPU kernel computes them."""
    shape = x.shape
    g = x.to(torch.float32).reshape(*shape[:-1], shape[-1] // FP4_GROUP, FP4_GROUP)
    a = g.abs().amax(-1, keepdim=True)
    ok = (a > 0) & torch.isfinite(a)
    inv = torch.where(ok, torch.tensor(127.0, dtype=torch.float32) / torch.where(ok, a, 1.0), 0.0)
    q = torch.where(ok, torch.round(g * inv).clamp(-127, 127), 0.0)
    s = torch.where(ok | (a == 0), a / torch.tensor(127.0, dtype=torch.float32), torch.nan)
    return q.reshape(shape), s[..., 0]


def quantize_act(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K % 32 == 0) -> x^ = q * s in x's dtype (act_parts; products in float64, exact)."""
    q, s = act_parts(x)
    g = q.to(torch.float64).reshape(*x.shape[:-1], -1, FP4_GROUP) * s.to(torch.float64)[..., None]
    return g.reshape(x.shape).to(x.dtype)


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q float8_e4m3fn [N, K], scale uint8 ue8m0 [ceil(N/Bn), ceil(K/Bk)]).

    Block scale = 2^ceil(log2(amax / 448)) so the block fits e4m3 without saturation."""
    _check_finite(w, "quantize_fp8_block")
    bn, bk = block
    N, K = w.shape
    gn, gk = -(-N // bn), -(-K // bk)
    pad = torch.zeros(gn * bn, gk * bk, dtype=torch.float64)
    pad[:N, :K] = w.to(torch.float64)
    blocks = pad.reshape(gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax.clamp_min(1e-300) / E4M3_MAX)), torch.full_like(amax, -127))
    e = e.clamp(-127, 127)
    s = torch.pow(2.0, e)
    q = (blocks / s[:, None, :, None]).reshape(gn * bn, gk * bk)[:N, :K]
    return q.to(torch.float32).to(torch.float8_e4m3fn), (e + 127).to(torch.uint8)


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype=torch.float32) -> torch.Tensor:
    """(q float8_e4m3fn [N, K], scale uint8 [ceil(N/Bn), ceil(K/Bk)]) -> w [N, K]."""
    bn, bk = block
    N, K = q.shape
    expect = (-(-N // bn), -(-K // bk))
    if tuple(scale.shape) != expect:
        raise ValueError(f"fp8 scale shape {tuple(scale.shape)} does not match weight {N}x{K} "
                         f"with {bn}x{bk} blocks (expected {expect})")
    s = e8m0_to_float(scale, dtype)
    s = s.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return q.to(dtype) * s


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, D] -> (q float8_e4m3fn [R, D], scale uint8 ue8m0 [R, D/32]): one scale per 32 values of a
    row (the Engram table layout: codes [rows, 256] + scales [rows, 8])."""
    R, D = x.shape
    if D % FP4_GROUP:
        raise ValueError(f"row width must be a multiple of {FP4_GROUP}, got {D}")
    _check_finite(x, "quantize_fp8_rows")
    g = x.to(torch.float32).reshape(R, D // FP4_GROUP, FP4_GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax.clamp_min(1e-30) / E4M3_MAX)), torch.full_like(amax, -127))
    e = e.clamp(-127, 127)
    q = (g / torch.pow(2.0, e)).reshape(R, D).to(torch.float8_e4m3fn)
    return q, (e.squeeze(-1) + 127).to(torch.uint8)


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(q [R, D] e4m3, scale [R, D/32] ue8m0) -> x [R, D]."""
    return q.to(dtype) * e8m0_to_float(scale, dtype).repeat_interleave(FP4_GROUP, dim=-1)


# ------------------------------------------------------------------ KV cache formats
# The compressed latent (V4.1's KV format): E2M1 codes packed as ds_fp4, one E4M3 scale per 16
# channels (uint8 [..., K/16], the scale's float8_e4m3fn bits). Scale = amax/6 rounded to E4M3;
# elements round to the nearest E2M1 value (ties toward the smaller magnitude) and saturate at 6.
KV_FP4_GROUP = 16
E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)


def quantize_fp4_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % 16 == 0) -> (codes uint8 [..., K/2], scales uint8 [..., K/16])."""
    K = x.shape[-1]
    if K % KV_FP4_GROUP:
        raise ValueError(f"the FP4 KV format needs a width that is a multiple of {KV_FP4_GROUP}, got {K}")
    _check_finite(x, "quantize_fp4_e4m3")
    g = x.to(torch.float64).reshape(*x.shape[:-1], K // KV_FP4_GROUP, KV_FP4_GROUP)
    s8 = (g.abs().amax(-1, keepdim=True) / E2M1_MAX).to(torch.float32).to(torch.float8_e4m3fn)
    s = s8.to(torch.float64)
    y = torch.where(s > 0, g / torch.where(s > 0, s, 1.0), 0.0)
    code = torch.bucketize(y.abs().clamp(max=E2M1_MAX), E2M1_MIDPOINTS.to(y.device)).to(torch.uint8)
    code = (code | ((y < 0) & (code > 0)).to(torch.uint8) << 3).reshape(*x.shape[:-1], K)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), s8.squeeze(-1).view(torch.uint8).contiguous()


@functools.lru_cache(maxsize=8)
def _e2m1_pairs(dtype, device) -> torch.Tensor:
    """[256, 2]: a packed byte's two E2M1 values (low nibble first), in dtype, where the codes are."""
    pairs = E2M1_VALUES.to(dtype)[unpack_e2m1(torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None]).long()]
    return pairs.to(device)


def dequantize_fp4_e4m3(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(codes [..., K/2], scales [..., K/16] E4M3 bits) -> x [..., K] in dtype: each byte looked up as its
    value pair, times its group's scale (the same products as unpacking code by code)."""
    lead, K = packed.shape[:-1], 2 * packed.shape[-1]
    vals = _e2m1_pairs(dtype, packed.device)[packed.long()].view(*lead, K // KV_FP4_GROUP, KV_FP4_GROUP)
    s = scales.view(torch.float8_e4m3fn).to(dtype)
    return (vals * s[..., None]).view(*lead, K)


def quantize_fp8_rowscale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, D] -> (codes uint8 [R, D] E4M3 bits, scale float32 [R] = amax/448): the index-key format."""
    _check_finite(x, "quantize_fp8_rowscale")
    s = (x.abs().amax(-1).to(torch.float32) / E4M3_MAX)
    q = (x.to(torch.float32) / torch.where(s > 0, s, 1.0)[:, None]).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), s


def dequantize_fp8_rowscale(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return q.view(torch.float8_e4m3fn).to(dtype) * scale.to(dtype)[:, None]
