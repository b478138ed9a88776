"""What the engine accepts: a request it can ever run (ValueError or TypeError naming the
problem, before anything changes; the engine's own configuration is `EngineConfig`'s)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..config import CacheConfig
from .sampling import SamplingParams


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
        tokens (default: the whole prompt in one step; see `request_blocks`).

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
    # the common case in C-level passes (the types by `map`: no Python frame a token, half
    # the time of a generator's), the scan that names the bad ids only on failure
    fine = {*map(type, prompt)} == _INT and min(prompt) >= 0 and max(prompt) < vocab
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
    step = len(prompt) if max_num_batched_tokens is None else min(len(prompt),
                                                                  max_num_batched_tokens)
    needed = request_blocks(cache_config, len(prompt), params.max_tokens, step)
    room, reserved = _room_blocks(cache_config)
    if needed > room:
        less = f" less the tenants' reservations ({reserved})" if reserved else ""
        raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) needs "
                         f"{needed} blocks, more than the pool's "
                         f"{cache_config.num_usable_blocks}{less}; raise num_blocks")
    return prompt


def request_blocks(cache_config: CacheConfig, prompt_len: int, max_tokens: int,
                   step_tokens: int) -> int:
    """The most blocks one sequence of a request holds at once, over every layer group.

    A window group holds its window and a step's tokens (`CacheConfig.blocks_for_sequence`),
    so the peak is either a step of the prompt (at most `step_tokens`, the prompt's blocks
    in every group) or a decode step at the longest (the full groups' blocks): after its
    prompt a sequence gains one token a step, and one recomputed after a preemption catches
    up in steps that stay within the pool (`catch_up_tokens`). Counting the full groups at
    the longest together with a prompt-sized step there, as one bound, refused requests
    that fit (a 75-token prompt and 30 new tokens, 3 window layers and a full one at block
    size 4: 89 blocks counted, 76 held at most).

    Examples
    --------
    >>> from paged_kv.config import LayerKind
    >>> window = LayerKind.sliding(4)
    >>> cfg = CacheConfig(num_layers=4, num_kv_heads=1, head_dim=4, block_size=4,
    ...                   layer_kinds=(window,) * 3 + (LayerKind(),))
    >>> request_blocks(cfg, 75, 30, 75)  # the prefill: 19 blocks in each of 4 groups
    76
    >>> request_blocks(cfg, 10, 200, 10)  # the last decode: 53 full blocks, 2 per window
    59
    """
    full_groups = _all_full(cache_config)
    if full_groups:  # a block per `block_size` tokens in every group: the peak is the
        # longest, counted once (two `blocks_for_sequence` calls group the layers twice,
        # ~15 us of a request's check, run in the API server and again in the core)
        return full_groups * cache_config.blocks_for(prompt_len + max(max_tokens - 1, 0))
    return max(cache_config.blocks_for_sequence(prompt_len, step_tokens),
               cache_config.blocks_for_sequence(prompt_len + max_tokens - 1, 1))


_INT = {int}
_FULL_GROUPS: dict[int, tuple[CacheConfig, int]] = {}  # id -> (the config, its count)


def _all_full(cache_config: CacheConfig) -> int:
    """How many block-holding layer groups `cache_config` has when all are full attention,
    else 0; worked out once per config (`layer_groups` groups the layers anew at every
    read). The config itself is kept with its count, so an id reused after it is gone
    never matches, and a few dozen configs at most (tests make many) are kept."""
    entry = _FULL_GROUPS.get(id(cache_config))
    if entry is None or entry[0] is not cache_config:
        if len(_FULL_GROUPS) >= 64:
            _FULL_GROUPS.clear()
        kinds = [kind for kind, _ in cache_config.layer_groups if not kind.is_recurrent]
        entry = _FULL_GROUPS[id(cache_config)] = (
            cache_config, len(kinds) if all(kind.is_full for kind in kinds) else 0)
    return entry[1]


def catch_up_tokens(cache_config: CacheConfig, num_tokens: int, left: int) -> int:
    """The most of `left` tokens one step of a sequence of `num_tokens` (a recomputed one,
    catching up) may take, so that it holds no more blocks than one request may
    (`request_blocks`): at least 1, as a decode step at the longest was counted."""
    room = _room_blocks(cache_config)[0]
    need = cache_config.blocks_for_sequence
    if need(num_tokens, left) <= room:
        return left  # always, for full attention
    low, high = 1, left  # a window group's blocks grow with the step: the largest that fits
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if need(num_tokens, middle) <= room else (low, middle - 1)
    return low


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
