"""Recurrent sequence mixers of transformers models, run over the engine's packed, mixed batch.

transformers' recurrent modules (a gated delta net, a Mamba-1 or Mamba-2 mixer, LFM2's
short convolution) run one padded batch from a cache of their own. The engine packs the
new tokens of every sequence of a step into one row (prefill chunks and decodes mixed), so
it runs each such module through a *mixer* instead: a function of the module's own weights
(its modules' forward or parameters; no modeling file is copied) over the packed tokens,
each sequence starting from its state in the paged cache's state slab::

    run(module, hidden_states [T, hidden], states, cu_seqlens [B + 1], emit_at [E])
        -> MixerOutput(out [T, hidden], final, emitted)

- ``states``: the step's initial states, one tensor per `paged_kv.config.StateSpec` of the
  layer (`paged_kv.integrations.recurrent.recurrent_layers`: the ``"conv"`` window
  ``[B, channels, kernel]`` in the model's dtype, then the ``"ssm"`` / ``"recurrent"``
  state in float32), zeros for a sequence that starts;
- ``final``: the states after each sequence's tokens, same shapes and dtypes;
- ``emitted``: the states after each packed token of ``emit_at`` (``[E, ...]`` per spec):
  the checkpoints the prefix cache keeps at block boundaries.

`MIXERS` names each module class the engine runs, by ``type(module).__name__``, and the
mixer that runs it (imported on first use).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["MIXERS", "Mixer", "MixerOutput", "mixer_of"]


class MixerOutput(NamedTuple):
    """What a mixer returns (see the module docstring)."""

    out: torch.Tensor                   # [T, hidden], the module's output dtype
    final: tuple[torch.Tensor, ...]     # [B, *spec.shape] per spec
    emitted: tuple[torch.Tensor, ...]   # [E, *spec.shape] per spec


Mixer = Callable[[torch.nn.Module, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor,
                  torch.Tensor], MixerOutput]

# transformers module class -> "submodule:function" of the mixer that runs it
MIXERS = {
    # gated delta rule (Qwen3-Next, Qwen3.5)
    "Qwen3NextGatedDeltaNet": "gated_delta:run_gated_delta_net",
    "Qwen3_5GatedDeltaNet": "gated_delta:run_gated_delta_net",
    "Qwen3_5MoeGatedDeltaNet": "gated_delta:run_gated_delta_net",
    "OlmoHybridGatedDeltaNet": "gated_delta:run_gated_delta_net",
    # Mamba-2 (state space duality)
    "Mamba2Mixer": "mamba2:run_mamba2",
    "NemotronHMamba2Mixer": "mamba2:run_mamba2",
    "GraniteMoeHybridMambaLayer": "mamba2:run_mamba2",
    "BambaMixer": "mamba2:run_mamba2",
    # Mamba-2 with Falcon-H1's µP multipliers and optional norm, beside attention
    "FalconH1Mixer": "falcon_h1:run_falcon_h1",
    # Mamba-1 (selective scan)
    "MambaMixer": "mamba1:run_mamba1",
    "FalconMambaMixer": "mamba1:run_mamba1",
    "JambaMambaMixer": "mamba1:run_mamba1",
    # LFM2's gated short convolution
    "Lfm2ShortConv": "short_conv:run_short_conv",
    "Lfm2MoeShortConv": "short_conv:run_short_conv",
}


def mixer_of(module: torch.nn.Module) -> Mixer | None:
    """The mixer that runs `module` (by its class name), None when it is not a recurrent
    module the engine runs."""
    target = MIXERS.get(type(module).__name__)
    if target is None:
        return None
    name, function = target.split(":")
    return getattr(importlib.import_module(f"{__name__}.{name}"), function)
