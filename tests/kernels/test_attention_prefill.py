"""The tiled prefill kernel (`attention_prefill`) against the torch reference, through the
Triton interpreter on CPU: query tiles that cross block and chunk edges, GQA groups packed into
a tile's rows, every layer kind, 8-bit and 4-bit pages, ragged batches of decode rows beside
prefill chunks over cached prefixes; and the same kernel splitting a decode batch's keys
(flash-decoding) with the combine of its partial softmaxes.

The tile holds `attention_prefill.ROWS_PER_TILE` rows (64 on a GPU); the tests lower it, and
the keys per step, so that prompts of a few dozen tokens take several query tiles, the last
one partial, and several key steps, and each case stays a fraction of a second.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

triton = pytest.importorskip("triton")
interpreter = pytest.importorskip("triton.runtime.interpreter")

from paged_kv.kernels import attention, attention_prefill, quant4, write  # noqa: E402

from .conftest import cdiv, tolerances  # noqa: E402
from .test_attention import paged_inputs  # noqa: E402
from .test_triton_kernels import interpreted_kernels, offsets  # noqa: E402, F401
from .test_triton_quantised import interpreted_helpers, written_pages  # noqa: E402, F401

# (rows per tile, keys per step): 16 rows are 16 queries of a group of 1, 8 of 2, 4 of 4
TILES = (16, 8)
# (block_size, num_q_heads, num_kv_heads, head_dim, dtype, seq_lens, query_lens, kind);
# kind's "sinks" is the sinks' dtype: random logits of that dtype are made per test
CASES = [
    pytest.param(4, 2, 2, 16, torch.float32, [37, 9, 20], [37, 1, 13], {},
                 id="mha-bs4-37-queries-fp32"),
    pytest.param(16, 4, 2, 32, torch.float16, [40, 17, 33], [21, 1, 33], {},
                 id="gqa2-bs16-cached-prefix-fp16"),
    pytest.param(5, 8, 2, 16, torch.bfloat16, [30, 12, 1], [11, 12, 1], {},
                 id="gqa4-bs5-bf16"),
    pytest.param(4, 6, 2, 24, torch.float32, [23, 19], [23, 6], {},
                 id="gqa3-padded-group-d24-fp32"),
    pytest.param(16, 4, 1, 16, torch.float16, [15, 20, 9], [4, 0, 9], {},
                 id="empty-query-row-fp16"),
    pytest.param(4, 4, 2, 16, torch.float32, [45, 20, 7], [30, 1, 7], {"window": 5},
                 id="window5-under-a-tile-fp32"),
    pytest.param(16, 2, 2, 16, torch.bfloat16, [50, 33], [26, 1], {"window": 20},
                 id="window20-bs16-bf16"),
    pytest.param(4, 4, 2, 16, torch.float32, [41, 18], [35, 1], {"chunk": 8},
                 id="chunk8-bs4-fp32"),
    pytest.param(5, 8, 2, 16, torch.float16, [38, 9], [29, 9], {"chunk": 7},
                 id="chunk7-gqa4-bs5-fp16"),
    pytest.param(4, 2, 1, 16, torch.float32, [33, 26], [20, 26], {"window": 6, "chunk": 12},
                 id="window-and-chunk-fp32"),
    pytest.param(16, 4, 2, 16, torch.float32, [1, 9, 17, 30], [1, 5, 17, 1],
                 {"sinks": torch.float32}, id="sinks-fp32"),
    pytest.param(5, 8, 2, 16, torch.bfloat16, [1, 9, 17, 30], [1, 5, 17, 1],
                 {"sinks": torch.bfloat16}, id="sinks-bf16-logits-bf16"),
    pytest.param(4, 4, 2, 16, torch.float16, [24, 31], [24, 9], {"softcap": 2.0},
                 id="softcap-fp16"),
    pytest.param(4, 4, 2, 16, torch.bfloat16, [1, 9, 17, 30], [1, 5, 17, 1],
                 {"window": 6, "sinks": torch.float32, "softcap": 3.0},
                 id="window-sinks-softcap-bf16"),
    pytest.param(16, 8, 2, 16, torch.float32, [40, 9, 33], [1, 9, 12],
                 {"chunk": 8, "sinks": torch.float32, "softcap": 2.5},
                 id="chunk-sinks-softcap-gqa4-fp32"),
]
# (page format, dtype, kind) on 8-bit and 4-bit pages
QUANTISED = [
    pytest.param("int8", torch.float32, {}, id="int8-fp32"),
    pytest.param("int8", torch.bfloat16, {"window": 5, "sinks": torch.float32},
                 id="int8-window-sinks-bf16"),
    pytest.param("fp8_e4m3", torch.float16, {"chunk": 6, "softcap": 3.0},
                 id="fp8-chunk-softcap-fp16"),
]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiled kernel (and quant4's helpers) for the interpreter, with tiles of `TILES`."""
    for module, name in [(attention_prefill, "_prefill_attention_kernel"),
                         (attention_prefill, "_combine_splits_kernel"),
                         *[(quant4, n) for n in ("load_scale", "decode4", "load_dequantized")]]:
        function = getattr(module, name)
        if not isinstance(function, interpreter.InterpretedFunction):
            monkeypatch.setattr(module, name, interpreter.InterpretedFunction(function.fn))
    monkeypatch.setattr(attention_prefill, "ROWS_PER_TILE", TILES[0])
    monkeypatch.setattr(attention_prefill, "KEYS_PER_TILE", TILES[1])


@pytest.fixture
def tiled_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(num_tokens, num_splits)`` of each launch of the tiled kernel, to check that a batch
    took it (and split its keys or not)."""
    launches, real = [], attention_prefill.launch_tiled

    def spy(args: dict, query_start_loc: torch.Tensor, num_tokens: int, num_kv_heads: int,
            num_splits: int = 1) -> None:
        launches.append((num_tokens, num_splits))
        real(args, query_start_loc, num_tokens, num_kv_heads, num_splits)

    monkeypatch.setattr(attention_prefill, "launch_tiled", spy)
    return launches


def make_kind(kind: dict, num_q_heads: int) -> dict:
    """`kind` with its sinks' dtype replaced by random logits of it, spread out (some far
    above the scores, so the sink takes most of a row's weight)."""
    kind = dict(kind)
    if "sinks" in kind:
        kind["sinks"] = (torch.randn(num_q_heads) * 3).to(kind["sinks"])
    return kind


def case_name(seq_lens: list[int], query_lens: list[int], kind: dict) -> str:
    return f"seq_lens {seq_lens}, query_lens {query_lens}, {sorted(kind)}"


@pytest.mark.parametrize(("block_size", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
                          "seq_lens", "query_lens", "kind"), CASES)
def test_tiled_prefill_matches_reference(block_size: int, num_q_heads: int, num_kv_heads: int,
                                         head_dim: int, dtype: torch.dtype, seq_lens: list[int],
                                         query_lens: list[int], kind: dict,
                                         tiled_launches: list[tuple[int, int]]) -> None:
    torch.manual_seed(21)
    inputs, _ = paged_inputs(block_size, num_q_heads, num_kv_heads, head_dim, dtype,
                             seq_lens, query_lens)
    kind = make_kind(kind, num_q_heads)
    expected = attention.paged_attention_reference(*inputs, scale=0.3, **kind)
    out = torch.full_like(inputs[0], float("nan"))  # every row must be written
    actual = attention.paged_attention_triton(*inputs, scale=0.3, out=out, **kind)
    assert tiled_launches == [(sum(query_lens), 1)], "the batch did not take the tiled kernel"
    assert actual is out and actual.dtype == dtype
    torch.testing.assert_close(actual, expected, **tolerances(dtype),
                               msg=lambda m: f"{case_name(seq_lens, query_lens, kind)}: {m}")


def test_cases_cross_tiles_blocks_and_chunks() -> None:
    """The case list does what the module says: prompts over several query tiles with a
    partial last one, every group size in 1, 2, 3 (padded), 4, and each layer kind."""
    cases = [param.values for param in CASES]
    assert {q // kv for _, q, kv, *_ in cases} == {1, 2, 3, 4}
    partial_tiles = [n for _, q, kv, _, _, _, query_lens, _ in cases for n in query_lens
                     if n > (block_m := attention_prefill.tile_shape(q // kv)[0])
                     and n % block_m]
    assert len(partial_tiles) >= 5, f"prompts over several tiles, the last partial: {partial_tiles}"
    assert {4, 16} <= {case[0] for case in cases}
    assert {"window", "chunk", "sinks", "softcap"} <= {k for case in cases for k in case[7]}
    assert {torch.float32, torch.float16, torch.bfloat16} == {case[4] for case in cases}


@pytest.mark.parametrize("kind", [{"window": 7}, {"chunk": 12, "sinks": torch.float32}],
                         ids=["window7", "chunk12-sinks"])
def test_blocks_before_the_first_visible_key_are_never_read(kind: dict) -> None:
    """NaN pages in every block wholly before a sequence's first visible key change nothing:
    a tile's key loop starts at its first query's first visible key (a masked read would
    still spread the NaN through ``p @ V``)."""
    torch.manual_seed(9)
    block_size, seq_lens, query_lens = 4, [45, 38], [30, 20]
    inputs, _ = paged_inputs(block_size, 4, 2, 16, torch.float32, seq_lens, query_lens)
    kind = make_kind(kind, 4)
    expected = attention.paged_attention_triton(*inputs, **kind)
    query, key_cache, value_cache, block_tables, *rest = inputs
    poisoned = (key_cache.clone(), value_cache.clone())
    num_poisoned = 0
    for row, (seq_len, num_queries) in enumerate(zip(seq_lens, query_lens, strict=True)):
        position = seq_len - num_queries
        first = max(position - kind.get("window", position + 1) + 1, 0)
        first = max(first, position // kind.get("chunk", position + 1) * kind.get("chunk", 1))
        for page in poisoned:
            page[block_tables[row, : first // block_size].long()] = float("nan")
        num_poisoned += first // block_size
    assert num_poisoned >= 4, "the case must have blocks before the first visible key"
    actual = attention.paged_attention_triton(query, *poisoned, block_tables, *rest, **kind)
    assert torch.equal(actual, expected), "a block before the first visible key was read"


@pytest.mark.parametrize(("page_format", "dtype", "kind"), QUANTISED)
def test_tiled_prefill_on_quantised_pages(page_format: str, dtype: torch.dtype, kind: dict,
                                          tiled_launches: list[tuple[int, int]]) -> None:
    torch.manual_seed(3)
    block_size, seq_lens, query_lens = 5, [17, 12, 26], [1, 12, 19]
    # outlier 1: scores of ~100 make the softmax one-hot, and then one bfloat16 rounding of
    # a key (the interpreter truncates) decides the winner
    _, pages, scales, _, block_tables = written_pages(
        page_format, seq_lens, block_size, 2, 16, dtype, write.write_kv_reference, outlier=1.0)
    query = torch.randn(sum(query_lens), 4, 16).to(dtype)
    args = (query, *pages, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
            offsets(query_lens))
    kind = {**make_kind(kind, 4), "key_scales": scales[0], "value_scales": scales[1]}
    expected = attention.paged_attention_reference(*args, **kind)
    actual = attention.paged_attention_triton(*args, **kind)
    assert tiled_launches == [(sum(query_lens), 1)]
    torch.testing.assert_close(actual, expected, **tolerances(dtype, roundings=2))


@pytest.mark.parametrize("code", [quant4.INT4, quant4.NVFP4], ids=["int4", "nvfp4"])
def test_tiled_prefill_on_4bit_pages(code: int, tiled_launches: list[tuple[int, int]]) -> None:
    torch.manual_seed(8)
    block_size, seq_lens, query_lens, dtype = 4, [22, 9], [13, 1], torch.float16
    inputs, _ = paged_inputs(block_size, 4, 2, 32, dtype, seq_lens, query_lens)
    query, key_cache, value_cache, *rest = inputs
    (key_codes, key_scales), (value_codes, value_scales) = (
        (codes.view(*pages.shape[:3], -1), scales.view(*pages.shape[:3], -1))
        for pages in (key_cache, value_cache)
        for codes, scales in [quant4.quantize_reference(pages.flatten(0, 1), code)])
    args = (query, key_codes, value_codes, *rest)
    kind = {"key_scales": key_scales, "value_scales": value_scales}
    expected = attention.paged_attention_reference(*args, **kind)
    actual = attention.paged_attention_triton(*args, **kind)
    assert tiled_launches == [(sum(query_lens), 1)]
    torch.testing.assert_close(actual, expected, **tolerances(dtype, roundings=2))


def test_decode_batches_keep_the_per_token_kernel(tiled_launches: list[tuple[int, int]]) -> None:
    torch.manual_seed(5)
    inputs, _ = paged_inputs(4, 4, 2, 16, torch.float32, [9, 17, 1], [1, 1, 1])
    expected = attention.paged_attention_reference(*inputs)
    actual = attention.paged_attention_triton(*inputs)
    assert tiled_launches == []
    torch.testing.assert_close(actual, expected, **tolerances(torch.float32))


@pytest.mark.parametrize("block_m", [1, 3, 4])
@pytest.mark.parametrize("query_lens", [[5, 0, 1, 8], [0, 0, 3], [12], [0, 4, 0]],
                         ids=["ragged", "leading-empty", "one", "empty-around"])
def test_query_tiles_cover_each_sequence_in_order(query_lens: list[int], block_m: int) -> None:
    seqs, firsts = attention_prefill.query_tiles(offsets(query_lens), sum(query_lens), block_m)
    expected = [(seq, first) for seq, n in enumerate(query_lens)
                for first in range(0, n, block_m)]
    num_tiles = len(expected)
    assert seqs.shape[0] == cdiv(sum(query_lens), block_m) + len(query_lens) >= num_tiles
    assert list(zip(seqs[:num_tiles].tolist(), firsts[:num_tiles].tolist(),
                    strict=True)) == expected
    assert (seqs[num_tiles:] == -1).all(), f"spare tiles: {seqs.tolist()}"


# (block_size, num_q_heads, num_kv_heads, dtype, seq_lens, num_splits, kind) of decode
# batches split into runs of keys: a sequence of 1 key leaves every split but the first empty
SPLIT_CASES = [
    pytest.param(4, 2, 2, torch.float32, [1, 9, 40, 70], 3, {}, id="mha-3-splits-fp32"),
    pytest.param(16, 8, 2, torch.bfloat16, [70, 33], 5, {}, id="gqa4-5-splits-bf16"),
    pytest.param(5, 4, 2, torch.float16, [41, 2, 66], 2, {"window": 13},
                 id="window13-2-splits-fp16"),
    pytest.param(4, 4, 2, torch.float32, [50, 23], 4, {"chunk": 16}, id="chunk16-4-splits-fp32"),
    pytest.param(4, 4, 2, torch.float32, [1, 9, 40, 70], 3, {"sinks": torch.float32},
                 id="sinks-3-splits-fp32"),
    pytest.param(5, 4, 1, torch.bfloat16, [60, 17, 1], 4,
                 {"window": 20, "sinks": torch.float32, "softcap": 3.0},
                 id="window-sinks-softcap-4-splits-bf16"),
]


@pytest.mark.parametrize(("block_size", "num_q_heads", "num_kv_heads", "dtype", "seq_lens",
                          "num_splits", "kind"), SPLIT_CASES)
def test_split_decode_matches_reference(block_size: int, num_q_heads: int, num_kv_heads: int,
                                        dtype: torch.dtype, seq_lens: list[int],
                                        num_splits: int, kind: dict,
                                        tiled_launches: list[tuple[int, int]],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(13)
    monkeypatch.setattr(attention_prefill, "decode_splits", lambda *_: num_splits)
    query_lens = [1] * len(seq_lens)
    inputs, _ = paged_inputs(block_size, num_q_heads, num_kv_heads, 16, dtype, seq_lens,
                             query_lens)
    kind = make_kind(kind, num_q_heads)
    expected = attention.paged_attention_reference(*inputs, **kind)
    out = torch.full_like(inputs[0], float("nan"))
    actual = attention.paged_attention_triton(*inputs, out=out, **kind)
    assert tiled_launches == [(len(seq_lens), num_splits)], "the keys were not split"
    torch.testing.assert_close(actual, expected, **tolerances(dtype),
                               msg=lambda m: f"{case_name(seq_lens, query_lens, kind)}: {m}")


def test_split_decode_on_int8_pages(tiled_launches: list[tuple[int, int]],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(4)
    monkeypatch.setattr(attention_prefill, "decode_splits", lambda *_: 3)
    seq_lens, dtype = [33, 1, 20], torch.float16
    _, pages, scales, _, block_tables = written_pages(
        "int8", seq_lens, 4, 2, 16, dtype, write.write_kv_reference, outlier=1.0)
    args = (torch.randn(3, 4, 16).to(dtype), *pages, block_tables,
            torch.tensor(seq_lens, dtype=torch.int32), offsets([1, 1, 1]))
    kind = {"key_scales": scales[0], "value_scales": scales[1]}
    expected = attention.paged_attention_reference(*args, **kind)
    actual = attention.paged_attention_triton(*args, **kind)
    assert tiled_launches == [(3, 3)]
    torch.testing.assert_close(actual, expected, **tolerances(dtype, roundings=2))


@pytest.mark.parametrize(("num_tokens", "num_seqs", "max_keys", "expected"), [
    (4, 4, 8192, 8),     # 4 x 8 programs: 8 splits make 256 of the 264 wanted (132 SMs)
    (1, 1, 65536, 16),   # one long sequence: capped at MAX_SPLITS
    (4, 4, 600, 2),      # short tables: runs of at least 256 keys
    (40, 40, 8192, 1),   # 320 programs fill the GPU already
    (9, 4, 8192, 1),     # a prefill batch has its query tiles
])
def test_decode_splits_fill_the_multiprocessors(num_tokens: int, num_seqs: int, max_keys: int,
                                                expected: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_prefill, "_multiprocessors", lambda index: 132)
    splits = attention_prefill.decode_splits(num_tokens, num_seqs, 8, max_keys,
                                             torch.device("cuda", 0))
    assert splits == expected
