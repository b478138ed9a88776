"""4-bit pages: two codes a byte, one scale per `GROUP` (16) values of a head; int4 and nvfp4.

Layout (vLLM's NVFP4 one): a head's ``D`` values are ``D / 2`` bytes, value ``2i`` in the
low nibble of byte ``i`` and ``2i + 1`` in the high one, with ``D / 16`` scales beside them.

- int4: codes -7..7 as two's-complement nibbles (-8 is never written: the format stays
  symmetric); ``s = max|x| / 7`` over the group, rounded *up* to bfloat16 by its bits as the
  8-bit formats do; ``q = floor(x / s + 1/2)``, so ``|x - q * s| <= s / 2``.
- nvfp4: e2m1 codes (a sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6);
  ``s = max|x| / 6`` rounded up onto the e4m3 grid (integer arithmetic on its bits, so torch,
  Triton and the interpreter agree) and clamped to 448; ``x / s`` rounds to the nearest code,
  ties to the even one. The error is at most half the e2m1 spacing around ``|x / s|`` times
  ``s`` (``s / 4`` below 2, ``s / 2`` below 4, ``s`` above), unless the scale was clamped.

The scales are ``SCALE_DTYPE`` (int4) or float8_e4m3fn (nvfp4; its bits as uint8 to Triton).
"""

from __future__ import annotations

import torch

from ..config import GROUP, SCALE_DTYPE
from ._triton import tl, triton

INT4, NVFP4 = 4, 5  # format codes (Triton constexprs), after quant.FORMATS' 8-bit ones
QMAX = {INT4: 7.0, NVFP4: 6.0}
E4M3_MAX, E4M3_MIN_NORMAL, E4M3_STEP = 448.0, 2.0 ** -6, 2.0 ** -9
# |y| thresholds of e2m1 codes 1..7: "> t" where the tie goes down to an even code, ">= t"
# where it goes up to one
E2M1_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
           (3.5, True), (5.0, False))
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
CHUNK_ELEMENTS = 1 << 18  # float32 elements per temporary of the torch path


def format_of(cache: torch.Tensor, scales: torch.Tensor | None) -> int:
    """`INT4` or `NVFP4` for uint8 pages with scales (by the scales' dtype); 0 otherwise."""
    if scales is None or cache.dtype != torch.uint8:
        return 0
    return INT4 if scales.dtype == SCALE_DTYPE else NVFP4


def scale_dtype(code: int) -> torch.dtype:
    """The dtype of a format's scales."""
    return SCALE_DTYPE if code == INT4 else torch.float8_e4m3fn


def check_scales(what: str, key_cache: torch.Tensor, key_scales: torch.Tensor | None,
                 value_scales: torch.Tensor | None) -> None:
    """Raise ValueError unless uint8 pages ``[N, B, H, D / 2]`` come with two scale tensors
    ``[N, B, H, D / 16]`` of one 4-bit format's scale dtype."""
    shape = (*key_cache.shape[:3], key_cache.shape[3] * 2 // GROUP)
    dtypes = (SCALE_DTYPE, getattr(torch, "float8_e4m3fn", SCALE_DTYPE))
    for name, scales in (("key_scales", key_scales), ("value_scales", value_scales)):
        if scales is None:
            raise ValueError(f"{what}(): {name} is required with 4-bit (uint8) pages")
        if key_cache.shape[3] * 2 % GROUP or tuple(scales.shape) != shape \
                or scales.dtype not in dtypes or scales.dtype != key_scales.dtype \
                or scales.stride(-1) != 1:
            raise ValueError(f"{what}(): {name}: expected bfloat16 (int4) or float8_e4m3fn "
                             f"(nvfp4) of shape {shape}, last dim contiguous, beside uint8 "
                             f"pages {tuple(key_cache.shape)}; got {scales.dtype} of shape "
                             f"{tuple(scales.shape)}")


def e4m3_round_up(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x >= 0`` rounded up onto the e4m3 grid, at most 448 (float32 out)."""
    bits = x.view(torch.int32)
    normal = ((bits + ((1 << 20) - 1)) & -(1 << 20)).view(torch.float32)
    subnormal = torch.ceil(x / E4M3_STEP) * E4M3_STEP
    return torch.where(x < E4M3_MIN_NORMAL, subnormal, normal).clamp(max=E4M3_MAX)


def quantize_reference(x: torch.Tensor, code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and scales of ``x [N, H, D]``: ``([N, H, D / 2] uint8, [N, H, D / 16])``.

    Examples
    --------
    >>> x = torch.linspace(-1.0, 1.0, 16).view(1, 1, 16)
    >>> q, s = quantize_reference(x, INT4)  # s = 1 / 7 rounded up to bfloat16
    >>> q.shape, float(s), q[0, 0, 0].item()  # -7 (0x9) low, -6 (0xa) high
    (torch.Size([1, 1, 8]), 0.1435546875, 169)
    """
    codes = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], x.shape[-1] // GROUP), dtype=scale_dtype(code),
                         device=x.device)
    rows = max(1, CHUNK_ELEMENTS // max(1, x[0].numel())) if x.shape[0] else 1
    for start in range(0, x.shape[0], rows):
        part = slice(start, start + rows)
        codes[part], scales[part] = _quantize(x[part], code)
    return codes, scales


def _quantize(x: torch.Tensor, code: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = x.float().unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(dim=-1) / QMAX[code]
    if code == INT4:  # round up by the bits: the bfloat16 scale is then exact in float32
        scale = ((amax.view(torch.int32) + 0xFFFF) & -65536).view(torch.float32)
    else:
        scale = e4m3_round_up(amax)
    divisor = torch.where(scale > 0, scale, 1.0)[..., None]
    # clamped as the kernels do: a clamped nvfp4 scale (448) leaves |x / s| above 6
    scaled = (groups / divisor).clamp_(-QMAX[code], QMAX[code])
    if code == INT4:
        nibbles = scaled.add_(0.5).floor_().to(torch.int32) & 0xF
    else:
        magnitude = scaled.abs()
        nibbles = sum(((magnitude >= t) if up else (magnitude > t)).to(torch.int32)
                      for t, up in E2M1_UP)
        nibbles = nibbles | (scaled < 0).to(torch.int32) << 3
    pairs = nibbles.flatten(-2).unflatten(-1, (-1, 2))
    packed = (pairs[..., 0] | pairs[..., 1] << 4).to(torch.uint8)
    return packed, scale.to(scale_dtype(code))


def dequantize_reference(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                         ) -> torch.Tensor:
    """``out [..., D] = decode(codes [..., D / 2]) * scales [..., D / 16]`` in float32,
    rounded once to out's dtype (nvfp4 when the scales are float8, else int4)."""
    code = INT4 if scales.dtype == SCALE_DTYPE else NVFP4
    flat = out.view(-1, out.shape[-1]) if out.is_contiguous() else out
    codes = codes.reshape(*flat.shape[:-1], -1)
    scales = scales.reshape(*flat.shape[:-1], -1)
    rows = max(1, CHUNK_ELEMENTS // max(1, flat.shape[-1])) if flat.shape[0] else 1
    for start in range(0, flat.shape[0], rows):
        part = slice(start, start + rows)
        flat[part] = _dequantize(codes[part], scales[part], code)
    return out


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, code: int) -> torch.Tensor:
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).long()
    if code == INT4:
        values = ((nibbles ^ 8) - 8).float()  # sign-extend the nibble
    else:
        table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES),
                             device=codes.device)
        values = table[nibbles]
    scale = scales.float().repeat_interleave(GROUP, dim=-1)
    return values * scale


if triton is not None:

    @triton.jit
    def group_scale(amax, FORMAT: tl.constexpr):
        """float32 scale of a group of max magnitude `amax`, on the format's scale grid."""
        if FORMAT == 4:
            bits = (amax / 7.0).to(tl.int32, bitcast=True)
            return ((bits + 0xFFFF) & -65536).to(tl.float32, bitcast=True)
        else:
            x = amax / 6.0
            bits = x.to(tl.int32, bitcast=True)
            normal = ((bits + ((1 << 20) - 1)) & -(1 << 20)).to(tl.float32, bitcast=True)
            subnormal = -tl.floor(-x / 0.001953125) * 0.001953125
            return tl.minimum(tl.where(x < 0.015625, subnormal, normal), 448.0)

    @triton.jit
    def stored_scale(scale, FORMAT: tl.constexpr):
        """A `group_scale` as stored: bfloat16 (int4) or its e4m3 bits as uint8 (nvfp4)."""
        if FORMAT == 4:
            return scale.to(tl.bfloat16)
        else:
            bits = scale.to(tl.int32, bitcast=True)
            normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
            return tl.where(scale < 0.015625, (scale * 512.0).to(tl.int32),
                            normal).to(tl.uint8)

    @triton.jit
    def load_scale(ptr, mask, FORMAT: tl.constexpr):
        """float32 scales at `ptr` (bfloat16, or e4m3 bits); 0 where masked."""
        if FORMAT == 4:
            return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        else:
            bits = tl.load(ptr, mask=mask, other=0).to(tl.int32)
            exponent, mantissa = (bits >> 3) & 15, bits & 7
            normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
            return tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)

    @triton.jit
    def encode4(y, FORMAT: tl.constexpr):
        """float32 ``y`` (divided by its scale) -> its int32 nibble 0..15."""
        if FORMAT == 4:
            y = tl.minimum(tl.maximum(y, -7.0), 7.0)
            return tl.floor(y + 0.5).to(tl.int32) & 15
        else:
            y = tl.minimum(tl.maximum(y, -6.0), 6.0)
            a = tl.abs(y)
            nibble = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32)
                      + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
                      + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
                      + (a > 5.0).to(tl.int32))
            return nibble | ((y < 0).to(tl.int32) << 3)

    @triton.jit
    def decode4(nibble, FORMAT: tl.constexpr):
        """int32 nibble 0..15 -> float32 value (not yet multiplied by the scale)."""
        if FORMAT == 4:
            return ((nibble ^ 8) - 8).to(tl.float32)
        else:
            exponent, mantissa = (nibble >> 1) & 3, (nibble & 1).to(tl.float32)
            power = ((exponent + 126) << 23).to(tl.float32, bitcast=True)  # 2 ** (e - 1)
            magnitude = tl.where(exponent == 0, 0.5 * mantissa, power * (1.0 + 0.5 * mantissa))
            return tl.where((nibble & 8) != 0, -magnitude, magnitude)

    @triton.jit
    def load_dequantized(cache_ptr, scales_ptr, rows, scale_rows, dims, stride_dim, mask,
                         FORMAT: tl.constexpr):
        """float32 values at logical dims `dims` of 4-bit pages: byte ``dims // 2`` of page
        row `rows` (its low nibble for even dims), times scale ``dims // 16`` of `scale_rows`
        (scales contiguous in their last dim); 0 where masked. Offsets broadcast."""
        byte = tl.load(cache_ptr + rows + (dims // 2) * stride_dim, mask=mask, other=0)
        nibble = (byte.to(tl.int32) >> ((dims % 2) * 4)) & 15
        scale = load_scale(scales_ptr + scale_rows + dims // 16, mask, FORMAT)
        return decode4(nibble, FORMAT) * scale
