"""The checkpoint policy's heap stays whole through a step's offers: a re-ranked
checkpoint's entry takes a stale heap top's place (`CheckpointPolicy._push`, one sift
where an offer's eviction left its victim's entry on top), so an entry wrongly dropped or
a stale one kept would change which checkpoints go later. After each batch the heap must
evict the written checkpoints in the order of their ranks, and one `offer` after another
and `offer_all` must agree; `confirm` of one read-only rows array reused across steps (its
kept set of rows) matches `confirm` of a plain list."""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from paged_kv.core.groups.checkpoints import SHARED
from paged_kv.core.groups.state import StateSlots

KEYS = [bytes([k]) * 8 for k in range(1, 16)]
ROWS = 5

_offer = st.tuples(st.sampled_from(KEYS), st.integers(1, 8), st.integers(0, ROWS - 1),
                   st.booleans())
_batch = st.tuples(st.lists(_offer, min_size=1, max_size=8),
                   st.lists(st.integers(0, ROWS - 1), max_size=ROWS), st.booleans())


def _drained(slots: StateSlots) -> list[int]:
    """Every written checkpoint in the order the policy's heap evicts them (on a copy),
    which must be the order of their ranks: a heap entry lost (a checkpoint the heap no
    longer finds) or a stale one taken shows as a difference."""
    policy, order = copy.deepcopy(slots.policy), []
    by_rank = [slot for _, slot in sorted((rank, slot) for slot, rank in policy.ranks().items())]
    while (slot := policy.evict_below(SHARED)) is not None:
        order.append(slot)
    assert order == by_rank
    return order


@settings(max_examples=200, deadline=None)
@given(num_slots=st.integers(ROWS + 1, ROWS + 8), interval=st.sampled_from([0, 32]),
       batches=st.lists(_batch, min_size=1, max_size=12))
def test_offer_all_heap_drains_as_offer(num_slots, interval, batches):
    pair = [StateSlots(num_slots, interval=interval) for _ in range(2)]
    handles = np.arange(ROWS, dtype=np.int64)
    handles.flags.writeable = False  # one array every step, as a decode step's handles
    for slots in pair:
        for row in range(ROWS):
            slots.take_live(row)
    for offers, confirmed, all_rows in batches:
        for batched, slots in enumerate(pair):
            # the batched side confirms through the kept set of one read-only array
            if all_rows:
                slots.confirm(handles if batched else list(range(ROWS)))
            else:
                slots.confirm(confirmed)
            offered = [(key, 16 * position, row, shared, 0)
                       for key, position, row, shared in offers]
            taken = (slots.offer_all(offered) if batched
                     else [slots.offer(*offer) for offer in offered])
            slots.events.append(("taken", -1, repr(taken).encode()))
            slots.check(list(range(ROWS)))
        assert pair[0].snapshot() == pair[1].snapshot()
        assert tuple(pair[0].events) == tuple(pair[1].events)
        assert _drained(pair[0]) == _drained(pair[1])


def test_confirm_set_follows_new_arrays_and_pending_rows_past_it():
    """A kept set of rows is for its own array only: a new read-only array of other rows, and
    pending rows past the rows the set was made of, are confirmed as a list would."""
    slots = StateSlots(40)
    for row in range(8):
        slots.take_live(row)
    first = np.array([0, 1, 2, 3, 4, 5], dtype=np.int64)
    first.flags.writeable = False
    slots.offer_all([(b"a" * 8, 16, 1, False, 0), (b"b" * 8, 16, 7, False, 0)])
    slots.confirm(first)  # row 7 is pending, not in the step: stays pending
    assert slots.find(b"a" * 8) is not None and slots.find(b"b" * 8) is None
    other = np.array([6, 7, 0, 1, 2, 3, 4], dtype=np.int64)
    other.flags.writeable = False
    slots.confirm(other)
    assert slots.find(b"b" * 8) is not None
