"""The plain-torch data-movement kernels against naive Python-loop references.

Each op (`write_kv`, `gather_kv`, `gather_kv_packed`, `copy_blocks`, `swap_blocks`) runs on
random pools (block 0 is the null block, random too), random non-contiguous block tables and
ragged batches, and is compared with `torch.equal` to a loop written here with plain indexing.
The torch backend is forced, so these tests mean the same with or without Triton installed.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from paged_kv.kernels import (
    copy_blocks,
    copy_blocks_reference,
    gather_kv,
    gather_kv_packed,
    gather_kv_packed_reference,
    gather_kv_reference,
    swap_blocks,
    write_kv,
    write_kv_reference,
)

from .conftest import cdiv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZES = [1, 16, 5]
HEAD_DIMS = [8, 64, 24]
NUM_LAYERS = 2

# (block_size, num_heads, head_dim, dtype): curated so each size, head dim and dtype appears
LAYOUTS = [
    pytest.param(16, 2, 8, torch.float32, id="bs16-h2-d8-fp32"),
    pytest.param(16, 4, 64, torch.bfloat16, id="bs16-h4-d64-bf16"),
    pytest.param(5, 2, 24, torch.float16, id="bs5-h2-d24-fp16"),
    pytest.param(5, 3, 64, torch.float32, id="bs5-h3-d64-fp32"),
    pytest.param(1, 2, 8, torch.bfloat16, id="bs1-h2-d8-bf16"),
    pytest.param(1, 1, 24, torch.float16, id="bs1-h1-d24-fp16"),
]
BATCHES = [
    pytest.param([1, 15, 16, 17, 33], id="ragged"),
    pytest.param([33, 0, 2], id="with-empty"),
    pytest.param([7], id="single"),
]
# which tokens of a write get slot -1 (padding)
PADDINGS = [
    pytest.param("every-4th", id="pad-every-4th"),
    pytest.param("none", id="pad-none"),
    pytest.param("all", id="pad-all"),
]
WRITE_IMPLS = [pytest.param(write_kv, id="public"), pytest.param(write_kv_reference, id="ref")]
GATHER_IMPLS = [pytest.param(gather_kv, id="public"), pytest.param(gather_kv_reference, id="ref")]
PACKED_IMPLS = [pytest.param(gather_kv_packed, id="public"),
                pytest.param(gather_kv_packed_reference, id="ref")]
COPY_IMPLS = [pytest.param(copy_blocks, id="public"),
              pytest.param(copy_blocks_reference, id="ref")]


pytestmark = pytest.mark.usefixtures("torch_backend")


def describe(block_size: int, num_heads: int, head_dim: int, dtype: torch.dtype,
             **extra: object) -> str:
    """The case, for assertion messages."""
    details = "".join(f" {key}={value}" for key, value in extra.items())
    return f"[bs={block_size} H={num_heads} D={head_dim} {dtype}{details}]"


def random_pool(num_blocks: int, block_size: int, num_heads: int, head_dim: int,
                dtype: torch.dtype) -> torch.Tensor:
    """A whole pool ``[L, 2, num_blocks, block_size, H, D]`` of randn, null block included."""
    shape = (NUM_LAYERS, 2, num_blocks, block_size, num_heads, head_dim)
    return torch.randn(shape, dtype=dtype)


def make_block_tables(seq_lens: list[int], block_size: int,
                      num_spare: int = 3) -> tuple[torch.Tensor, int]:
    """Random non-contiguous tables from randperm of ids 1..N-1, padded with 0; and N."""
    needed = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = 1 + sum(needed) + num_spare  # block 0 is the null block; spares never used
    block_ids = (torch.randperm(num_blocks - 1)[: sum(needed)] + 1).split(needed)
    block_tables = torch.zeros(len(seq_lens), max(needed, default=0) + 1, dtype=torch.int32)
    for row, ids in enumerate(block_ids):
        block_tables[row, : len(ids)] = ids
    return block_tables, num_blocks


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    """``[B + 1]`` int32 prefix sums."""
    result = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    result[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return result


# ---- naive loop references -------------------------------------------------------------------


def loop_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[token]
        value_cache[slot // block_size, slot % block_size] = value[token]


def loop_gather(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: list[int], pad_to: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = key_cache.shape[1]
    length = max(seq_lens, default=0) if pad_to is None else pad_to
    shape = (len(seq_lens), length, *key_cache.shape[2:])
    key = torch.zeros(shape, dtype=key_cache.dtype)
    value = torch.zeros(shape, dtype=value_cache.dtype)
    for row, seq_len in enumerate(seq_lens):
        for position in range(seq_len):
            block = int(block_tables[row, position // block_size])
            key[row, position] = key_cache[block, position % block_size]
            value[row, position] = value_cache[block, position % block_size]
    return key, value


def loop_gather_packed(key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: list[int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = key_cache.shape[1]
    shape = (sum(seq_lens), *key_cache.shape[2:])
    key = torch.zeros(shape, dtype=key_cache.dtype)
    value = torch.zeros(shape, dtype=value_cache.dtype)
    row_out = 0
    for row, seq_len in enumerate(seq_lens):
        for position in range(seq_len):
            block = int(block_tables[row, position // block_size])
            key[row_out] = key_cache[block, position % block_size]
            value[row_out] = value_cache[block, position % block_size]
            row_out += 1
    return key, value


def loop_copy(src_cache: torch.Tensor, dst_cache: torch.Tensor, src_block_ids: list[int],
              dst_block_ids: list[int]) -> None:
    for src, dst in zip(src_block_ids, dst_block_ids, strict=True):
        for layer in range(src_cache.shape[0]):
            for kv in range(2):
                dst_cache[layer, kv, dst] = src_cache[layer, kv, src]


# ---- write_kv ----------------------------------------------------------------------------


def test_layouts_cover_every_block_size_head_dim_and_dtype() -> None:
    layouts = [param.values for param in LAYOUTS]
    assert {layout[0] for layout in layouts} == set(BLOCK_SIZES)
    assert {layout[2] for layout in layouts} == set(HEAD_DIMS)
    assert {layout[3] for layout in layouts} == set(DTYPES)


@pytest.mark.parametrize("impl", WRITE_IMPLS)
@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize("padding", PADDINGS)
def test_write_kv_matches_loop(impl: Callable[..., None], block_size: int, num_heads: int,
                               head_dim: int, dtype: torch.dtype, padding: str) -> None:
    case = describe(block_size, num_heads, head_dim, dtype, padding=padding)
    num_tokens, layer = 37, 1
    num_blocks = 1 + cdiv(num_tokens + 10, block_size)
    pool = random_pool(num_blocks, block_size, num_heads, head_dim, dtype)
    before = pool.clone()
    # distinct slots outside the null block, in random order
    num_slots = (num_blocks - 1) * block_size
    slot_mapping = torch.randperm(num_slots)[:num_tokens] + block_size
    if padding == "every-4th":
        slot_mapping[::4] = -1
    elif padding == "all":
        slot_mapping[:] = -1
    key = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype)
    value = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype)

    expected = pool.clone()
    loop_write(key, value, expected[layer, 0], expected[layer, 1], slot_mapping)
    impl(key, value, pool[layer, 0], pool[layer, 1], slot_mapping)

    assert torch.equal(pool, expected), f"{case} pool differs from the loop reference"
    is_written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    is_written[slot_mapping[slot_mapping >= 0]] = True
    assert int(is_written.sum()) == int((slot_mapping >= 0).sum())
    for kv, new in enumerate((key, value)):
        flat, flat_before = pool[layer, kv].flatten(0, 1), before[layer, kv].flatten(0, 1)
        assert torch.equal(flat[slot_mapping[slot_mapping >= 0]], new[slot_mapping >= 0]), (
            f"{case} kv={kv}: a written slot does not hold its token")
        assert torch.equal(flat[~is_written], flat_before[~is_written]), (
            f"{case} kv={kv}: a slot outside slot_mapping (or a -1 token's) changed")
    other_layers = [i for i in range(NUM_LAYERS) if i != layer]
    assert torch.equal(pool[other_layers], before[other_layers]), f"{case} another layer changed"


@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS[:3])
def test_write_kv_from_strided_views(block_size: int, num_heads: int, head_dim: int,
                                     dtype: torch.dtype) -> None:
    """K and V as slices of one projection output (non-contiguous inputs)."""
    case = describe(block_size, num_heads, head_dim, dtype)
    num_tokens = 11
    num_blocks = 1 + cdiv(num_tokens + 4, block_size)
    pool = random_pool(num_blocks, block_size, num_heads, head_dim, dtype)
    slot_mapping = torch.randperm((num_blocks - 1) * block_size)[:num_tokens] + block_size
    slot_mapping[3] = -1
    projection = torch.randn(num_tokens, 3 * num_heads, head_dim, dtype=dtype)
    key, value = projection[:, num_heads:2 * num_heads], projection[:, 2 * num_heads:]
    assert not key.is_contiguous()
    expected = pool.clone()
    loop_write(key, value, expected[0, 0], expected[0, 1], slot_mapping)
    write_kv(key, value, pool[0, 0], pool[0, 1], slot_mapping)
    assert torch.equal(pool, expected), f"{case} pool differs from the loop reference"


# ---- gather_kv ---------------------------------------------------------------------------


def gather_inputs(seq_lens: list[int], block_size: int, num_heads: int, head_dim: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's (key_cache, value_cache) views of a random pool, and block tables."""
    block_tables, num_blocks = make_block_tables(seq_lens, block_size)
    pool = random_pool(num_blocks, block_size, num_heads, head_dim, dtype)
    return pool[1, 0], pool[1, 1], block_tables


@pytest.mark.parametrize("impl", GATHER_IMPLS)
@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize("seq_lens", BATCHES)
@pytest.mark.parametrize("extra_pad", [None, 7, "blocks"],
                         ids=["pad-longest", "pad-longest+7", "pad-whole-blocks"])
def test_gather_kv_matches_loop(impl: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                                block_size: int, num_heads: int, head_dim: int,
                                dtype: torch.dtype, seq_lens: list[int],
                                extra_pad: int | str | None) -> None:
    if extra_pad == "blocks":  # a multiple of the block size, with whole blocks of padding
        pad_to = -(-max(seq_lens) // block_size) * block_size + block_size
    else:
        pad_to = None if extra_pad is None else max(seq_lens) + extra_pad
    case = describe(block_size, num_heads, head_dim, dtype, seq_lens=seq_lens, pad_to=pad_to)
    key_cache, value_cache, block_tables = gather_inputs(seq_lens, block_size, num_heads,
                                                         head_dim, dtype)
    caches_before = key_cache.clone(), value_cache.clone()
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    key, value = impl(key_cache, value_cache, block_tables, seq_lens_t, pad_to)
    expected = loop_gather(key_cache, value_cache, block_tables, seq_lens, pad_to)
    length = max(seq_lens) if pad_to is None else pad_to
    for name, got, want in zip("kv", (key, value), expected, strict=True):
        assert got.shape == (len(seq_lens), length, num_heads, head_dim), f"{case} {name} shape"
        assert got.dtype == dtype, f"{case} {name} dtype"
        assert torch.equal(got, want), f"{case} {name} differs from the loop reference"
        for row, seq_len in enumerate(seq_lens):
            assert not got[row, seq_len:].any(), f"{case} {name} row {row}: nonzero past length"
    assert torch.equal(key_cache, caches_before[0]) and torch.equal(value_cache, caches_before[1])


@pytest.mark.parametrize("impl", GATHER_IMPLS)
@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize("extra_pad", [0, 5], ids=["pad-longest", "pad-longest+5"])
def test_gather_kv_into_out_buffers(impl: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                                    block_size: int, num_heads: int, head_dim: int,
                                    dtype: torch.dtype, extra_pad: int) -> None:
    seq_lens = [1, 15, 16, 17, 33]
    pad_to = max(seq_lens) + extra_pad
    case = describe(block_size, num_heads, head_dim, dtype, pad_to=pad_to)
    key_cache, value_cache, block_tables = gather_inputs(seq_lens, block_size, num_heads,
                                                         head_dim, dtype)
    shape = (len(seq_lens), pad_to, num_heads, head_dim)
    # noise everywhere, so a kernel that skips zeroing the padding fails
    out = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    result = impl(key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
                  pad_to, out)
    assert result[0] is out[0] and result[1] is out[1], f"{case} did not return the out buffers"
    expected = loop_gather(key_cache, value_cache, block_tables, seq_lens, pad_to)
    for name, got, want in zip("kv", out, expected, strict=True):
        assert torch.equal(got, want), f"{case} {name} out differs from the loop reference"


def test_gather_kv_rows_sharing_a_block() -> None:
    """Two sequences whose tables share their first block (a cached prefix)."""
    block_size, seq_lens = 5, [12, 8]
    key_cache, value_cache, block_tables = gather_inputs(seq_lens, block_size, 2, 8,
                                                         torch.float16)
    block_tables[1, 0] = block_tables[0, 0]
    key, value = gather_kv(key_cache, value_cache, block_tables,
                           torch.tensor(seq_lens, dtype=torch.int32))
    expected = loop_gather(key_cache, value_cache, block_tables, seq_lens)
    assert torch.equal(key, expected[0]) and torch.equal(value, expected[1])
    assert torch.equal(key[0, :block_size], key[1, :block_size]), "shared block differs per row"


@pytest.mark.parametrize("impl", GATHER_IMPLS)
@pytest.mark.parametrize("pad_to", [1, 32], ids=["pad1", "pad-longest-1"])
def test_gather_kv_pad_to_below_longest_raises(
        impl: Callable[..., tuple[torch.Tensor, torch.Tensor]], pad_to: int) -> None:
    seq_lens = [1, 15, 33]
    key_cache, value_cache, block_tables = gather_inputs(seq_lens, 16, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="pad_to"):
        impl(key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
             pad_to)


# ---- gather_kv_packed --------------------------------------------------------------------


@pytest.mark.parametrize("impl", PACKED_IMPLS)
@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize("seq_lens", BATCHES)
@pytest.mark.parametrize("use_out", [False, True], ids=["new", "out"])
def test_gather_kv_packed_matches_loop(impl: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                                       block_size: int, num_heads: int, head_dim: int,
                                       dtype: torch.dtype, seq_lens: list[int],
                                       use_out: bool) -> None:
    case = describe(block_size, num_heads, head_dim, dtype, seq_lens=seq_lens, out=use_out)
    key_cache, value_cache, block_tables = gather_inputs(seq_lens, block_size, num_heads,
                                                         head_dim, dtype)
    shape = (sum(seq_lens), num_heads, head_dim)
    out = (torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)) if use_out else None
    result = impl(key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
                  cu_seqlens_of(seq_lens), out)
    if out is not None:
        assert result[0] is out[0] and result[1] is out[1], f"{case} did not return out buffers"
    expected = loop_gather_packed(key_cache, value_cache, block_tables, seq_lens)
    for name, got, want in zip("kv", result, expected, strict=True):
        assert got.shape == shape and got.dtype == dtype, f"{case} {name} shape/dtype"
        assert torch.equal(got, want), f"{case} packed {name} differs from the loop reference"


# ---- copy_blocks / swap_blocks -----------------------------------------------------------

# (src, dst) block ids, into a pool of 10 blocks; no dst twice or among the srcs
COPIES = [
    pytest.param([3], [7], id="one"),
    pytest.param([9, 2, 5], [1, 8, 4], id="three-unordered"),
    pytest.param([6, 6], [2, 3], id="one-src-twice"),
    pytest.param([], [], id="none"),
]


def assert_blocks_copied(after: torch.Tensor, before: torch.Tensor, src_cache: torch.Tensor,
                         src_block_ids: list[int], dst_block_ids: list[int], case: str) -> None:
    """dst blocks hold the src blocks in every layer, K and V; no other block changed."""
    for src, dst in zip(src_block_ids, dst_block_ids, strict=True):
        assert torch.equal(after[:, :, dst], src_cache[:, :, src]), (
            f"{case} block {dst} is not a copy of block {src}")
    is_untouched = torch.ones(after.shape[2], dtype=torch.bool)
    is_untouched[torch.tensor(dst_block_ids, dtype=torch.int64)] = False
    assert torch.equal(after[:, :, is_untouched], before[:, :, is_untouched]), (
        f"{case} a block outside dst_block_ids changed")


@pytest.mark.parametrize("impl", COPY_IMPLS)
@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize(("src_block_ids", "dst_block_ids"), COPIES)
def test_copy_blocks_matches_loop(impl: Callable[..., None], block_size: int, num_heads: int,
                                  head_dim: int, dtype: torch.dtype, src_block_ids: list[int],
                                  dst_block_ids: list[int]) -> None:
    case = describe(block_size, num_heads, head_dim, dtype, src=src_block_ids, dst=dst_block_ids)
    pool = random_pool(10, block_size, num_heads, head_dim, dtype)
    before = pool.clone()
    expected = pool.clone()
    loop_copy(before, expected, src_block_ids, dst_block_ids)
    impl(pool, torch.tensor(src_block_ids, dtype=torch.int64),
         torch.tensor(dst_block_ids, dtype=torch.int64))
    assert torch.equal(pool, expected), f"{case} pool differs from the loop reference"
    assert_blocks_copied(pool, before, before, src_block_ids, dst_block_ids, case)


# (src ids in a pool of 6 blocks, dst ids in a pool of 11), and the reverse direction
SWAPS = [
    pytest.param([4], [9], False, id="small-to-big-one"),
    pytest.param([5, 1, 3], [2, 10, 7], False, id="small-to-big-three"),
    pytest.param([9, 2, 10], [3, 5, 1], True, id="big-to-small-three"),
    pytest.param([], [], False, id="none"),
]


@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize(("src_block_ids", "dst_block_ids", "is_big_to_small"), SWAPS)
def test_swap_blocks_matches_loop(block_size: int, num_heads: int, head_dim: int,
                                  dtype: torch.dtype, src_block_ids: list[int],
                                  dst_block_ids: list[int], is_big_to_small: bool) -> None:
    case = describe(block_size, num_heads, head_dim, dtype, src=src_block_ids, dst=dst_block_ids)
    small = random_pool(6, block_size, num_heads, head_dim, dtype)
    big = random_pool(11, block_size, num_heads, head_dim, dtype)
    src_cache, dst_cache = (big, small) if is_big_to_small else (small, big)
    src_before, dst_before = src_cache.clone(), dst_cache.clone()
    expected = dst_cache.clone()
    loop_copy(src_cache, expected, src_block_ids, dst_block_ids)
    swap_blocks(src_cache, dst_cache, torch.tensor(src_block_ids, dtype=torch.int64),
                torch.tensor(dst_block_ids, dtype=torch.int64))
    assert torch.equal(dst_cache, expected), f"{case} dst pool differs from the loop reference"
    assert torch.equal(src_cache, src_before), f"{case} the src pool changed"
    assert_blocks_copied(dst_cache, dst_before, src_before, src_block_ids, dst_block_ids, case)


def test_copy_blocks_reference_in_several_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy larger than the reference's bounce buffer goes through it chunk by chunk."""
    from paged_kv.kernels import copy as copy_module

    block_size, num_heads, head_dim, dtype = 5, 2, 8, torch.float32
    row_bytes = block_size * num_heads * head_dim * 4
    monkeypatch.setattr(copy_module, "_CHUNK_BYTES", 3 * row_bytes)  # 3 rows per chunk
    monkeypatch.setattr(copy_module, "_SLICE_BYTES", 1 << 40)  # the row path, not numpy's
    monkeypatch.setattr(copy_module, "_MAX_SHORT_RUNS", 0)
    src_block_ids, dst_block_ids = [9, 2, 5, 7], [1, 8, 4, 3]
    pool = random_pool(10, block_size, num_heads, head_dim, dtype)
    before, expected = pool.clone(), pool.clone()
    loop_copy(before, expected, src_block_ids, dst_block_ids)
    copy_module.copy_blocks_reference(pool, torch.tensor(src_block_ids),
                                      torch.tensor(dst_block_ids))
    assert torch.equal(pool, expected), "chunked copy differs from the loop reference"


def test_forcing_triton_on_cpu_without_the_interpreter_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from paged_kv.kernels import backend

    monkeypatch.setenv("PAGED_KV_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.use_triton(torch.zeros(1))
