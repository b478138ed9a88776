"""The fast torch paths of the recurrences (`paged_kv.kernels.recurrent_chunked`: the chunked
gated delta rule and SSD, the vectorised convolution) against the sequential scan they
replace for long sequences, which stays the reference (``recurrent.CHUNKED_FROM[name] =
None``, ``recurrent.VECTORISED_CONV = False``).

One call holds a ragged batch (0, 1, 5, 17, 70 and 130 tokens: an empty sequence, decodes,
one partial and several full chunks of 64), non-zero initial states, and emissions at first,
middle and last tokens and on both sides of chunk edges. float32 within ``1e-4`` relative
(the chunked sums run in another order, and the delta rule through a triangular solve);
bfloat16 inputs within bfloat16's rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_kv.kernels import recurrent

LENGTHS = (0, 1, 5, 17, 70, 130)
FLOAT32 = {"atol": 1e-4, "rtol": 1e-4}
BFLOAT16 = {"atol": 2e-2, "rtol": 2e-2}


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGED_KV_BACKEND", "torch")
    torch.manual_seed(0)


def _cu(lengths) -> torch.Tensor:
    return F.pad(torch.tensor(lengths, dtype=torch.int64).cumsum(0), (1, 0))


def _emit_at(lengths) -> torch.Tensor:
    """Each sequence's first, middle and last token, and both sides of its chunk edges."""
    cu, picks = _cu(lengths), []
    for b, length in enumerate(lengths):
        inside = {0, length // 2, length - 1, 62, 63, 64, 65, 127, 128}
        picks += [int(cu[b]) + p for p in sorted(inside) if 0 <= p < length]
    return torch.tensor(picks[::-1] + picks[:3])  # unsorted, some twice


def _compare(monkeypatch, fn, name: str, args: dict, lengths, close: dict,
             shortest: int | None = 1) -> None:
    """`fn` with the fast path against the scan on the same inputs: outputs, final and
    emitted states."""
    cu, emit_at = _cu(lengths), _emit_at(lengths)
    runs = []
    for setting in (shortest, None):
        if name == "causal_conv1d":
            monkeypatch.setattr(recurrent, "VECTORISED_CONV", setting is not None)
        else:
            monkeypatch.setitem(recurrent.CHUNKED_FROM, name, setting)
        runs.append(fn(**args, cu_seqlens=cu, emit_at=emit_at))
    for got, want in zip(*runs, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), **close)


def _delta_args(lengths, key_heads: int, dtype: torch.dtype) -> dict:
    tokens, heads = sum(lengths), 4
    return {"q": torch.randn(tokens, key_heads, 16).to(dtype),
            "k": torch.randn(tokens, key_heads, 16).to(dtype),
            "v": torch.randn(tokens, heads, 12).to(dtype),
            "g": -F.softplus(torch.randn(tokens, heads) - 2).to(dtype),  # decays near 1
            "beta": torch.sigmoid(torch.randn(tokens, heads)).to(dtype),
            "state": torch.randn(len(lengths), heads, 16, 12)}


@pytest.mark.parametrize("key_heads", [4, 2, 1], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_chunked_gated_delta_rule_equals_the_scan(monkeypatch, key_heads, dtype):
    args = _delta_args(LENGTHS, key_heads, dtype)
    _compare(monkeypatch, recurrent.gated_delta_rule, "gated_delta_rule", args, LENGTHS,
             FLOAT32 if dtype == torch.float32 else BFLOAT16)


def test_gated_delta_rule_default_split_runs_both_paths(monkeypatch):
    """The default threshold: decodes scanned, the rest chunked, in one call."""
    args = _delta_args(LENGTHS, 2, torch.float32)
    _compare(monkeypatch, recurrent.gated_delta_rule, "gated_delta_rule", args, LENGTHS,
             FLOAT32, shortest=recurrent.CHUNKED_FROM["gated_delta_rule"])


def _ssd_args(lengths, groups: int, dtype: torch.dtype, dt: str) -> dict:
    tokens, heads = sum(lengths), 4
    options = {"bias": {"dt_bias": torch.randn(heads)},
               "limit": {"dt_bias": torch.randn(heads), "dt_limit": (0.05, 0.8)},
               "raw": {"dt_softplus": False}}[dt]
    step = torch.rand(tokens, heads) if dt == "raw" else torch.randn(tokens, heads) - 1
    return {"x": torch.randn(tokens, heads, 6).to(dtype), "dt": step.to(dtype),
            "A": -torch.exp(torch.randn(heads) / 2), "B": torch.randn(tokens, groups, 5).to(dtype),
            "C": torch.randn(tokens, groups, 5).to(dtype), "D": torch.randn(heads),
            "state": torch.randn(len(lengths), heads, 6, 5), **options}


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dt", ["bias", "limit", "raw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_chunked_ssd_equals_the_scan(monkeypatch, groups, dt, dtype):
    args = _ssd_args(LENGTHS, groups, dtype, dt)
    _compare(monkeypatch, recurrent.ssd, "ssd", args, LENGTHS,
             FLOAT32 if dtype == torch.float32 else BFLOAT16)


def test_ssd_default_split_runs_both_paths(monkeypatch):
    args = _ssd_args(LENGTHS, 2, torch.float32, "bias")
    _compare(monkeypatch, recurrent.ssd, "ssd", args, LENGTHS, FLOAT32,
             shortest=recurrent.CHUNKED_FROM["ssd"])


@pytest.mark.parametrize("width, bias, activation", [(3, True, "silu"), (4, False, None)],
                         ids=["window_k-1", "window_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_vectorised_conv_equals_the_scan(monkeypatch, width, bias, activation, dtype):
    tokens = sum(LENGTHS)
    args = {"x": torch.randn(tokens, 6).to(dtype), "weight": torch.randn(6, 4) / 2,
            "bias": torch.randn(6) if bias else None, "activation": activation,
            "conv_state": torch.randn(len(LENGTHS), 6, width).to(dtype)}
    _compare(monkeypatch, recurrent.causal_conv1d, "causal_conv1d", args, LENGTHS,
             {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else BFLOAT16)


def test_a_state_passes_through_an_empty_sequence_and_emitting_changes_nothing():
    """Emissions are read off the chunk grid, not cut into it: outputs and final states are
    the same bits with or without them."""
    args = _delta_args(LENGTHS, 2, torch.float32)
    cu = _cu(LENGTHS)
    plain = recurrent.gated_delta_rule(**args, cu_seqlens=cu)
    emitting = recurrent.gated_delta_rule(**args, cu_seqlens=cu, emit_at=_emit_at(LENGTHS))
    assert torch.equal(plain[0], emitting[0]) and torch.equal(plain[1], emitting[1])
    assert torch.equal(plain[1][0], args["state"][0])  # the empty sequence's
