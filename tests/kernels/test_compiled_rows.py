"""The compiled row loops (`paged_kv.kernels.rows_compiled`) against the torch paths
(``PAGED_KV_NUMBA=0``) and plain per-token / per-block loops, bit for bit on random bytes
(signalling-NaN payloads included): `write_kv`'s scatter, the packed and padded gathers and
`copy_blocks`, across dtypes, row sizes on both sides of the loops' copy sizes, block
sizes, ragged lengths, and consecutive and scattered ids, with normal and with streaming
stores (every test runs both: the threshold set to 0 and to never), at any alignment; bad
ids raise with the pool unchanged; and where the loops decline, the torch path runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

pytest.importorskip("numba")

from paged_kv.kernels import copy_blocks, gather_kv, gather_kv_packed, rows_compiled, write_kv
from paged_kv.kernels.rows import index_copy_rows

from .test_cpu_copies import _id_pairs, _loop_copy, _padded_loop, _pages
from .test_rows import _random_bytes

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
# (heads, head_dim): 2-byte rows of float16 32 bytes, 6 bytes (no wide element), 2 KiB (the
# workload's), and ~9 KiB (past the loops' memcpy size)
ROWS = [(2, 8), (3, 1), (8, 128), (9, 520)]


@pytest.fixture(autouse=True, params=["normal stores", "streaming stores"])
def stores(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test with each kind of store: streaming from 0 bytes, or never; the compiled
    loops on whatever ``PAGED_KV_NUMBA`` the run was started with."""
    monkeypatch.setenv("PAGED_KV_NUMBA", "1")
    threshold = 0 if request.param == "streaming stores" else 1 << 62
    monkeypatch.setattr(rows_compiled, "streaming_bytes", lambda: threshold)
    return request.param


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> Callable[[], contextlib.AbstractContextManager]:
    """``with torch_path():`` switches the compiled loops off for the calls inside it."""

    @contextlib.contextmanager
    def switched_off() -> Iterator[None]:
        monkeypatch.setenv("PAGED_KV_NUMBA", "0")
        try:
            yield
        finally:
            monkeypatch.setenv("PAGED_KV_NUMBA", "1")

    monkeypatch.setenv("PAGED_KV_NUMBA", "1")
    return switched_off


def _slots(num_tokens: int, num_slots: int, seed: int, padding: int = 2,
           runs: bool = False) -> torch.Tensor:
    """Distinct slots with `padding` entries of -1 among them: random, or (`runs`) runs of
    consecutive slots at random places (a prefill's), cut by the padding."""
    order = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))
    if runs:  # runs of up to 6 slots from the starts of 6-slot spans
        starts = order[order < num_slots // 6 * 6][:num_tokens] // 6 * 6
        order = (starts[:, None] + torch.arange(6)).flatten().unique_consecutive()
    slots = order[:num_tokens].clone()
    slots[torch.arange(padding) * 3 % num_tokens] = -1
    return slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize(("block_size", "num_tokens"), [(1, 7), (16, 33), (5, 19)])
@pytest.mark.parametrize("runs", [False, True])
def test_write_kv_compiled_equals_the_torch_path_and_a_loop(torch_path, dtype, row, block_size,
                                                            num_tokens, runs):
    num_blocks = 2 * num_tokens // block_size + 3
    caches = [_random_bytes((num_blocks, block_size, *row), dtype, seed) for seed in (0, 1)]
    key, value = (_random_bytes((num_tokens, *row), dtype, seed) for seed in (2, 3))
    slots = _slots(num_tokens, num_blocks * block_size, 4, runs=runs)
    assert slots.unique().numel() == num_tokens - 1  # distinct, and the padding
    expected = [c.clone().view(-1, *row) for c in caches]
    for t in range(num_tokens):
        if slots[t] >= 0:
            expected[0][slots[t]], expected[1][slots[t]] = key[t], value[t]
    with torch_path():
        by_torch = [c.clone() for c in caches]
        write_kv(key, value, *by_torch, slots)
    write_kv(key, value, *caches, slots)
    for got, torch_got, want in zip(caches, by_torch, expected, strict=True):
        assert torch.equal(got.view(torch.uint8).flatten(), want.view(torch.uint8).flatten()), \
            (dtype, row, block_size)
        assert torch.equal(got.view(torch.uint8), torch_got.view(torch.uint8))


def test_write_kv_to_8bit_pages_matches_the_torch_path(torch_path):
    """int8 codes and their scales: the codes' rows go through the compiled scatter."""
    generator = torch.Generator().manual_seed(0)
    key, value = (torch.randn(11, 2, 16, generator=generator) for _ in "kv")
    slots = _slots(11, 6 * 4, 1)

    def pages() -> list[torch.Tensor]:
        return [torch.zeros(6, 4, 2, 16, dtype=torch.int8) for _ in "kv"] + \
            [torch.zeros(6, 4, 2, dtype=torch.bfloat16) for _ in "kv"]

    compiled, by_torch = pages(), pages()
    write_kv(key, value, compiled[0], compiled[1], slots, compiled[2], compiled[3])
    with torch_path():
        write_kv(key, value, by_torch[0], by_torch[1], slots, by_torch[2], by_torch[3])
    assert all(torch.equal(a, b) for a, b in zip(compiled, by_torch, strict=True))
    assert compiled[0].abs().sum() > 0


@pytest.mark.parametrize("bad", [24, 1000, -2])
def test_a_slot_past_the_pool_raises_and_writes_nothing(bad):
    """-1 (and any negative slot) is padding for write_kv; index_copy_rows' own callers
    never pass one, so there a negative index raises too."""
    caches = [_random_bytes((6, 4, 2, 8), torch.float16, seed) for seed in (0, 1)]
    before = [c.clone() for c in caches]
    key = _random_bytes((3, 2, 8), torch.float16, 2)
    slots = torch.tensor([5, bad, 7])
    if bad >= 0:
        with pytest.raises(IndexError, match=f"index {bad} \\(entry 1\\) is out of bounds"):
            write_kv(key, key, *caches, slots)
    with pytest.raises(IndexError, match=f"index {bad} \\(entry 1\\) is out of bounds"):
        index_copy_rows(caches[0].view(24, 2, 8), slots, key)
    for cache, old in zip(caches, before, strict=True):
        assert torch.equal(cache.view(torch.uint8), old.view(torch.uint8))


def _cu(lens: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return cu


LENS = [[37, 16, 64, 5], [48, 48], [1, 90, 33, 0], [130, 7], [0], [3]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("consecutive", [False, True])
def test_the_gathers_compiled_equal_the_torch_path_and_a_loop(torch_path, dtype, lens,
                                                              block_size, consecutive):
    key, value, tables, seq_lens = _pages(lens, block_size, dtype, len(lens),
                                          consecutive=consecutive)
    expected = [_padded_loop(c, tables, lens, max(lens) + 3) for c in (key, value)]
    cu = _cu(lens)

    def stale(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.full((*shape, 2, 8 * dtype.itemsize), 7, dtype=torch.uint8)
                     .view(dtype) for _ in "kv")

    outs = {}
    for path in ("compiled", "torch"):
        with torch_path() if path == "torch" else contextlib.nullcontext():
            packed = gather_kv_packed(key, value, tables, seq_lens, cu, stale((sum(lens),)))
            padded = gather_kv(key, value, tables, seq_lens, max(lens) + 3,
                               stale((len(lens), max(lens) + 3)))
        outs[path] = [t.view(torch.uint8) for t in (*packed, *padded)]
    assert all(torch.equal(a, b) for a, b in zip(outs["compiled"], outs["torch"], strict=True))
    for b, n in enumerate(lens):
        for kv in range(2):
            assert torch.equal(outs["compiled"][kv][int(cu[b]):int(cu[b]) + n],
                               expected[kv][b, :n].view(torch.uint8)), (b, kv)
            assert torch.equal(outs["compiled"][2 + kv][b], expected[kv][b].view(torch.uint8))


def test_a_block_past_the_pool_in_a_gather_raises():
    key, value, tables, seq_lens = _pages([20, 9], 4, torch.float16, 0, consecutive=False)
    tables[1, 2] = key.shape[0]  # the last block sequence 1 reads
    outs = tuple(torch.zeros(29, 2, 8, dtype=torch.float16) for _ in "kv")
    with pytest.raises(IndexError, match="past the pool"):
        gather_kv_packed(key, value, tables, seq_lens, _cu([20, 9]), outs)
    assert not any(o.any() for o in outs)  # nothing copied, sequence 0 included
    tables[1, 2] = -1
    with pytest.raises(IndexError, match="past the pool"):
        gather_kv(key, value, tables, seq_lens, 20)


def test_where_the_compiled_gather_declines_the_torch_path_decides(torch_path):
    """Lengths past the table read block 0 there (the torch path's rule); outputs of another
    shape, non-contiguous ones, or numba switched off: the loop declines."""
    key, value, tables, seq_lens = _pages([8, 12], 4, torch.float16, 0, consecutive=False)
    short = tables[:, :2].contiguous()
    outs = tuple(torch.zeros(2, 12, 2, 8, dtype=torch.float16) for _ in "kv")
    assert not rows_compiled.gather_rows(key, value, short, seq_lens, None, outs, 12)
    got = gather_kv(key, value, short, seq_lens, 12)
    with torch_path():
        want = gather_kv(key, value, short, seq_lens, 12)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(got, want, strict=True))
    assert not rows_compiled.gather_rows(key, value, tables, seq_lens, None, outs, 13)
    strided = tuple(torch.zeros(2, 12, 4, 8, dtype=torch.float16)[:, :, ::2] for _ in "kv")
    assert not rows_compiled.gather_rows(key, value, tables, seq_lens, None, strided, 12)
    assert rows_compiled.gather_rows(key, value, tables, seq_lens, None, outs, 12)
    with torch_path():
        assert not rows_compiled.gather_rows(key, value, tables, seq_lens, None, outs, 12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["consecutive", "runs", "scattered"])
@pytest.mark.parametrize(("num_layers", "block_shape", "num_copies"),
                         [(1, (4, 2, 8), 3), (3, (16, 1, 6), 40), (2, (5, 3, 5), 20),
                          (2, (16, 8, 128), 9)])
def test_copy_blocks_compiled_equals_the_torch_path_and_a_loop(torch_path, dtype, kind,
                                                               num_layers, block_shape,
                                                               num_copies):
    num_blocks = 3 * num_copies + 4
    pool = _random_bytes((num_layers, 2, num_blocks, *block_shape), dtype, num_copies)
    src, dst = _id_pairs(kind, num_copies, num_blocks, seed=7)
    expected = _loop_copy(pool, src, dst)
    by_torch = pool.clone()
    with torch_path():
        copy_blocks(by_torch, torch.tensor(src), torch.tensor(dst))
    copy_blocks(pool, torch.tensor(src), torch.tensor(dst))
    assert torch.equal(pool.view(torch.uint8), expected), (dtype, kind)
    assert torch.equal(by_torch.view(torch.uint8), expected), (dtype, kind)


# past the end, negative, a valid pair before a bad one, a run crossing the end, and few
# runs (the torch path's slice copies: they clamp, so it checks the runs itself)
@pytest.mark.parametrize(("src", "dst"), [([3], [10]), ([10], [3]), ([-1], [4]),
                                          ([1, 5], [2, 10]), ([8, 9], [6, 10])])
@pytest.mark.parametrize("compiled", [True, False])
def test_copy_blocks_ids_past_the_pool_raise_and_copy_nothing(torch_path, src, dst, compiled):
    pool = _random_bytes((2, 2, 10, 4, 2, 8), torch.float16, 5)
    before = pool.clone()
    with pytest.raises(IndexError, match="block ids must lie in"), \
            contextlib.nullcontext() if compiled else torch_path():
        copy_blocks(pool, torch.tensor(src), torch.tensor(dst))
    assert torch.equal(pool.view(torch.uint8), before.view(torch.uint8))


def test_the_loops_decline_what_they_cannot_touch(torch_path):
    target = torch.zeros(10, 4, dtype=torch.float16)
    source = torch.ones(3, 8, dtype=torch.float16)
    index = torch.tensor([1, 4, 7])
    assert not rows_compiled.scatter_rows(target, index, source[:, ::2])  # strided rows
    assert not rows_compiled.scatter_rows(target, index, source[:, :4].float())  # dtype
    assert not rows_compiled.scatter_rows(target, index, torch.ones(3, 5,
                                                                    dtype=torch.float16))
    pool = torch.zeros(1, 2, 6, 2, 1, 4)
    assert not rows_compiled.copy_blocks_compiled(pool[:, :, ::2], torch.tensor([0]),
                                                  torch.tensor([1]))
    assert rows_compiled.scatter_rows(target, index, source[:, :4].contiguous())
    assert torch.equal(target[index], source[:, :4])
    with torch_path():
        assert not rows_compiled.is_enabled()
        assert not rows_compiled.scatter_rows(target, index, source[:, :4].contiguous())
        assert not rows_compiled.copy_blocks_compiled(pool, torch.tensor([0]),
                                                      torch.tensor([1]))


@pytest.mark.parametrize("offset", [0, 1, 8, 40])
def test_every_op_at_any_alignment(torch_path, offset):
    """Pools and outputs starting `offset` bytes past a 64-byte boundary, rows of 96 bytes:
    the streaming stores' head and tail go by normal copies."""

    def at_offset(shape: tuple[int, ...], seed: int) -> torch.Tensor:
        numel = torch.Size(shape).numel()
        return _random_bytes((numel + 64,), torch.uint8, seed)[offset:offset + numel] \
            .view(shape)

    caches = [at_offset((12, 4, 3, 32), seed) for seed in (0, 1)]
    tables = torch.randperm(12, generator=torch.Generator().manual_seed(2))[:9].view(3, 3) \
        .to(torch.int32)
    lens = torch.tensor([9, 12, 2], dtype=torch.int32)
    slots = _slots(13, 48, 3, runs=True)
    new = at_offset((13, 3, 32), 4)
    results = []
    for path in (contextlib.nullcontext, torch_path):
        with path():
            written = [at_offset((12, 4, 3, 32), seed) for seed in (0, 1)]  # caches' bytes
            write_kv(new, new, *written, slots)
            packed = tuple(at_offset((23, 3, 32), 6) for _ in "kv")
            gather_kv_packed(*caches, tables, lens, _cu([9, 12, 2]), packed)
            padded = tuple(at_offset((3, 12, 3, 32), 7) for _ in "kv")
            gather_kv(*caches, tables, lens, 12, padded)
            copied = at_offset((2, 2, 12, 4, 3, 32), 5)
            assert copied.data_ptr() % 64 == offset
            copy_blocks(copied, torch.tensor([1, 2, 7, 0]), torch.tensor([5, 6, 3, 11]))
        results.append([*written, *packed, *padded, copied])
    for compiled, by_torch in zip(*results, strict=True):
        assert torch.equal(compiled, by_torch)
