"""What the engine accepts: its configuration, and a request it can ever run (ValueError or
TypeError naming the problem, before anything changes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..config import CacheConfig
from .sampling import SamplingParams


def check_limits(cache_config: CacheConfig, preemption: str, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
    """ValueError naming the argument, before anything is built."""
    if preemption not in ("recompute", "swap"):
        raise ValueError(f"preemption: expected 'recompute' or 'swap', got {preemption!r}")
    if preemption == "swap" and not cache_config.num_host_blocks:
        raise ValueError("preemption='swap' needs cache_config.num_host_blocks > 0")
    for name, value in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
        if value < 1:
            raise ValueError(f"{name}: expected >= 1, got {value}")


def check_request(prompt_token_ids: Sequence[int], params: SamplingParams, model_config: Any,
                  max_num_seqs: int, cache_config: CacheConfig,
                  max_num_batched_tokens: int | None = None) -> list[int]:
    """The prompt as a list, or the error for a request that can never run.

    Parameters
    ----------
    prompt_token_ids : sequence of int
    params : SamplingParams
    model_config : object
        The model's ``config``: its ``vocab_size`` and ``max_position``.
    max_num_seqs : int
        The engine's limit (a request's `n` samples run at once).
    cache_config : CacheConfig
        The pool, which must hold the longest sequence the request can reach.
    max_num_batched_tokens : int, optional
        The most tokens a step computes: a window layer holds its window and one step's
        tokens (default: the whole prompt in one step).

    Raises
    ------
    TypeError
        `params` is not a `SamplingParams`.
    ValueError
        Naming the problem.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
    prompt = list(prompt_token_ids)
    if not prompt:
        raise ValueError("prompt_token_ids: empty prompt; give at least one token")
    vocab = model_config.vocab_size
    # the common case in C-level passes; the scan that names the bad ids only on failure
    fine = all(type(t) is int for t in prompt) and min(prompt) >= 0 and max(prompt) < vocab
    bad = [] if fine else [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)
                           or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_token_ids: token ids must be ints in [0, {vocab}), "
                         f"got {bad[:5]}")
    if params.n > max_num_seqs:
        raise ValueError(f"SamplingParams.n={params.n} exceeds max_num_seqs={max_num_seqs}")
    total = len(prompt) + params.max_tokens
    if total > model_config.max_position:
        raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) = "
                         f"{total} exceeds the model's max_position "
                         f"({model_config.max_position})")
    # a window group holds its window and a step's tokens
    step = len(prompt) if max_num_batched_tokens is None else min(len(prompt),
                                                                  max_num_batched_tokens)
    needed = cache_config.blocks_for_sequence(total - 1, step)
    room, reserved = _room_blocks(cache_config)
    if needed > room:
        less = f" less the tenants' reservations ({reserved})" if reserved else ""
        raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) needs "
                         f"{needed} blocks, more than the pool's "
                         f"{cache_config.num_usable_blocks}{less}; raise num_blocks")
    return prompt


def _room_blocks(cache_config: CacheConfig) -> tuple[int, int]:
    """The blocks one request may hold, and the reservations kept from it: other tenants'
    reserved cached blocks are never evicted for it, so a request needing more than the
    rest could wait for ever (its own reservation is left out too: conservative)."""
    policy = cache_config.tenants
    reserved = policy.reserved_blocks if policy is not None else 0
    return cache_config.num_usable_blocks - reserved, reserved


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """What a request is checked against, apart from the engine: the server's front process
    checks and sizes requests with it before they reach the engine core (picklable).

    Parameters
    ----------
    model_config : object
        The model's ``config`` (``vocab_size``, ``max_position``).
    max_num_seqs : int
    cache_config : CacheConfig
    kv_events : dict, optional
        Where the engine publishes its KV events (`EventPublisher.info`), for
        ``GET /kv_events``; None when it does not.
    """

    model_config: Any
    max_num_seqs: int
    cache_config: CacheConfig
    kv_events: dict | None = None
    max_num_batched_tokens: int | None = None

    @classmethod
    def of(cls, engine: Any) -> EngineLimits:
        """The limits of an `Engine`."""
        events = None if engine.events is None else engine.events.info()
        return cls(engine.model.config, engine.max_num_seqs, engine.cache.config, events,
                   engine.scheduler.max_num_batched_tokens)

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise what `Engine.add_request` would for this request (see `check_request`)."""
        check_request(prompt_token_ids, params, self.model_config, self.max_num_seqs,
                      self.cache_config, self.max_num_batched_tokens)

    def room(self, prompt_len: int) -> int:
        """Tokens a prompt of `prompt_len` may still grow by: the context and the pool's limit
        (at least 1)."""
        config = self.cache_config
        limit = min(self.model_config.max_position,
                    _room_blocks(config)[0] * config.block_size + 1)
        return max(limit - prompt_len, 1)
