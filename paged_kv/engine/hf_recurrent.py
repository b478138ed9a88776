"""A transformers model's recurrent modules, run on the paged cache's state slab.

`HFCausalLM` packs a step's tokens of every sequence into one row. Each recurrent module of
the model (a gated delta net, a Mamba mixer, a short convolution) gets a forward of its own
that runs its mixer (`paged_kv.integrations.mixers`) over that row: the rows' states are
read from the slab (`PagedKVCache.read_states`), the final states and the checkpoints the
step asks for (the states after the last token of each block that fills, for the prefix
cache) written back (`PagedKVCache.write_states`). The module's weights are its own; only
its ``forward`` is replaced, on the instance.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..core.batch import StepBatch
from ..core.cache import PagedKVCache
from ..core.groups.state_batch import StateBatch
from ..integrations.hf_layers import ModelLayers
from ..integrations.hf_support import UnsupportedModelError
from ..integrations.mixers import Mixer, mixer_of


@dataclasses.dataclass
class StepContext:
    """The step a forward runs: set by `HFCausalLM.forward` around the model's call."""

    cache: PagedKVCache | None = None
    batch: StepBatch | None = None
    cu_seqlens: torch.Tensor | None = None  # int64 [B + 1]: the batch's query_start_loc
    ran: set[int] = dataclasses.field(default_factory=set)  # cache layers that ran

    def open(self, cache: PagedKVCache, batch: StepBatch) -> None:
        """Start `batch`'s forward."""
        self.cache, self.batch, self.cu_seqlens = cache, batch, None
        self.ran = set()

    def close(self) -> None:
        """End the forward (the step's tensors are not kept)."""
        self.cache = self.batch = self.cu_seqlens = None


def install_mixers(model: torch.nn.Module, layers: ModelLayers, step: StepContext) -> int:
    """Give every recurrent module of `model` a forward over the packed step (see the module
    docstring); returns how many were given one.

    A module's state is kept in its model layer's state layer (`ModelLayers.state_layers`:
    a hybrid layer's second cache layer, beside its attention's).

    Raises
    ------
    UnsupportedModelError
        A recurrent cache layer whose module has no mixer (it would keep no state), or a
        mixer in a model layer with no state layer.
    """
    given: set[int] = set()
    for module in model.modules():
        run = mixer_of(module)
        if run is None:
            continue
        cache_layer = layers.state_layers[module.layer_idx]
        if cache_layer is None:  # its state would have nowhere to live
            raise UnsupportedModelError(
                f"{type(model).__name__}: {type(module).__name__} of layer "
                f"{module.layer_idx} runs in a layer the config gives no recurrent state",
                [f"a recurrent module in layer {module.layer_idx}, not a recurrent layer"])
        module.forward = functools.partial(_mix, module, run, cache_layer, step)
        given.add(cache_layer)
    missing = [index for index, kind in enumerate(layers.kinds)
               if kind.is_recurrent and index not in given]
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__}: recurrent cache layers {missing} have no module the "
            f"engine runs (paged_kv.integrations.mixers.MIXERS), so no state would be kept",
            [f"recurrent layers {missing} without a mixer"])
    return len(given)


def _mix(module: torch.nn.Module, run: Mixer, layer: int, step: StepContext,
         hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """The module's forward on the packed step: ``[1, T, hidden] -> [1, T, hidden]``; the
    decoder layer's other arguments (its cache, its padding mask) have no use here."""
    cache, batch = step.cache, step.batch
    if cache is None or batch is None:
        raise RuntimeError(f"{type(module).__name__} runs only inside HFCausalLM.forward "
                           "(its states are in the paged cache)")
    if step.cu_seqlens is None:  # once per step, for every recurrent layer
        step.cu_seqlens = batch.query_start_loc.long()
    states = cache.read_states(layer, batch)
    emit = _state_batch(batch).emit_tokens
    result = run(module, hidden_states[0], states, step.cu_seqlens, emit)
    cache.write_states(layer, batch, result.final,
                       result.emitted if emit.shape[0] else None)
    step.ran.add(layer)
    return result.out[None]


def _state_batch(batch: StepBatch) -> StateBatch:
    for entry in batch.groups:
        if isinstance(entry, StateBatch):
            return entry
    raise ValueError("batch: no recurrent-state entry (not a batch of a cache with "
                     "recurrent layers)")
