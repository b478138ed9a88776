"""8-bit pages: one scale per (token, kv head), int8 or fp8 codes, and their Triton helpers.

A token's head of ``head_dim`` values ``x`` is stored as codes ``q`` with one scale ``s``
(`SCALE_DTYPE`) such that ``x ~ q * s``: ``s = max|x| / QMAX`` rounded *up* to bfloat16 by
its bits (so torch, Triton and the interpreter agree exactly), hence ``|x / s| <= QMAX``.
int8 rounds ``x / s`` to the nearest integer, halves up (error ``<= s / 2`` per element); fp8
casts it (relative error ``<= 2**-4`` for e4m3, ``2**-3`` for e5m2, above the subnormals).
fp8 pages are moved as uint8 (same bits): index ops and Triton pointers then need no fp8
support.
"""

from __future__ import annotations

import functools

import torch

from ..config import SCALE_DTYPE
from . import quant4
from ._triton import tl, triton

# format code (a Triton constexpr), then QMAX, by page dtype name
FORMATS = {"int8": (1, 127.0), "float8_e4m3fn": (2, 448.0), "float8_e5m2": (3, 57344.0)}
# float32 -> bfloat16 keeps the top 16 bits; adding this first rounds positive values up
ROUND_UP = 0xFFFF
CHUNK_ELEMENTS = 1 << 18  # 1 MiB of float32 per temporary of the torch path


def format_of(cache: torch.Tensor | torch.dtype) -> tuple[int, float]:
    """``(code, QMAX)`` of an 8-bit page dtype; ``(0, 0.0)`` for float pages."""
    dtype = cache.dtype if isinstance(cache, torch.Tensor) else cache
    return FORMATS.get(str(dtype).removeprefix("torch."), (0, 0.0))


def raw(pages: torch.Tensor) -> torch.Tensor:
    """Pages as plain bytes when they are fp8 (same storage), else themselves."""
    return pages.view(torch.uint8) if pages.dtype.is_floating_point and pages.itemsize == 1 \
        else pages


def scale_kwargs(key_scales: torch.Tensor | None, value_scales: torch.Tensor | None,
                 **extra: object) -> dict:
    """Keyword arguments passing 8-bit scales (and `extra`) on to a launcher; none for float
    pages, so their calls are exactly what they were before 8-bit pages existed."""
    if key_scales is None:
        return {}
    return {"key_scales": key_scales, "value_scales": value_scales, **extra}


def check_scales(what: str, key_cache: torch.Tensor, key_scales: torch.Tensor | None,
                 value_scales: torch.Tensor | None) -> None:
    """Raise ValueError unless scales come exactly with 8-bit pages (or 4-bit ones, uint8:
    see `quant4.check_scales`)."""
    if key_cache.dtype == torch.uint8 and (key_scales is not None or value_scales is not None):
        quant4.check_scales(what, key_cache, key_scales, value_scales)
        return
    is_8bit = format_of(key_cache)[0] != 0
    for name, scales in (("key_scales", key_scales), ("value_scales", value_scales)):
        if is_8bit and scales is None:
            raise ValueError(f"{what}(): {name} is required with {key_cache.dtype} pages")
        if not is_8bit and scales is not None:
            raise ValueError(f"{what}(): {name} given with {key_cache.dtype} pages, which "
                             f"hold values, not codes")
        if scales is not None and (scales.shape != key_cache.shape[:3]
                                   or scales.dtype != SCALE_DTYPE):
            raise ValueError(f"{what}(): {name}: expected {SCALE_DTYPE} of shape "
                             f"{tuple(key_cache.shape[:3])}, got {scales.dtype} of shape "
                             f"{tuple(scales.shape)}")


def gather_dequantized(gather, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       key_scales: torch.Tensor, value_scales: torch.Tensor,
                       out: tuple[torch.Tensor, torch.Tensor] | None,
                       out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a float `gather(k, v, out, zero_padding)` over the codes (as bytes) and the scales
    (as one-element heads; 4-bit pages' as they are, heads of ``D / 16``), then ``out =
    codes * scales`` (padding: zero scales, zeros)."""
    packed = quant4.format_of(key_cache, key_scales)
    codes = gather(raw(key_cache), raw(value_cache), None, False)
    if packed:
        scales = gather(raw(key_scales), raw(value_scales), None, True)
    else:
        scales = gather(key_scales[..., None], value_scales[..., None], None, True)
    if out is None:
        dtype = out_dtype or torch.float32
        shape = (*codes[0].shape[:-1], codes[0].shape[-1] * (2 if packed else 1))
        out = (codes[0].new_empty(shape, dtype=dtype), codes[1].new_empty(shape, dtype=dtype))
    for code, scale, cache, dst in zip(codes, scales, (key_cache, value_cache), out,
                                       strict=True):
        if packed:
            quant4.dequantize_reference(code, scale.view(key_scales.dtype), dst)
        else:
            dequantize_reference(code.view(cache.dtype), scale[..., 0], dst)
    return out


def quantize_reference(x: torch.Tensor, cache_dtype: torch.dtype,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of ``x [N, H, D]``: ``([N, H, D] cache_dtype, [N, H] SCALE_DTYPE)``.

    Examples
    --------
    >>> q, s = quantize_reference(torch.tensor([[[1.0, -2.0, 0.5]]]), torch.int8)
    >>> q.tolist(), float(s)  # scale 2 / 127 = 0.015748... rounded up to bfloat16
    ([[[63, -126, 32]]], 0.015869140625)
    """
    codes = torch.empty(x.shape, dtype=cache_dtype, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=SCALE_DTYPE, device=x.device)
    for rows in _chunks(x):
        codes[rows], scale[rows] = _quantize(x[rows], cache_dtype)
    return codes, scale


def _chunks(x: torch.Tensor) -> list[slice]:
    """Slices of `x`'s first dim of about `CHUNK_ELEMENTS` each: float32 temporaries that
    stay in cache (one pass over a whole 50 MB batch is ~10x slower here, in page faults)."""
    rows = max(1, CHUNK_ELEMENTS // max(1, x[0].numel())) if x.shape[0] else 1
    return [slice(start, start + rows) for start in range(0, x.shape[0], rows)]


def _quantize(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _, qmax = format_of(cache_dtype)
    x = x.float()
    bits = (x.abs().amax(dim=-1) / qmax).view(torch.int32)
    scale = ((bits + ROUND_UP) & -65536).view(torch.float32).to(SCALE_DTYPE)
    divisor = scale.float()
    divisor = torch.where(divisor > 0, divisor, 1.0)[..., None]
    # |x / scale| <= QMAX up to float32 rounding, which neither rounding below can push past
    # QMAX: no clamp needed (the kernels clamp anyway, to the same result)
    scaled = x / divisor
    if cache_dtype == torch.int8:
        return scaled.add_(0.5).floor_().to(torch.int8), scale  # half up, as the kernels
    return scaled.to(cache_dtype), scale


def dequantize_reference(codes: torch.Tensor, scale: torch.Tensor,
                         out: torch.Tensor) -> torch.Tensor:
    """``out[..., d] = codes[..., d] * scale[...]`` in float32, rounded once to out's dtype."""
    if out.is_contiguous():  # rows of head_dim, so a chunk never exceeds CHUNK_ELEMENTS much
        flat = out.view(-1, out.shape[-1])
        codes, scale = codes.reshape(flat.shape), scale.reshape(flat.shape[0])
    else:
        flat = out
    for rows in _chunks(flat):
        _dequantize(codes[rows], scale[rows], flat[rows])
    return out


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    if codes.dtype == torch.int8:
        values = codes.to(torch.float32)
    else:  # a 256-entry table: several times faster than torch's CPU fp8 cast, same values
        values = torch.index_select(_fp8_values(codes.dtype, codes.device), 0,
                                    codes.view(torch.uint8).flatten().int()).view(codes.shape)
    scale = scale.to(torch.float32)[..., None]
    if out.dtype == torch.float32:
        torch.mul(values, scale, out=out)
    else:  # a float32 product then one cast: torch's mixed-dtype out= is ~10x slower on CPU
        out.copy_(values.mul_(scale))


@functools.cache
def _fp8_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """float32 value of each of the 256 codes of an fp8 dtype."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(dtype).to(torch.float32)


if triton is not None:

    @triton.jit
    def round_to_fp8(x, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
        """float32 ``x`` rounded to nearest-even on an fp8 grid, so the cast after it is exact.

        The interpreter's fp8 cast mishandles a mantissa carry (124.1 -> 64, not 128); this
        rounding makes every backend give torch's codes. Normals: round the float32 bits to
        MANTISSA bits; below 2**MIN_EXPONENT the grid is even: add and subtract 1.5 * 2**k.
        """
        SHIFT: tl.constexpr = 23 - MANTISSA
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)) & -(1 << SHIFT)
        MAGIC: tl.constexpr = 1.5 * 2.0 ** (23 + MIN_EXPONENT - MANTISSA)
        small = (tl.abs(x) + MAGIC) - MAGIC
        small = tl.where(x < 0, -small, small)  # keeps the sign of a value rounded to 0
        return tl.where(tl.abs(x) < 2.0 ** MIN_EXPONENT, small,
                        bits.to(tl.float32, bitcast=True))

    @triton.jit
    def encode(x, FORMAT: tl.constexpr, QMAX: tl.constexpr):
        """float32 ``x`` (already divided by its scale) -> stored codes (int8 or fp8 bits)."""
        x = tl.minimum(tl.maximum(x, -QMAX), QMAX)
        if FORMAT == 1:
            return tl.floor(x + 0.5).to(tl.int8)
        elif FORMAT == 2:
            return round_to_fp8(x, 3, -6).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            return round_to_fp8(x, 2, -14).to(tl.float8e5).to(tl.uint8, bitcast=True)

    @triton.jit
    def decode(codes, FORMAT: tl.constexpr):
        """Stored codes -> float32 (not yet multiplied by the scale)."""
        if FORMAT == 1:
            return codes.to(tl.float32)
        elif FORMAT == 2:
            return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            return codes.to(tl.float8e5, bitcast=True).to(tl.float32)

    @triton.jit
    def head_scale(x, QMAX: tl.constexpr):
        """Per-row scale of ``x [rows, D]`` float32, rounded up to bfloat16 -> ``[rows]``."""
        bits = (tl.max(tl.abs(x), axis=1) / QMAX).to(tl.int32, bitcast=True)
        return ((bits + 0xFFFF) & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)


def page_strides(key_cache: torch.Tensor, key_scales: torch.Tensor | None,
                 ) -> tuple[torch.Tensor, dict[str, int]]:
    """The scales a Triton kernel reads (the pages themselves, unread, for float pages: any
    pointer of the pages' strides will do) and the stride arguments of pages and scales,
    as every paged kernel names them."""
    scales = key_cache[..., 0] if key_scales is None else key_scales
    return scales, dict(
        cache_stride_block=key_cache.stride(0), cache_stride_offset=key_cache.stride(1),
        cache_stride_head=key_cache.stride(2), cache_stride_dim=key_cache.stride(3),
        scale_stride_block=scales.stride(0), scale_stride_offset=scales.stride(1),
        scale_stride_head=scales.stride(2))
