"""`StateSlots.offer_all` (a step's checkpoint offers in one call) against `offer` called on
each in order: the same slots, index, tiers, ranks, pending and newest checkpoints, events
and counts, with slots free or all taken (each offer then evicts below its tier), keys
repeated in a batch or indexed before it, several offers of one row in a batch, junctions,
rows confirmed, served, freed and taking live slots between the batches. Batches of
distinct keys go through the compiled loop (`StateSlots.offer_arrays`), others offer by
offer."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from paged_kv.core.groups.state import StateSlots

KEYS = [bytes([k]) * 8 for k in range(1, 13)]
ROWS = 4

_offer = st.tuples(st.sampled_from(KEYS), st.integers(1, 6), st.integers(0, ROWS - 1),
                   st.booleans())
_op = st.one_of(
    st.tuples(st.just("offer"), st.lists(_offer, min_size=1, max_size=6)),
    st.tuples(st.just("step"), st.lists(_offer, min_size=1, max_size=6)),
    st.tuples(st.just("confirm"), st.lists(st.integers(0, ROWS - 1), max_size=ROWS)),
    st.tuples(st.just("live"), st.integers(0, ROWS - 1)),
    st.tuples(st.just("serve"), st.sampled_from(KEYS)),
)


def _state(slots: StateSlots) -> tuple:
    policy = slots.policy
    return (slots.snapshot(), tuple(slots.events), sorted(policy.ranks().items()),
            slots.policy.victim())


@settings(max_examples=300, deadline=None)
@given(num_slots=st.integers(ROWS + 1, ROWS + 6), interval=st.sampled_from([0, 32]),
       ops=st.lists(_op, max_size=16), distinct=st.booleans())
def test_offer_all_matches_offer_in_order(num_slots, interval, ops, distinct):
    """`distinct`: each batch's keys made distinct (its first offer of a key kept), so the
    batch goes through the compiled loop (`offer_arrays`) rather than offer by offer."""
    pair = [StateSlots(num_slots, interval=interval) for _ in range(2)]
    for batched, slots in enumerate(pair):
        for row in range(ROWS):  # every row resident at first (offers are a live row's)
            slots.take_live(row)
        for op, arg in ops:
            if op in ("offer", "step"):
                if op == "step":  # as a step's commit: the rows' last checkpoints written
                    slots.confirm(list(slots._live))
                offers = [(key, 16 * position, row, shared, 0)  # a resident row's
                          for key, position, row, shared in arg if row in slots._live]
                if distinct:  # the first offer of each key, in order
                    first: dict[bytes, tuple] = {}
                    for offer in offers:
                        first.setdefault(offer[0], offer)
                    offers = list(first.values())
                taken = (slots.offer_all(offers) if batched
                         else [slots.offer(*offer) for offer in offers])
                slots.events.append(("taken", -1, repr(taken).encode()))
            elif op == "confirm":
                slots.confirm(arg)
            elif op == "live":  # a row leaves, or a new one takes a slot
                if arg in slots._live:
                    slots.confirm([arg])
                    slots.release_live(arg)
                elif slots.obtainable() > 0:
                    slots.take_live(arg)
            else:
                found = slots.find(arg)
                if found is not None:
                    slots.served(found)
        slots.check(list(slots._live))
    assert _state(pair[0]) == _state(pair[1])
