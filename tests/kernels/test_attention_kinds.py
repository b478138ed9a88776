"""`paged_attention`'s layer kinds (sliding window, chunked local, sinks, soft-cap), both paths,
against a dense float32 reference written here over each sequence's unpaged K/V.

The dense reference follows transformers' eager attention: scores, soft-cap (Gemma 2), the
mask (causal and ``i - W < j`` / ``j // C == i // C``), a sink column concatenated, softmaxed
and dropped (gpt-oss). The Triton kernel runs through the interpreter on CPU (set before
triton is imported, as in test_triton_kernels); shapes stay small, cases many.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

triton = pytest.importorskip("triton")

from paged_kv.kernels import (  # noqa: E402
    attention,
    attention_reference,
    gather,
    paged_attention,
    write,
)

from .conftest import TOLERANCES, cdiv, tolerances  # noqa: E402
from .test_attention import paged_inputs  # noqa: E402
from .test_triton_kernels import interpreted_kernels, offsets  # noqa: E402, F401
from .test_triton_quantised import interpreted_helpers, written_pages  # noqa: E402, F401

IMPLS = [pytest.param(attention.paged_attention_reference, id="torch"),
         pytest.param(attention.paged_attention_triton, id="triton")]
MIXED = ([1, 9, 17, 30], [1, 5, 17, 1])  # decode rows and prefill chunks, ragged
# (block_size, num_q_heads, num_kv_heads, head_dim, dtype, seq_lens, query_lens, kind);
# kind's "sinks" is the sinks' dtype: random logits of that dtype are made per test
CASES = [
    pytest.param(5, 4, 2, 16, torch.float32, [1, 9, 17, 30], [1] * 4, {"window": 1},
                 id="window1-decode-bs5-fp32"),
    pytest.param(16, 4, 2, 16, torch.float16, [5, 40, 17, 33], [1, 7, 17, 1], {"window": 3},
                 id="window3-under-a-block-bs16-fp16"),
    pytest.param(5, 4, 1, 16, torch.bfloat16, [23, 12, 30], [1, 12, 6], {"window": 7},
                 id="window7-not-dividing-bs5-mqa-bf16"),
    pytest.param(16, 8, 2, 32, torch.float32, [50, 33, 1], [9, 1, 1], {"window": 20},
                 id="window20-not-dividing-bs16-gqa4-fp32"),
    pytest.param(5, 4, 2, 16, torch.float16, [12, 30, 7], [1, 4, 7], {"window": 100},
                 id="window-past-the-sequence-fp16"),
    pytest.param(1, 2, 2, 16, torch.float32, [13, 6], [1, 6], {"window": 4},
                 id="window4-bs1-fp32"),
    pytest.param(16, 4, 2, 16, torch.float32, [17, 33, 5], [1, 9, 5], {"chunk": 4},
                 id="chunk4-dividing-bs16-fp32"),
    pytest.param(5, 4, 2, 16, torch.bfloat16, [20, 15, 8], [1, 6, 8], {"chunk": 7},
                 id="chunk7-bs5-bf16"),
    pytest.param(5, 4, 2, 16, torch.float16, [70, 40], [1, 12], {"chunk": 32},
                 id="chunk32-over-blocks-fp16"),
    pytest.param(16, 2, 1, 16, torch.float32, [9, 4], [1, 4], {"chunk": 1},
                 id="chunk1-fp32"),
    pytest.param(5, 4, 2, 16, torch.float32, [9, 20], [1, 8], {"window": 6, "chunk": 8},
                 id="window-and-chunk-fp32"),
    pytest.param(16, 4, 2, 16, torch.float32, *MIXED, {"sinks": torch.float32},
                 id="sinks-fp32"),
    pytest.param(5, 8, 2, 16, torch.bfloat16, *MIXED, {"sinks": torch.bfloat16},
                 id="sinks-bf16-logits-bf16"),
    pytest.param(5, 4, 2, 16, torch.float16, *MIXED, {"softcap": 2.0}, id="softcap-fp16"),
    pytest.param(16, 4, 2, 32, torch.float32, *MIXED, {"softcap": 5.0}, id="softcap-fp32"),
    pytest.param(5, 4, 2, 16, torch.bfloat16, *MIXED,
                 {"window": 6, "sinks": torch.float32, "softcap": 3.0},
                 id="window-sinks-softcap-bf16"),
    pytest.param(16, 8, 2, 16, torch.float32, [40, 9, 33], [1, 9, 12],
                 {"chunk": 8, "sinks": torch.float32, "softcap": 2.5},
                 id="chunk-sinks-softcap-gqa4-fp32"),
    pytest.param(5, 4, 2, 16, torch.float16, [15, 20, 9], [4, 0, 9],
                 {"window": 4, "sinks": torch.float16}, id="empty-query-row-fp16"),
]


def make_kind(kind: dict, num_q_heads: int) -> dict:
    """`kind` with its sinks dtype replaced by random logits of that dtype (never zero)."""
    kind = dict(kind)
    if "sinks" in kind:
        kind["sinks"] = (torch.randn(num_q_heads) * 2 + 1).to(kind["sinks"])
    return kind


def dense_attention(query: torch.Tensor, contiguous: list[tuple[torch.Tensor, torch.Tensor]],
                    query_lens: list[int], scale: float, window: int = 0, chunk: int = 0,
                    sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Per sequence, float32 eager attention of its last n positions over its K/V [L, Hkv, D]."""
    num_q_heads = query.shape[1]
    outputs, start = [], 0
    for (key, value), num_queries in zip(contiguous, query_lens, strict=True):
        seq_len, num_kv_heads = key.shape[:2]
        q = query[start:start + num_queries].float().transpose(0, 1)  # [Hq, n, D]
        k, v = (t.float().repeat_interleave(num_q_heads // num_kv_heads, dim=1).transpose(0, 1)
                for t in (key, value))  # [Hq, L, D]
        scores = q @ k.transpose(1, 2) * scale  # [Hq, n, L]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        i = torch.arange(num_queries)[:, None] + seq_len - num_queries
        j = torch.arange(seq_len)[None, :]
        mask = j <= i
        if window:
            mask &= j > i - window
        if chunk:
            mask &= j // chunk == i // chunk
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            column = sinks.float()[:, None, None].expand(-1, num_queries, 1)
            scores = torch.cat([scores, column], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :seq_len]
        outputs.append((probs @ v).transpose(0, 1).to(query.dtype))  # [n, Hq, D]
        start += num_queries
    return torch.cat(outputs)


def first_visible_column(seq_len: int, num_queries: int, block_size: int, kind: dict) -> int:
    """Columns of a row's table before this one hold blocks none of its queries can see."""
    first_query = seq_len - num_queries
    first = max(0, first_query - kind.get("window", 0) + 1) if kind.get("window") else 0
    if kind.get("chunk"):
        first = max(first, first_query // kind["chunk"] * kind["chunk"])
    return first // block_size


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("block_size", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
                          "seq_lens", "query_lens", "kind"), CASES)
def test_kinds_match_dense_attention(impl, block_size: int, num_q_heads: int,
                                     num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                                     seq_lens: list[int], query_lens: list[int], kind: dict,
                                     request: pytest.FixtureRequest) -> None:
    case = request.node.callspec.id
    torch.manual_seed(len(case))
    inputs, contiguous = paged_inputs(block_size, num_q_heads, num_kv_heads, head_dim, dtype,
                                      seq_lens, query_lens)
    kind = make_kind(kind, num_q_heads)
    pool_before = inputs[1].clone(), inputs[2].clone()
    actual = impl(*inputs, scale=0.3, **kind)
    expected = dense_attention(inputs[0], contiguous, query_lens, 0.3, **kind)
    assert actual.shape == inputs[0].shape and actual.dtype == dtype, f"{case}: shape / dtype"
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype],
                               msg=lambda message: f"{case}: {message}")
    plain = dense_attention(inputs[0], contiguous, query_lens, 0.3)
    if kind.get("window", 0) < max(seq_lens):  # else the kind changes nothing, by definition
        assert not torch.allclose(actual, plain, **TOLERANCES[dtype]), (
            f"{case}: the kind made no difference to plain causal attention")
    assert torch.equal(inputs[1], pool_before[0]) and torch.equal(inputs[2], pool_before[1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", [{"window": 7}, {"window": 16, "sinks": torch.float32},
                                  {"chunk": 10, "softcap": 4.0}],
                         ids=["window7", "window16-sinks", "chunk10-softcap"])
def test_blocks_before_the_window_are_never_read(impl, kind: dict) -> None:
    """Null block 0 in every column wholly before a row's first visible key changes nothing,
    and neither do NaN pages there (a read, even masked, would spread the NaN)."""
    torch.manual_seed(11)
    block_size, seq_lens, query_lens = 4, [37, 30, 26, 8], [1, 6, 1, 8]
    inputs, _ = paged_inputs(block_size, 4, 2, 16, torch.float32, seq_lens, query_lens)
    kind = make_kind(kind, 4)
    expected = impl(*inputs, **kind)
    query, key_cache, value_cache, block_tables, *rest = inputs
    nulled, poisoned = block_tables.clone(), (key_cache.clone(), value_cache.clone())
    num_nulled = 0
    for row, (seq_len, num_queries) in enumerate(zip(seq_lens, query_lens, strict=True)):
        skipped = first_visible_column(seq_len, num_queries, block_size, kind)
        for page in poisoned:
            page[block_tables[row, :skipped].long()] = float("nan")
        nulled[row, :skipped] = 0
        num_nulled += skipped
    assert num_nulled >= 8, "the case must have blocks before the window"
    with_null = impl(query, key_cache, value_cache, nulled, *rest, **kind)
    assert torch.equal(with_null, expected), "null blocks before the window changed the result"
    with_nan = impl(query, *poisoned, block_tables, *rest, **kind)
    assert torch.equal(with_nan, expected), "a block wholly before the window was read"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("dtype", "kind"), [
    (torch.float32, {"window": 5}),
    (torch.bfloat16, {"chunk": 6, "sinks": torch.float32}),
    (torch.float16, {"window": 9, "softcap": 3.0, "sinks": torch.float32}),
], ids=["window-fp32", "chunk-sinks-bf16", "all-fp16"])
def test_kinds_on_int8_pages(impl, dtype: torch.dtype, kind: dict) -> None:
    """8-bit pages: against the dense reference over the dequantized pages, one more rounding
    (the dequantized K/V round to the query's dtype) in the tolerance."""
    torch.manual_seed(3)
    block_size, seq_lens, query_lens = 5, [17, 12, 26], [1, 12, 4]
    _, pages, scales, _, block_tables = written_pages(
        "int8", seq_lens, block_size, 2, 16, dtype, write.write_kv_reference, outlier=1.0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    keys, values = gather.gather_kv_reference(*pages, block_tables, seq_lens_t,
                                              key_scales=scales[0], value_scales=scales[1],
                                              out_dtype=dtype)
    contiguous = [(keys[b, :n], values[b, :n]) for b, n in enumerate(seq_lens)]
    query = torch.randn(sum(query_lens), 4, 16).to(dtype)
    kind = make_kind(kind, 4)
    actual = impl(query, *pages, block_tables, seq_lens_t, offsets(query_lens),
                  key_scales=scales[0], value_scales=scales[1], **kind)
    expected = dense_attention(query, contiguous, query_lens, 16 ** -0.5, **kind)
    torch.testing.assert_close(actual, expected, **tolerances(dtype, roundings=2))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_public_op_dispatches_the_kinds(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    monkeypatch.setenv("PAGED_KV_BACKEND", backend)
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the fixture made the kernels CPU ones
    launcher = {"torch": "paged_attention_reference", "triton": "paged_attention_triton"}
    calls = []
    real = getattr(attention, launcher[backend])
    monkeypatch.setattr(attention, launcher[backend],
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    torch.manual_seed(5)
    inputs, contiguous = paged_inputs(5, 4, 2, 16, torch.float16, *MIXED)
    kind = make_kind({"window": 6, "sinks": torch.float32, "softcap": 3.0}, 4)
    actual = paged_attention(*inputs, **kind)
    assert len(calls) == 1 and set(calls[0]) >= set(kind), f"{backend}: not dispatched"
    expected = dense_attention(inputs[0], contiguous, MIXED[1], 16 ** -0.5, **kind)
    torch.testing.assert_close(actual, expected, **TOLERANCES[torch.float16])
    calls.clear()
    paged_attention(*inputs)
    assert calls == [{}], f"{backend}: a full-attention call got {calls} extra arguments"


@pytest.mark.parametrize("impl", [*IMPLS, pytest.param(paged_attention, id="public")])
@pytest.mark.parametrize(("bad", "match"), [
    ({"window": -1}, "window: expected an int >= 0"),
    ({"chunk": 2.5}, "chunk: expected an int >= 0"),
    ({"softcap": -1.0}, "softcap: expected a finite float >= 0"),
    ({"softcap": float("nan")}, "softcap: expected a finite float >= 0"),
    ({"sinks": torch.zeros(3)}, r"sinks: expected shape \(4,\)"),
    ({"sinks": torch.zeros(4, dtype=torch.int32)}, "sinks: expected a floating tensor"),
], ids=["window", "chunk", "softcap", "softcap-nan", "sinks-shape", "sinks-dtype"])
def test_bad_kind_arguments_are_refused(impl, bad: dict, match: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGED_KV_BACKEND", "torch")
    inputs, _ = paged_inputs(5, 4, 2, 16, torch.float32, [9, 3], [1, 3])
    out = torch.randn(inputs[0].shape)
    before = out.clone()
    with pytest.raises((ValueError, TypeError), match=match):
        impl(*inputs, out=out, **bad)
    assert torch.equal(out, before), "a refused call wrote its output"


def test_decode_gathers_only_the_window() -> None:
    """The torch path's decode step reads ``cdiv(W, block_size) + 1`` blocks at most per row,
    whatever the sequence length: its gather gets that narrow a table."""
    torch.manual_seed(7)
    block_size, window, seq_lens = 4, 10, [200, 97, 64]
    inputs, contiguous = paged_inputs(block_size, 2, 1, 16, torch.float32, seq_lens, [1, 1, 1])
    widths = []
    real = gather.gather_kv_reference

    def spy(key_cache, value_cache, block_tables, *args, **kwargs):
        widths.append(block_tables.shape[1])
        return real(key_cache, value_cache, block_tables, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_reference, "gather_kv_reference", spy)
        actual = attention.paged_attention_reference(*inputs, window=window)
    assert widths and max(widths) <= cdiv(window, block_size) + 1, f"gathered {widths} blocks"
    expected = dense_attention(inputs[0], contiguous, [1, 1, 1], 16 ** -0.5, window=window)
    torch.testing.assert_close(actual, expected, **TOLERANCES[torch.float32])
