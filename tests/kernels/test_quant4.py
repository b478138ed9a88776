"""4-bit pages (int4, nvfp4): round-trip bounds of the torch reference, and the Triton
kernels against it through the interpreter: the stored bytes (codes and scales) equal, the
gathered and attended outputs within one rounding."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

triton = pytest.importorskip("triton")
interpreter = pytest.importorskip("triton.runtime.interpreter")

from paged_kv.kernels import (  # noqa: E402
    attention,
    copy_blocks,
    gather,
    gather_packed,
    quant4,
    swap_blocks,
    write,
    write4,
)

from .conftest import tolerances  # noqa: E402
from .test_triton_kernels import (  # noqa: E402, F401
    interpreted_kernels,
    make_block_tables,
    offsets,
)

FORMATS = {"int4": quant4.INT4, "nvfp4": quant4.NVFP4}
# (block_size, num_kv_heads, head_dim, K/V dtype)
LAYOUTS = [
    pytest.param(16, 2, 16, torch.float32, id="bs16-h2-d16-fp32"),
    pytest.param(5, 3, 48, torch.float16, id="bs5-h3-d48-fp16"),
    pytest.param(1, 2, 32, torch.bfloat16, id="bs1-h2-d32-bf16"),
]
BATCHES = [pytest.param([1, 6, 17], id="ragged"), pytest.param([9, 0, 2], id="with-empty")]


@pytest.fixture(autouse=True)
def interpreted_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    """quant4's helpers and the 4-bit write kernel, made for the interpreter."""
    for module, name in [(quant4, n) for n in ("group_scale", "stored_scale", "load_scale",
                                               "encode4", "decode4", "load_dequantized")] \
            + [(write4, "_write_kv4_kernel"), (gather, "_gather_kv_kernel")]:
        function = getattr(module, name)
        if not isinstance(function, interpreter.InterpretedFunction):
            monkeypatch.setattr(module, name, interpreter.InterpretedFunction(function.fn))


def bound(fmt: str, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Largest allowed ``|x - deq(q(x))|`` per element of ``x [..., D]``: half a step of the
    scale (int4); half the e2m1 spacing at ``|x / s|`` times the scale (nvfp4)."""
    scale = scales.float().repeat_interleave(16, dim=-1)
    slack = 1e-6 * x.abs() + 1e-30
    if fmt == "int4":
        return scale / 2 + slack
    magnitude = x.float().abs() / torch.where(scale > 0, scale, 1.0)
    spacing = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return spacing / 2 * scale + slack


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_within_bound(fmt: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = (torch.randn(64, 3, 64) * torch.logspace(-2, 2, 64)).to(dtype)
    x[0, 0, :16] = 0.0  # an all-zero group reads back as zeros
    codes, scales = quant4.quantize_reference(x, FORMATS[fmt])
    assert codes.shape == (64, 3, 32) and codes.dtype == torch.uint8
    assert scales.shape == (64, 3, 4) and scales.dtype == quant4.scale_dtype(FORMATS[fmt])
    out = quant4.dequantize_reference(codes, scales, torch.empty(x.shape))
    assert not out[0, 0, :16].any()
    assert ((out - x.float()).abs() <= bound(fmt, x.float(), scales)).all()


def test_nvfp4_codes_are_e2m1() -> None:
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = torch.cat([grid, -grid]).view(1, 1, 16)  # max 6: scale 1, every value exact
    codes, scales = quant4.quantize_reference(x, quant4.NVFP4)
    assert float(scales) == 1.0
    nibbles = torch.stack((codes & 15, codes >> 4), -1).flatten().tolist()
    assert nibbles == [*range(8), 0, *range(9, 16)]  # -0.0 is stored as 0
    # ties go to the even code: 0.25 -> 0, 0.75 -> 1.0, 2.5 -> 2, 5 -> 4
    ties = torch.tensor([0.25, 0.75, 2.5, 5.0] + [0.0] * 11 + [6.0]).view(1, 1, 16)
    out = quant4.dequantize_reference(*quant4.quantize_reference(ties, quant4.NVFP4),
                                      torch.empty(1, 1, 16))
    assert out[0, 0, :4].tolist() == [0.0, 1.0, 2.0, 4.0]


def written_pages(fmt: str, seq_lens: list[int], block_size: int, num_heads: int,
                  head_dim: int, dtype: torch.dtype, launcher, outlier: float = 50.0) -> tuple:
    """Random pages and scales, then a ragged batch (with -1 rows) written by `launcher`,
    its keys' channel 3 scaled by `outlier`."""
    block_tables, num_blocks = make_block_tables(seq_lens, block_size)
    slots = torch.cat([block_tables[b, torch.arange(n) // block_size].long() * block_size
                       + torch.arange(n) % block_size for b, n in enumerate(seq_lens)])
    slots = torch.cat([slots, torch.full((2,), -1)])[torch.randperm(slots.shape[0] + 2)]
    key = torch.randn(slots.shape[0], num_heads, head_dim)
    key[..., 3] *= outlier
    key, value = key.to(dtype), torch.randn(slots.shape[0], num_heads, head_dim).to(dtype)
    generator = torch.Generator().manual_seed(7)
    pages = [torch.randint(0, 256, (num_blocks, block_size, num_heads, head_dim // 2),
                           generator=generator, dtype=torch.uint8) for _ in "kv"]
    scales = [torch.rand(num_blocks, block_size, num_heads, head_dim // 16, generator=generator)
              .to(quant4.scale_dtype(FORMATS[fmt])) for _ in "kv"]
    launcher(key, value, *pages, slots, *scales)
    return (key, value), pages, scales, slots, block_tables


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize("seq_lens", BATCHES)
def test_write_kv4_matches_reference_bytes(fmt: str, block_size: int, num_heads: int,
                                           head_dim: int, dtype: torch.dtype,
                                           seq_lens: list[int]) -> None:
    args = (fmt, seq_lens, block_size, num_heads, head_dim, dtype)
    torch.manual_seed(0)
    originals, want_pages, want_scales, slots, _ = written_pages(*args,
                                                                 write.write_kv_reference)
    torch.manual_seed(0)
    _, got_pages, got_scales, _, _ = written_pages(*args, write.write_kv_triton)
    valid = slots[slots >= 0]
    for name, original, want, got, want_scale, got_scale in zip(
            "kv", originals, want_pages, got_pages, want_scales, got_scales, strict=True):
        assert torch.equal(got_scale.view(torch.uint8), want_scale.view(torch.uint8)), \
            f"{name} scales differ from the reference"
        assert torch.equal(got, want), f"{name} codes differ from the reference"
        scale = got_scale.flatten(0, 1)[valid]
        read = quant4.dequantize_reference(got.flatten(0, 1)[valid], scale,
                                           torch.empty(original[slots >= 0].shape))
        x = original[slots >= 0].float()
        assert ((read - x).abs() <= bound(fmt, x, scale)).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gather_kv4_matches_reference(fmt: str, block_size: int, num_heads: int,
                                      head_dim: int, dtype: torch.dtype, packed: bool) -> None:
    torch.manual_seed(1)
    seq_lens = [1, 6, 17]
    _, pages, scales, _, block_tables = written_pages(
        fmt, seq_lens, block_size, num_heads, head_dim, dtype, write.write_kv_reference)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    kw = dict(key_scales=scales[0], value_scales=scales[1], out_dtype=dtype)
    if packed:
        cu_seqlens = offsets(seq_lens)
        args = (*pages, block_tables, seq_lens_t, cu_seqlens)
        want = gather_packed.gather_kv_packed_reference(*args, **kw)
        got = gather_packed.gather_kv_packed_triton(*args, **kw)
        assert want[0].shape == (sum(seq_lens), num_heads, head_dim)
    else:
        want = gather.gather_kv_reference(*pages, block_tables, seq_lens_t, 20, **kw)
        got = gather.gather_kv_triton(*pages, block_tables, seq_lens_t, 20, **kw)
        assert want[0].shape == (3, 20, num_heads, head_dim)
        assert not want[0][0, 1:].any(), "padding reads as zeros"
    for name, g, w in zip("kv", got, want, strict=True):
        assert g.dtype == dtype
        # one rounding of the same float32 product: exact, but for the interpreter's bf16
        torch.testing.assert_close(g, w, rtol=2.0 ** -7 if dtype == torch.bfloat16 else 0,
                                   atol=0, msg=f"{name} differs")


# (block_size, num_q_heads, num_kv_heads, head_dim, dtype, seq_lens, query_lens)
ATTENTION_CASES = [
    pytest.param(16, 4, 2, 16, torch.float32, [1, 15, 17], [1, 1, 1], id="decode-gqa-fp32"),
    pytest.param(5, 2, 2, 32, torch.float16, [9, 33], [1, 1], id="decode-bs5-fp16"),
    pytest.param(5, 4, 1, 16, torch.bfloat16, [17, 12, 7], [17, 3, 1], id="prefill-bf16"),
    pytest.param(1, 2, 1, 16, torch.float32, [6, 70], [2, 1], id="bs1-multitile-fp32"),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("block_size", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
                          "seq_lens", "query_lens"), ATTENTION_CASES)
def test_paged_attention4_matches_dequantized_reference(
        fmt: str, block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, seq_lens: list[int], query_lens: list[int]) -> None:
    torch.manual_seed(2)
    _, pages, scales, _, block_tables = written_pages(
        fmt, seq_lens, block_size, num_kv_heads, head_dim, dtype, write.write_kv_reference,
        outlier=1.0)
    query = torch.randn(sum(query_lens), num_q_heads, head_dim).to(dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    args = (query, *pages, block_tables, seq_lens_t, offsets(query_lens))
    kw = dict(key_scales=scales[0], value_scales=scales[1])
    want = attention.paged_attention_reference(*args, **kw)
    got = attention.paged_attention_triton(*args, **kw)
    torch.testing.assert_close(got, want, **tolerances(dtype, roundings=2))
    # the reference that dequantizes first: float pages of the dequantized values
    floats = [torch.empty(*p.shape[:3], head_dim, dtype=dtype) for p in pages]
    for page, scale, dst in zip(pages, scales, floats, strict=True):
        quant4.dequantize_reference(page, scale, dst)
    plain = attention.paged_attention_reference(query, *floats, block_tables, seq_lens_t,
                                                offsets(query_lens))
    torch.testing.assert_close(want, plain, **tolerances(dtype, roundings=2))


@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_and_swap_keep_bytes(fmt: str) -> None:
    torch.manual_seed(3)
    pages = torch.randint(0, 256, (2, 2, 6, 4, 2, 16), dtype=torch.uint8)
    scales = torch.rand(2, 2, 6, 4, 2, 2).to(quant4.scale_dtype(FORMATS[fmt]))
    for plane in (pages, scales.view(torch.uint8)):
        before = plane.clone()
        copy_blocks(plane, torch.tensor([1, 2]), torch.tensor([4, 5]))
        assert torch.equal(plane[:, :, [4, 5]], before[:, :, [1, 2]])
        host = torch.zeros_like(plane[:, :, :3])
        swap_blocks(plane, host, torch.tensor([3]), torch.tensor([1]))
        assert torch.equal(host[:, :, 1], plane[:, :, 3])


def test_scales_checked() -> None:
    pages = torch.zeros(2, 4, 1, 8, dtype=torch.uint8)
    key = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="value_scales"):
        write.write_kv(key, key, pages, pages, torch.tensor([0]),
                       torch.zeros(2, 4, 1, 1, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="shape"):
        write.write_kv(key, key, pages, pages, torch.tensor([0]),
                       *[torch.zeros(2, 4, 1, 2, dtype=torch.bfloat16)] * 2)
