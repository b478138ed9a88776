"""`PrefixIndex`: which replica holds which block, fed by the replicas' KV events."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np

from ..keys import block_keys, root_hash

# a cached block's worth by where it lives: the engine's pool, then the tiers behind it
# (llm-d weighs gpu 1.0, cpu 0.8); "ROUTED" is the router's own guess, not yet confirmed
TIER_WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.6, "REMOTE": 0.5, "ROUTED": 0.9}


def prompt_keys(token_ids: Sequence[int], block_size: int, salt: str | None) -> list[bytes]:
    """The chained keys of the prompt's full blocks, as a replica indexes them.

    Parameters
    ----------
    token_ids : sequence of int
        ``[num_tokens]`` the prompt as the replicas tokenize it.
    block_size : int
    salt : str, optional
        The tenant (the replicas' prefix-cache salt); None: no tenants.
    """
    return block_keys(np.asarray(token_ids, dtype=np.int64), block_size, root_hash(salt))


class PrefixIndex:
    """Block key → ``{replica: tiers}``, from events, plus the router's own routing guesses.

    Events are applied on the subscribers' threads and matches read on the server's; one
    lock keeps each operation whole. A guess (a prompt's keys at the replica it was sent
    to) lives `guess_ttl` seconds unless an event confirms or removes it: it covers the
    time until the replica's events arrive, and replicas that publish none.
    """

    def __init__(self, guess_ttl: float = 10.0) -> None:
        self._where: dict[bytes, dict[str, set[str]]] = {}
        self._held: dict[str, set[bytes]] = {}
        self._guesses: dict[bytes, dict[str, float]] = {}  # key -> {replica: expiry}
        self._ttl = guess_ttl
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        """(key, replica) entries from events."""
        with self._lock:
            return sum(len(held) for held in self._held.values())

    def count(self, replica: str) -> int:
        """Blocks `replica`'s events say it holds."""
        return len(self._held.get(replica, ()))

    def blocks_of(self, replica: str) -> frozenset[bytes]:
        """The keys `replica`'s events say it holds."""
        with self._lock:
            return frozenset(self._held.get(replica, ()))

    def apply(self, replica: str, events: Iterable[list]) -> None:
        """Apply one batch of `replica`'s events (vLLM's arrays, see `paged_kv.events`)."""
        with self._lock:
            held = self._held.setdefault(replica, set())
            for event in events:
                if event[0] == "BlockStored":
                    tier = event[6] if len(event) > 6 and event[6] else "GPU"
                    for key in event[1]:
                        self._where.setdefault(key, {}).setdefault(replica, set()).add(tier)
                        held.add(key)
                        self._guesses.get(key, {}).pop(replica, None)
                elif event[0] == "BlockRemoved":  # from one tier (all when none is named)
                    tier = event[2] if len(event) > 2 else None
                    for key in event[1]:
                        self._drop(replica, key, held, tier)
                elif event[0] == "AllBlocksCleared":  # the engine's pool; tiers keep theirs
                    for key in list(held):
                        self._drop(replica, key, held, "GPU")

    def clear(self, replica: str) -> None:
        """Forget everything about `replica` (it stopped answering, or restarted)."""
        with self._lock:
            self._clear(replica)

    def guess(self, replica: str, keys: Sequence[bytes]) -> None:
        """Note that `keys` were just sent to `replica` (until its events say otherwise)."""
        expiry = time.monotonic() + self._ttl
        with self._lock:
            for key in keys:
                if replica not in self._where.get(key, ()):
                    self._guesses.setdefault(key, {})[replica] = expiry

    def match(self, keys: Sequence[bytes], replicas: Iterable[str]) -> dict[str, float]:
        """Per replica, its longest run of `keys` from the first, each block weighted by
        its best tier (`TIER_WEIGHTS`)."""
        score = dict.fromkeys(replicas, 0.0)
        alive, now = set(score), time.monotonic()
        with self._lock:
            for key in keys:
                where, guesses = self._where.get(key, {}), self._guesses.get(key, {})
                for replica in list(alive):
                    tiers = where.get(replica)
                    if not tiers and guesses.get(replica, 0.0) > now:
                        tiers = ("ROUTED",)
                    if not tiers:
                        alive.discard(replica)
                    else:
                        score[replica] += max(TIER_WEIGHTS.get(t, 0.5) for t in tiers)
                if not alive:
                    break
        return score

    def expire(self) -> None:
        """Drop guesses past their time (called now and then, not per request)."""
        now = time.monotonic()
        with self._lock:
            for key in list(self._guesses):
                left = {r: t for r, t in self._guesses[key].items() if t > now}
                if left:
                    self._guesses[key] = left
                else:
                    del self._guesses[key]

    def _drop(self, replica: str, key: bytes, held: set[bytes],
              tier: str | None = None) -> None:
        where = self._where.get(key)
        tiers = None if where is None else where.get(replica)
        if tiers is not None and tier is not None:
            tiers.discard(tier)
            if tiers:
                return  # still in another tier of that replica
        held.discard(key)
        self._guesses.get(key, {}).pop(replica, None)
        if where is not None:
            where.pop(replica, None)
            if not where:
                del self._where[key]

    def _clear(self, replica: str) -> None:
        held = self._held.pop(replica, set())
        for key in held:
            self._drop(replica, key, set())
        for guesses in self._guesses.values():
            guesses.pop(replica, None)
