"""`EngineConfig`: everything an `Engine` is built from, in one frozen object (vLLM's
``VllmConfig`` is the model): the cache, the scheduler's knobs, the threads, tensor
parallelism, and the optional parts (tiers, KV events, a hand-off role, the caller's own).

The engine reads it and builds each part it names in a loop (`part_factories`): a new part
is a field here (or an entry of `parts`) and one class, never an edit of ``engine.py``.
Every field is checked when the config is made, so a bad one raises (naming it) before
anything is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import torch

from ..config import CacheConfig
from ..events import KVEventsConfig, open_publisher
from ..handoff import HandoffConfig, open_role
from ..parts import EnginePart, PartContext
from ..tiers import TierConfig
from .sizing import check_memory_fraction, given_or_sized

# builds a part from what the engine has so far (None: no part); a class whose constructor
# takes the `PartContext` is one
PartFactory = Callable[[PartContext], EnginePart | None]
PREEMPTION = ("recompute", "swap")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How an `Engine` is built.

    Parameters
    ----------
    cache : CacheConfig, optional
        Shape of the paged cache (must match the model's K/V). None: ``model.cache_config``
        with as many blocks as `memory_fraction` of the device's free memory holds.
    max_num_seqs : int
        Sequences running at once.
    max_num_batched_tokens : int
        Tokens per step (prefill chunks and decodes together).
    preemption : {"recompute", "swap"}
        What to do with a sequence when blocks run out ("swap" needs
        ``cache.num_host_blocks``).
    memory_fraction : float, optional
        Without `cache`: the share of free memory the pool takes, in (0, 1] (default 0.9,
        as vLLM's ``gpu_memory_utilization``); see `paged_kv.engine.sizing`.
    num_threads : int, optional
        torch intra-op threads while a step runs. Default on the CPU: torch's count while
        the cores are free, fewer while other processes use them (`paged_kv._threads`).
    tensor_parallel_size : int
        Split the model's heads and the KV pool over this many processes (torch.distributed:
        gloo on CPU); the engine starts the workers itself and stops them on `close` (see
        `paged_kv.engine.parallel`). The model must be a `TinyLlama` or an `HFCausalLM` loaded
        with ``from_pretrained``; `cache` is the whole model's.
    kv_tiers : TierConfig, optional
        Tiers behind the device pool (host RAM, disk, Redis): stored blocks are written
        down in the background and a prompt's missing blocks fetched back when that beats
        recomputing them (see `paged_kv.tiers`). Not with tensor parallelism yet.
    kv_events : KVEventsConfig, optional
        Publish the prefix index's changes after each step (vLLM's KV events over ZMQ, for
        a cache-aware router; see `paged_kv.events`).
    handoff : HandoffConfig, optional
        This engine's part in a prefill/decode hand-off between engines (see
        `paged_kv.handoff`; the serve extra): a prefill engine leases and serves the pages
        of requests that ask for it, a decode engine pulls them through the tiers' fetch
        path (a decode engine without tiers gets a fetch path of its own). Not with tensor
        parallelism yet.
    parts : tuple of EnginePart or PartFactory
        The caller's own parts, after the built-in ones: an `EnginePart` is used as it is
        (so the config serves one engine: the engine closes it), a factory is called with
        the `PartContext` (the cache, the model, the parts built before it) and returns a
        part or None. The engine calls each hook of each part (`paged_kv.parts`).

    Raises
    ------
    ValueError
        A field out of range or two that contradict each other, naming the field.
    TypeError
        A config object of the wrong type in a config's place.

    Examples
    --------
    >>> EngineConfig(max_num_seqs=8).max_num_seqs
    8
    >>> EngineConfig(preemption="drop")
    Traceback (most recent call last):
    ...
    ValueError: preemption: expected 'recompute' or 'swap', got 'drop'
    """

    cache: CacheConfig | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    preemption: str = "recompute"
    memory_fraction: float | None = None
    num_threads: int | None = None
    tensor_parallel_size: int = 1
    kv_tiers: TierConfig | None = None
    kv_events: KVEventsConfig | None = None
    handoff: HandoffConfig | None = None
    parts: tuple[EnginePart | PartFactory, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))  # a list given: kept frozen
        for name, kind in (("cache", CacheConfig), ("kv_tiers", TierConfig),
                           ("kv_events", KVEventsConfig), ("handoff", HandoffConfig)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name}: expected {kind.__name__} or None, "
                                f"got {type(value).__name__}")
        for i, part in enumerate(self.parts):
            if not isinstance(part, EnginePart) and not callable(part):
                raise TypeError(f"parts[{i}]: expected an EnginePart or a callable that "
                                f"builds one, got {type(part).__name__}")
        self._check_limits()
        if self.memory_fraction is not None:
            check_memory_fraction(self.memory_fraction)
            if self.cache is not None:
                raise ValueError("memory_fraction: give it or cache, not both")
        if self.tensor_parallel_size != 1:
            for name, on in (("kv_tiers", self.kv_tiers is not None and self.kv_tiers.enabled),
                             ("handoff", self.handoff is not None)):
                if on:
                    raise ValueError(f"{name}: not supported with tensor_parallel_size > 1 "
                                     f"yet")

    def _check_limits(self) -> None:
        """The scheduler's knobs, the threads and the ranks; a swap needs a host pool."""
        if self.preemption not in PREEMPTION:
            raise ValueError(f"preemption: expected 'recompute' or 'swap', "
                             f"got {self.preemption!r}")
        if self.preemption == "swap" and self.cache is not None \
                and not self.cache.num_host_blocks:
            raise ValueError("preemption='swap' needs cache.num_host_blocks > 0")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "num_threads"):
            value = getattr(self, name)
            if value is None and name == "num_threads":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
            if value < 1:
                raise ValueError(f"{name}: expected >= 1, got {value}")

    def sized_for(self, model: torch.nn.Module) -> EngineConfig:
        """This config with its `cache` given, or sized from `memory_fraction` of the free
        memory for `model` (`sizing.given_or_sized`; checked again: a swap needs the host
        pool the sized cache lacks)."""
        if self.cache is not None:
            self._check_latent(model, self.cache)
            self._check_states(self.cache)
            return self
        cache = given_or_sized(model, None, self.memory_fraction)
        self._check_latent(model, cache)
        self._check_states(cache)
        return dataclasses.replace(self, cache=cache, memory_fraction=None)

    def _check_latent(self, model: torch.nn.Module, cache: CacheConfig) -> None:
        """A model paged as latents (`HFCausalLM.num_latent`, DeepSeek V2 / V3): not split
        over ranks yet (each rank would need the whole latent and a share of the heads), and
        on float or 8-bit pages without rotation (the latent attention reads one scale per
        row half and unrotated rows), refused here, at start."""
        if not getattr(model, "num_latent", 0):
            return
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: not supported "
                             f"yet for a model with latent attention layers (DeepSeek V2 / V3's "
                             f"latent pages are not split over ranks); use 1")
        if cache.is_packed or cache.kv_rotation:
            raise ValueError(f"cache: kv_cache_dtype={cache.kv_cache_dtype!r}, kv_rotation="
                             f"{cache.kv_rotation}: a model with latent attention layers is "
                             f"served on float or 8-bit pages without rotation")

    def _check_states(self, cache: CacheConfig) -> None:
        """A layout with recurrent layers: a live state for every sequence the scheduler
        may run, and one rank (the states are not split over ranks yet): refused here, at
        start, rather than failing a request later. The tiers and the hand-off move the
        state checkpoints with the pages (`paged_kv.core.groups.state_values`)."""
        if not cache.num_state_slots:
            return
        if cache.num_state_slots < self.max_num_seqs:
            raise ValueError(f"cache.num_state_slots ({cache.num_state_slots}) holds fewer live "
                             f"recurrent states than max_num_seqs ({self.max_num_seqs}) "
                             f"sequences: raise num_state_slots or lower max_num_seqs")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: not "
                             f"supported yet for a model with recurrent layers (their "
                             f"states are not split over ranks); use 1")

    def part_factories(self) -> dict[str, PartFactory]:
        """The parts to build, by name, in the order the engine builds them and calls their
        hooks: the tiers first (the scheduler, the publisher and a decode role use them; a
        decode engine always has them: its hand-offs come through their fetch path), then
        the KV-event publisher, the hand-off role, and `parts` (named ``parts[i]``)."""
        decode = self.handoff is not None and self.handoff.role == "decode"
        factories: dict[str, PartFactory] = {}
        if decode or (self.kv_tiers is not None and self.kv_tiers.enabled):
            factories["tiers"] = partial(_tiers, self.kv_tiers, decode)
        if self.kv_events is not None:
            factories["events"] = partial(_publisher, self.kv_events)
        if self.handoff is not None:
            factories["handoff"] = partial(_role, self.handoff)
        for i, part in enumerate(self.parts):
            factories[f"parts[{i}]"] = (partial(_given, part) if isinstance(part, EnginePart)
                                        else part)
        return factories


def _tiers(config: TierConfig | None, always: bool, context: PartContext) -> EnginePart | None:
    from ..tiers.manager import open_tiers

    return open_tiers(config, context.cache, context.model, always=always)


def _publisher(config: KVEventsConfig, context: PartContext) -> EnginePart | None:
    states = context.cache.state_group  # declared in every batch: hits end at a checkpoint
    return open_publisher(config, context.cache.config.block_size, context.parts.get("tiers"),
                          () if states is None else (states.index,))


def _role(config: HandoffConfig, context: PartContext) -> EnginePart | None:
    return open_role(config, context.cache, context.parts.get("tiers"), context.model)


def _given(part: EnginePart, context: PartContext) -> EnginePart:
    return part
