"""The torch reference's explicit softmax (sinks, soft-cap) in query tiles: a prefill chunk
long enough to take several tiles, the last one partial, gives what one plain softmax over
all its scores gives.

The tile is sized by a score budget (`attention_reference._SCORES_PER_TILE`, 64 MiB of
float32 scores) that only a prompt of thousands of tokens fills; the test lowers the budget
so a chunk of 37 queries takes six tiles of 7 (and checks that it did), keeping it small.
"""

from __future__ import annotations

import pytest
import torch

from paged_kv.kernels import attention_reference

from .conftest import TOLERANCES
from .test_attention import paged_inputs

BLOCK, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 5, 4, 2, 16
SEQ_LENS, QUERY_LENS = [40, 23, 9], [37, 1, 9]  # a long chunk, a decode row, a short prompt
TILE = 7  # queries of the 40-key row per tile: 37 = 5 * 7 + 2
KINDS = [
    pytest.param({"sinks": True, "softcap": 3.0}, torch.float32, id="sinks-softcap-fp32"),
    pytest.param({"window": 6, "sinks": True}, torch.float32, id="window-sinks-fp32"),
    pytest.param({"chunk": 8, "softcap": 2.0}, torch.bfloat16, id="chunk-softcap-bf16"),
]


def plain_attention(query: torch.Tensor, contiguous: list[tuple[torch.Tensor, torch.Tensor]],
                    query_lens: list[int], scale: float, window: int = 0, chunk: int = 0,
                    sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Per sequence, one float32 softmax over all its queries' scores at once (no tiles):
    soft-capped scores, the causal / window / chunk mask, a sink column dropped after."""
    outputs, start = [], 0
    for (key, value), num_queries in zip(contiguous, query_lens, strict=True):
        seq_len = key.shape[0]
        q = query[start:start + num_queries].float().transpose(0, 1)  # [Hq, n, D]
        k, v = (t.float().repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1)
                .transpose(0, 1) for t in (key, value))  # [Hq, L, D]
        scores = q @ k.transpose(1, 2) * scale  # [Hq, n, L]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        i = torch.arange(num_queries)[:, None] + seq_len - num_queries
        j = torch.arange(seq_len)[None, :]
        mask = (j <= i) & ((j > i - window) if window else True) \
            & ((j // chunk == i // chunk) if chunk else True)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks[:, None, None].expand(-1, num_queries, 1)], -1)
        probs = torch.softmax(scores, dim=-1)[..., :seq_len]
        outputs.append((probs @ v).transpose(0, 1).to(query.dtype))  # [n, Hq, D]
        start += num_queries
    return torch.cat(outputs)


@pytest.mark.parametrize(("kind", "dtype"), KINDS)
def test_a_chunk_in_several_query_tiles_matches_one_softmax(kind: dict, dtype: torch.dtype,
                                                            monkeypatch: pytest.MonkeyPatch):
    torch.manual_seed(17)
    inputs, contiguous = paged_inputs(BLOCK, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype,
                                      SEQ_LENS, QUERY_LENS)
    kind = dict(kind)
    if kind.get("sinks"):
        kind["sinks"] = torch.randn(NUM_Q_HEADS) * 2 + 1
    # the 40-key row gathers 40 keys (8 blocks of 5): one tile is TILE queries of them
    monkeypatch.setattr(attention_reference, "_SCORES_PER_TILE",
                        NUM_Q_HEADS * SEQ_LENS[0] * TILE)
    tiles = []
    real = attention_reference._softmax_tile
    monkeypatch.setattr(attention_reference, "_softmax_tile",
                        lambda query, *rest: tiles.append(query.shape[3]) or real(query, *rest))
    actual = attention_reference.paged_attention_reference(*inputs, scale=0.3, **kind)
    assert tiles.count(TILE) >= 5 and QUERY_LENS[0] % TILE in tiles, f"tiles taken: {tiles}"
    expected = plain_attention(inputs[0], contiguous, QUERY_LENS, 0.3, **kind)
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])
