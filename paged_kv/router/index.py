"""`PrefixIndex`: which replica holds which block, fed by the replicas' KV events.

A replica whose model has recurrent layers (its batches declare a state group:
`paged_kv.events.schema`) serves a prefix only where a state checkpoint sits after its last
block, so the index also keeps its checkpoints, and its match ends at the deepest one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np

from ..events.schema import REMOVED_GROUP, STATE_KIND, STORED_GROUP, STORED_KIND
from ..keys import KEY_BYTES, block_keys, root_hash

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

    A replica whose model has recurrent layers is never matched past its state: its
    checkpoint keys (the leading group's block key, then the state group's number) are
    kept per replica, and its match counts its run of blocks only up to the deepest block
    after which it holds a checkpoint of every state group (0 without one) — the cache's
    "never a hit without its state", router-side. A guess there also guesses the
    checkpoint after the prompt's last full block (the cache keeps a prompt's last
    boundary while it has room). Replicas without recurrent layers match as before.
    """

    def __init__(self, guess_ttl: float = 10.0) -> None:
        self._where: dict[bytes, dict[str, set[str]]] = {}
        self._held: dict[str, set[bytes]] = {}
        self._guesses: dict[bytes, dict[str, float]] = {}  # key -> {replica: expiry}
        self._state_groups: dict[str, set[int]] = {}  # replica -> its recurrent groups
        # replica -> {checkpoint key: tiers}: what its events say it holds
        self._checkpoints: dict[str, dict[bytes, set[str]]] = {}
        # the leading group's key -> {replica: expiry}: a checkpoint guessed after it
        self._state_guesses: dict[bytes, dict[str, float]] = {}
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

    def checkpoints_of(self, replica: str) -> frozenset[bytes]:
        """The state checkpoint keys `replica`'s events say it holds."""
        with self._lock:
            return frozenset(self._checkpoints.get(replica, ()))

    def state_groups(self, replica: str) -> frozenset[int]:
        """The recurrent state groups `replica` declared (empty: attention only, or not
        heard from yet): non-empty, its matches end at a checkpoint."""
        with self._lock:
            return frozenset(self._state_groups.get(replica, ()))

    def apply(self, replica: str, events: Iterable[list]) -> None:
        """Apply one batch of `replica`'s events (vLLM's arrays, see `paged_kv.events`):
        its blocks, and its state checkpoints and their group's declaration."""
        with self._lock:
            held = self._held.setdefault(replica, set())
            for event in events:
                if event[0] == "BlockStored":
                    tier = event[6] if len(event) > 6 and event[6] else "GPU"
                    if (group := _state_group(event)) is not None:  # checkpoints
                        self._store_checkpoints(replica, group, event[1], tier)
                        continue
                    for key in event[1]:
                        self._where.setdefault(key, {}).setdefault(replica, set()).add(tier)
                        held.add(key)
                        self._guesses.get(key, {}).pop(replica, None)
                elif event[0] == "BlockRemoved":  # from one tier (all when none is named)
                    tier = event[2] if len(event) > 2 else None
                    if len(event) > REMOVED_GROUP and \
                            event[REMOVED_GROUP] in self._state_groups.get(replica, ()):
                        self._remove_checkpoints(replica, event[1], tier)
                        continue
                    for key in event[1]:
                        self._drop(replica, key, held, tier)
                elif event[0] == "AllBlocksCleared":  # the engine's pool; tiers keep theirs
                    # and checkpoints stay: the cache's reset keeps them (their own
                    # BlockRemoved says when they go)
                    for key in list(held):
                        self._drop(replica, key, held, "GPU")

    def clear(self, replica: str) -> None:
        """Forget everything about `replica` (it stopped answering, or restarted)."""
        with self._lock:
            self._clear(replica)

    def guess(self, replica: str, keys: Sequence[bytes]) -> None:
        """Note that `keys` were just sent to `replica` (until its events say otherwise),
        and a state checkpoint after the last of them, which counts only if the replica's
        model has recurrent layers (its cache keeps a prompt's last boundary while it has
        room)."""
        expiry = time.monotonic() + self._ttl
        with self._lock:
            for key in keys:
                if replica not in self._where.get(key, ()):
                    self._guesses.setdefault(key, {})[replica] = expiry
            if keys:  # (used only if the replica's model has recurrent layers)
                self._state_guesses.setdefault(keys[-1], {})[replica] = expiry

    def match(self, keys: Sequence[bytes], replicas: Iterable[str]) -> dict[str, float]:
        """Per replica, its longest run of `keys` from the first, each block weighted by
        its best tier (`TIER_WEIGHTS`); for a replica with recurrent layers, that run only
        up to its deepest block followed by a state checkpoint (0 if none)."""
        score = dict.fromkeys(replicas, 0.0)
        alive, now = set(score), time.monotonic()
        with self._lock:
            recurrent = {r: tuple(self._state_groups[r]) for r in score
                         if self._state_groups.get(r)}
            served = dict.fromkeys(recurrent, 0.0)  # the score up to its deepest checkpoint
            for key in keys:
                where, guesses = self._where.get(key, {}), self._guesses.get(key, {})
                for replica in list(alive):
                    tiers = where.get(replica)
                    if not tiers and guesses.get(replica, 0.0) > now:
                        tiers = ("ROUTED",)
                    if not tiers:
                        alive.discard(replica)
                        continue
                    score[replica] += max(TIER_WEIGHTS.get(t, 0.5) for t in tiers)
                    if replica in recurrent and \
                            self._has_state(replica, key, recurrent[replica], now):
                        served[replica] = score[replica]
                if not alive:
                    break
        score.update(served)
        return score

    def expire(self) -> None:
        """Drop guesses past their time (called now and then, not per request)."""
        now = time.monotonic()
        with self._lock:
            for table in (self._guesses, self._state_guesses):
                for key in list(table):
                    left = {r: t for r, t in table[key].items() if t > now}
                    if left:
                        table[key] = left
                    else:
                        del table[key]

    def _has_state(self, replica: str, key: bytes, groups: tuple[int, ...],
                   now: float) -> bool:
        """Whether `replica` holds (or was just sent, a guess) a checkpoint of every one
        of `groups` after the leading group's block `key`."""
        held = self._checkpoints.get(replica, {})
        if all(_checkpoint_key(key, group) in held for group in groups):
            return True
        return self._state_guesses.get(key, {}).get(replica, 0.0) > now

    def _store_checkpoints(self, replica: str, group: int, keys: list, tier: str) -> None:
        """`replica` has recurrent layers in `group` (a declaration when `keys` is empty)
        and holds its checkpoints `keys` in `tier` now."""
        self._state_groups.setdefault(replica, set()).add(group)
        held = self._checkpoints.setdefault(replica, {})
        for key in keys:
            held.setdefault(key, set()).add(tier)
            if isinstance(key, bytes):  # confirmed: no longer a guess
                self._state_guesses.get(key[:KEY_BYTES], {}).pop(replica, None)

    def _remove_checkpoints(self, replica: str, keys: list, tier: str | None) -> None:
        """`replica`'s checkpoints `keys` left `tier` (every tier when None)."""
        held = self._checkpoints.get(replica, {})
        for key in keys:
            tiers = held.get(key)
            if tiers is not None and tier is not None:
                tiers.discard(tier)
                if tiers:
                    continue  # still in another tier of that replica
            held.pop(key, None)
            if isinstance(key, bytes):
                self._state_guesses.get(key[:KEY_BYTES], {}).pop(replica, None)

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
        for guesses in (*self._guesses.values(), *self._state_guesses.values()):
            guesses.pop(replica, None)
        # a restarted replica may serve another model: it declares its groups again
        self._state_groups.pop(replica, None)
        self._checkpoints.pop(replica, None)


def _state_group(event: list) -> int | None:
    """The state group whose checkpoints a ``BlockStored`` stores (None: blocks)."""
    if len(event) > STORED_KIND and event[STORED_KIND] == STATE_KIND \
            and type(event[STORED_GROUP]) is int:
        return event[STORED_GROUP]
    return None


def _checkpoint_key(key: bytes, group: int) -> bytes | None:
    """The key a replica indexes group `group`'s checkpoint after block `key` under
    (`paged_kv.core.groups.rules.group_key`); None for a group no byte names."""
    if not 0 <= group < 256:
        return None
    return key if group == 0 else key + bytes([group])
