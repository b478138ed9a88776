"""Shared helpers of the mixer tests (tests/integrations/test_mixer_*.py): a transformers
recurrent module with random weights, packed batches, zero states, and what transformers
itself computes for a sequence, with and without its cache."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import torch

from paged_kv.integrations.mixers import MixerOutput, mixer_of
from paged_kv.integrations.recurrent import CACHE_ATTRIBUTES, StateSpec, recurrent_layers

HIDDEN = 64
# a decode, a short prefill, one not a multiple of anything, one past two kernel widths
LENGTHS = (1, 5, 17, 33)


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter of `module` drawn afresh at a scale where each term of the mixer
    matters: transformers' init leaves outputs ~1e-5 (0.02-std projections, D = 1, the time
    step near zero), where a dropped state or skip would hide in the tolerance."""
    generator = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        draw = torch.randn(p.shape, generator=generator)
        if name == "A_log":  # A = -exp(A_log) in [-e, -1/e]: states decay, but over tokens
            draw = torch.rand(p.shape, generator=generator) * 2 - 1
        elif name.endswith("layernorm.weight"):
            draw = 1 + 0.2 * draw
        elif p.dim() >= 2:  # projections and conv taps: unit-scale outputs
            draw = draw / math.sqrt(p[0].numel())
        else:  # biases (dt_proj's too: time steps ~softplus(N(0, 1))), D
            draw = 0.5 * draw
        p.copy_(draw.to(p.dtype))


def randomized(build) -> torch.nn.Module:
    """`build()`'s module, seeded with 0, in eval mode, its parameters redrawn (`randomize`)."""
    torch.manual_seed(0)
    module = build().eval()
    randomize(module)
    return module


def random_sequences(lengths: Sequence[int], hidden: int, dtype: torch.dtype = torch.float32,
                     seed: int = 1) -> list[torch.Tensor]:
    """One ``[n, hidden]`` random sequence per length, drawn from a generator of `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=generator).to(dtype) for n in lengths]


def specs_of(module: torch.nn.Module, dtype: torch.dtype) -> tuple[StateSpec, ...]:
    """The states the engine keeps for `module`'s layer."""
    return recurrent_layers(module.config, dtype)[module.layer_idx]


def zero_states(specs: Sequence[StateSpec], batch: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(batch, *spec.shape, dtype=spec.dtype) for spec in specs)


def pack(sequences: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L_b, hidden]`` sequences -> (``[T, hidden]`` packed, int64 cu_seqlens ``[B + 1]``)."""
    lengths = torch.tensor([0, *(len(s) for s in sequences)], dtype=torch.int64)
    return torch.cat(list(sequences)), lengths.cumsum(0)


def split(packed: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    return [packed[a:b] for a, b in pairwise(cu_seqlens.tolist())]


@torch.no_grad()
def run(module: torch.nn.Module, sequences: Sequence[torch.Tensor],
        states: tuple[torch.Tensor, ...], emit_at: Sequence[int] = ()
        ) -> tuple[list[torch.Tensor], MixerOutput]:
    """The module's mixer over `sequences` packed in one call: (outputs per sequence,
    the mixer's result)."""
    hidden, cu = pack(sequences)
    result = mixer_of(module)(module, hidden, states, cu,
                              torch.tensor(list(emit_at), dtype=torch.int64))
    assert result.out.shape == hidden.shape and result.out.dtype == hidden.dtype
    for given, final in zip(states, result.final, strict=True):
        assert final.shape == given.shape and final.dtype == given.dtype
    return split(result.out, cu), result


@torch.no_grad()
def forward(module: torch.nn.Module, sequence: torch.Tensor) -> torch.Tensor:
    """transformers' forward of `module` on one sequence alone (batch 1, no cache)."""
    return module(sequence[None])[0]


@torch.no_grad()
def cached(module: torch.nn.Module, chunks: Sequence[torch.Tensor]
           ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """transformers' cache path: `chunks` of one sequence run one after the other through a
    ``DynamicCache`` (a prompt, then one-token steps, is what ``generate`` runs): (outputs per
    chunk, the states its cache holds after them, ``[1, ...]`` per spec)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=module.config)
    outputs = [module(chunk[None], cache=cache)[0] for chunk in chunks]
    layer = cache.layers[module.layer_idx]
    specs = specs_of(module, chunks[0].dtype)
    return outputs, tuple(getattr(layer, CACHE_ATTRIBUTES[s.name])[0] for s in specs)


def close(actual: torch.Tensor, expected: torch.Tensor, loose: bool = False) -> None:
    """Float32 agreement (the same sums in another order), or bfloat16's (each rounding of
    an intermediate differs: ~1% of the output's scale)."""
    if loose:
        scale = float(expected.float().abs().mean())
        torch.testing.assert_close(actual.float(), expected.float(), rtol=0.05,
                                   atol=0.05 * scale)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def differs(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """True when `actual` is clearly not `expected`: what a test's control checks, so that
    the agreement it asserts could have failed."""
    return float((actual - expected).abs().max()) > 1e-2 * float(expected.abs().mean())
