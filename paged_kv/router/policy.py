"""Which replica a request goes to: round robin, least load, or cache-aware."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

POLICIES = ("cache", "round_robin", "least_load")


class Choice(NamedTuple):
    """A routing decision: the replica, why (``cache`` / ``imbalance`` / ``no_hit`` /
    ``least_load`` / ``round_robin``), and the cached blocks it was chosen for."""

    replica: str
    reason: str
    hit_blocks: float


def choose(policy: str, replicas: Sequence[str], loads: Mapping[str, int],
           scores: Mapping[str, float], turn: itertools.count, *, num_tokens: int = 0,
           block_size: int | Mapping[str, int] = 16, room: Mapping[str, float] | None = None,
           load_tokens: float = 512.0, balance_abs: int = 8,
           balance_rel: float = 1.5) -> Choice:
    """Pick one of `replicas` (non-empty, in a fixed order).

    ``cache`` estimates each replica's cost in prompt tokens: those it would have to
    compute (the prompt less its cached prefix) plus `load_tokens` for each request it has
    in flight, and takes the cheapest; ties go to the replica with the most `room` (free
    or least valuable blocks: where a new prefix evicts the least), then in rotation. So a
    long cached prefix wins over a short queue, a one-block hit does not (Dynamo's router
    weighs overlap against active blocks the same way).

    Parameters
    ----------
    policy : {"cache", "round_robin", "least_load"}
    replicas : sequence of str
        The replicas that can take a request now.
    loads : mapping
        Requests in flight at each replica.
    scores : mapping
        Each replica's cached prefix of the request, in tier-weighted blocks.
    turn : itertools.count
        The router's turn counter: round robin, and ties broken in rotation.
    num_tokens : int
        The prompt's length.
    block_size : int or mapping
        The replicas' block size, or each replica's.
    room : mapping, optional
        Blocks each replica could take without evicting what its index holds.
    load_tokens : float
        What one request in flight costs, in prompt tokens to compute.
    balance_abs, balance_rel : int, float
        ``cache`` falls back to least load when the busiest replica has more than
        `balance_abs` requests above the idlest and more than `balance_rel` times its load
        (sglang-router's guard; its defaults are 64 and 1.5).
    """
    start = next(turn) % len(replicas)
    rotated = list(replicas[start:]) + list(replicas[:start])
    if policy == "round_robin":
        return Choice(rotated[0], "round_robin", scores.get(rotated[0], 0.0))
    least = min(rotated, key=lambda r: loads.get(r, 0))
    if policy == "least_load":
        return Choice(least, "least_load", scores.get(least, 0.0))
    high, low = max(loads.get(r, 0) for r in replicas), loads.get(least, 0)
    if high - low > balance_abs and high > balance_rel * low:
        return Choice(least, "imbalance", scores.get(least, 0.0))
    room = room or {}

    def cost(r: str) -> tuple[float, float]:
        size = block_size if isinstance(block_size, int) else block_size[r]
        hit = min(scores.get(r, 0.0) * size, num_tokens)
        return num_tokens - hit + load_tokens * loads.get(r, 0), -room.get(r, 0.0)

    pick = min(rotated, key=cost)
    hit = scores.get(pick, 0.0)
    return Choice(pick, "cache" if hit > 0 else "no_hit", hit)
