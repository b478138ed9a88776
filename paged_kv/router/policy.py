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
           scores: Mapping[str, float], turn: itertools.count, *,
           balance_abs: int = 8, balance_rel: float = 1.5) -> Choice:
    """Pick one of `replicas` (non-empty, in a fixed order).

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
    best = max(scores.get(r, 0.0) for r in replicas)
    if best <= 0:
        return Choice(least, "no_hit", 0.0)
    tied = [r for r in rotated if scores.get(r, 0.0) >= best]
    pick = min(tied, key=lambda r: loads.get(r, 0))
    return Choice(pick, "cache", best)
