"""`StateSlots`' checks: its invariants, and a comparable copy of its bookkeeping.

`StateSlots` (`paged_kv.core.groups.state`) inherits them, as the cache inherits its
admissions: the slot bookkeeping a step runs is one module, the verification that tests and
`PagedKVCache.check` run over it another.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...errors import ensure
from .checkpoints import CheckpointPolicy
from .state_tenants import CheckpointShares


class SlotChecks:
    """`check` and `snapshot` over a `StateSlots`' bookkeeping (the attributes below are
    its: see `StateSlots.__init__`)."""

    num_slots: int
    policy: CheckpointPolicy
    shares: CheckpointShares | None
    num_written: int
    num_hits: int
    num_evicted: int
    _free: list[int]
    _live: dict[int, int]
    _live_by_row: np.ndarray
    _slot_of: dict[bytes, int]
    _key_of: dict[int, tuple[bytes, int]]
    _pending: dict[int, list[bytes]]
    _tier: np.ndarray
    _latest: np.ndarray
    _latest_of: np.ndarray
    _position: np.ndarray
    _key_scratch: np.ndarray

    def check(self, rows: Sequence[int]) -> None:
        """Live slots are exactly `rows`' (the resident rows), one each; the checkpoint
        index and its slots agree; free, live and checkpoints partition the slots."""
        ensure(sorted(self._live) == sorted(rows), "live state slots are not the rows'")
        by_row = {row: int(slot) for row, slot in enumerate(self._live_by_row) if slot >= 0}
        ensure(by_row == self._live, "the live slots by row are out of step")
        live = list(self._live.values())
        ensure(len(set(live)) == len(live), "two rows share a live state slot")
        ensure(all(self._key_of.get(slot, (None,))[0] == key
                   for key, slot in self._slot_of.items())
               and len(self._slot_of) == len(self._key_of), "checkpoint index out of step")
        # every checkpoint is either pending (a row's last commit took it) or written (the
        # policy's), never both, and the policy holds nothing else
        pending = [self._slot_of[key] for keys in self._pending.values() for key in keys]
        written = [slot for slot in self._key_of if slot in self.policy]
        ensure(sorted(pending + written) == sorted(self._key_of)
               and len(self.policy) == len(written),
               "a checkpoint is neither pending nor evictable, or both")
        tiers = self._tiers()
        ensure(tiers.keys() == self._key_of.keys()
               and all(tiers[slot] == self.policy.tier_of(slot) for slot in written),
               "a checkpoint's tier is lost or out of step with the policy")
        ensure(all(self._position[slot] == position
                   for slot, (_, position) in self._key_of.items()),
               "a checkpoint's position is out of step with its key's")
        ensure(bool((self._key_scratch == -1).all()), "the offers' scratch was left set")
        latest_of = _by_index(self._latest_of)
        latest = _by_index(self._latest)
        ensure(all(latest_of.get(slot) == row for row, slot in latest.items())
               and len(latest) == len(latest_of)
               and set(latest) <= set(self._live)
               and set(latest_of) <= set(self._key_of), "newest checkpoints out of step")
        every = self._free + live + list(self._key_of)
        ensure(len(every) == len(set(every)) == self.num_slots,
               "free, live and checkpoint slots do not partition the slab")
        ensure(self.shares is None or self.shares.matches(set(self._key_of)),
               "checkpoint tenants out of step with the checkpoints")

    def _tiers(self) -> dict[int, int]:
        """``{slot: tier}`` of every checkpoint (pending ones included)."""
        return _by_index(self._tier)

    def snapshot(self) -> tuple:
        """Comparable copy of the bookkeeping (for tests of rejected calls)."""
        return (tuple(self._free), tuple(sorted(self._live.items())),
                tuple(sorted(self._key_of.items())), tuple(sorted(self._tiers().items())),
                tuple(sorted(_by_index(self._latest).items())),
                tuple(sorted((row, tuple(keys)) for row, keys in self._pending.items())),
                tuple(sorted(s for s in self._key_of if s in self.policy)),
                self.num_written, self.num_hits, self.num_evicted,
                None if self.shares is None else self.shares.snapshot())


def _by_index(values: np.ndarray) -> dict[int, int]:
    """``{index: value}`` of the entries of `values` that are not negative (-1: none)."""
    indices = np.flatnonzero(values >= 0)
    return dict(zip(indices.tolist(), values[indices].tolist(), strict=True))
