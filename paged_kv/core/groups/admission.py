"""A hybrid layout's admission: one prefix hit every layer group accepts, then one row per
group.

The leading group plans the admission as a uniform cache would (its keys, hashed once, and
its cached prefix); every other group is then asked, under the same keys (`group_key`),
for the longest hit it accepts (`LayerGroup.accepted_hit`: all blocks for full attention, only the
blocks the window or chunk still reads for the others), and the hit shrinks until all
agree (vLLM's hybrid coordinator: one pass per shrink, and a full group is downward
closed). A window group's row then starts with the null block where its window has left.
A recurrent state group accepts a hit only where it holds a state checkpoint (or at 0),
so a hit is never served without its state. Each group answers through its own methods
(`LayerGroup.lookup`, `accepted_hit`, `hits_at`, `add_row`, ...).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...keys import TOKEN_BYTES
from ..allocator import BlockAllocator
from ..step.plan import Admission
from .groups import LayerGroup, filled_blocks
from .rules import group_key


class HybridAdmission(NamedTuple):
    """An admission over every group (read like an `Admission`: `fits` tests it).

    Attributes
    ----------
    leader : Admission
        The leading group's plan, cut to the agreed hit.
    group_hits : tuple of list of int
        For each other group, its part of the hit (`LayerGroup.hits_at`): an attention
        group's block at every column (0 = given back); the state group's checkpoint slot
        at the hit's end (none for a hit of 0).
    requested, revived : int
        Over all groups.
    shared : int
        Blocks the leading group alone would hit (attention blocks cached), where another
        group's rule cut the hit shorter: a state group checkpoints that junction as the
        prompt is computed (two prompts met there).
    """

    leader: Admission
    group_hits: tuple[list[int], ...]
    requested: int
    revived: int
    groups: tuple[LayerGroup, ...] = ()  # every group, the leading one first
    generation: int = -1  # as `Admission.generation`
    shared: int = 0

    @property
    def seq_id(self):
        return self.leader.seq_id

    @property
    def tokens(self) -> np.ndarray | None:
        return self.leader.tokens

    @property
    def keys(self) -> list[bytes]:
        return self.leader.keys

    @property
    def root(self) -> bytes | None:
        return self.leader.root

    @property
    def num_hit(self) -> int:
        return self.leader.num_hit

    @property
    def count(self) -> int:
        return self.leader.count

    def missing(self, block_size: int) -> tuple[bytes, list[bytes], np.ndarray]:
        """What a lower tier is asked for: the leading group's `Admission.missing`, then
        each other group's blocks (under its `group_key`s) that a hit at the prompt's end
        needs — a window group's last window only — and a state group's checkpoint there
        (its chunk keys, `StateGroup.tier_keys`; they have no tokens). One run, so one
        fetch; a run that stops early lands the leading group's blocks first."""
        parent, keys, tokens = self.leader.missing(block_size)
        lead = self.leader
        if lead.tokens is None or not keys:
            return parent, keys, tokens
        end, start = len(lead.hits) + len(keys), len(lead.hits)
        keys, parts = list(keys), [tokens]
        for group in self.groups[1:]:
            if not group.holds_blocks:  # a state group: its checkpoint at the run's end
                keys += group.tier_keys(lead.keys[end - 1])
                continue
            first = max(start, group.skipped_blocks(end * block_size))
            keys += [group_key(key, group.index) for key in lead.keys[first:end]]
            parts.append(lead.tokens[first * block_size:end * block_size])
        return parent, keys, np.concatenate(parts)


def row_only(plan: Admission | HybridAdmission) -> Admission | HybridAdmission:
    """`plan` preparing no token: its row and hits alone, which take no block (what
    `PagedKVCache.commit_admission` adds; a hybrid plan's count is its leader's)."""
    if isinstance(plan, HybridAdmission):
        return plan._replace(leader=row_only(plan.leader), requested=0, revived=0)
    return plan._replace(count=0, requested=0, revived=0)


def plan_groups(groups: list[LayerGroup], allocator: BlockAllocator, plan: Admission,
                block_size: int, max_tokens: int | None) -> HybridAdmission:
    """The admission of `plan` (the leading group's) over every group; changes nothing."""
    width = block_size * TOKEN_BYTES
    found: list[dict[int, int | None]] = [{} for _ in groups]

    def found_in(group: LayerGroup):
        memo = found[group.index]

        def find(column: int) -> int | None:
            if column not in memo:
                memo[column] = group.lookup(allocator, plan.keys[column],
                                            plan.data[column * width:(column + 1) * width])
            return memo[column]
        return find

    def cached_in(group: LayerGroup):
        find = found_in(group)
        return lambda column: find(column) is not None

    # a full leading group's lookup is its leading run; a window one (every layer a window)
    # is asked like the others, right to left from the prompt's last full block
    window_led = groups[0].gives_back
    end = (min(len(plan.keys), (len(plan.tokens) - 1) // block_size)
           if window_led and plan.tokens is not None else len(plan.hits))
    askers = groups if window_led else groups[1:]
    while True:
        agreed = end
        for group in askers:
            agreed = group.accepted_hit(agreed, cached_in(group))
        if agreed == end:
            break
        end = agreed

    leader = plan
    if window_led:
        leader = _cut(plan, groups[0].hits_at(end, found_in(groups[0])), block_size,
                      max_tokens, allocator)
    elif end < len(plan.hits):
        leader = _cut(plan, plan.hits[:end], block_size, max_tokens, allocator)
    group_hits = tuple(group.hits_at(end, found_in(group)) for group in groups[1:])
    revived = leader.revived + (sum(group.revived(allocator, hits) for group, hits
                                    in zip(groups[1:], group_hits, strict=True))
                                if leader.count else 0)
    # at most the leader's blocks in every group that holds blocks (a state group holds none)
    holders = sum(group.holds_blocks for group in groups)
    return HybridAdmission(leader, group_hits, leader.requested * holders, revived,
                           tuple(groups), shared=0 if window_led else len(plan.hits))


def _cut(plan: Admission, hits: list[int], block_size: int, max_tokens: int | None,
         allocator: BlockAllocator) -> Admission:
    """`plan` with these hits instead (the agreed hit: another group lacks the rest, or a
    window leader's own, 0 where its window has left)."""
    num_hit = len(hits) * block_size
    count = 0 if plan.tokens is None else len(plan.tokens) - num_hit
    count = count if max_tokens is None else min(count, max_tokens)
    requested = -(-(num_hit + count) // block_size) - len(hits)
    revived = allocator.count_cached([block for block in hits if block]) if hits and count else 0
    # the pieces were cut after the longer hit: the commit cuts its own
    return plan._replace(hits=hits, num_hit=num_hit, count=count, requested=requested,
                         revived=revived, pieces=[])


def commit_groups(groups: list[LayerGroup], allocator: BlockAllocator, plan: HybridAdmission,
                  prepare: bool, device) -> tuple:
    """Commit a checked `HybridAdmission`: every group's row, and with `prepare` the
    batches of its next tokens (one per group). The hits of every group are shared first,
    so no group's allocation can evict a block another group is about to take."""
    leader_plan = plan.leader
    for group, hits in zip(groups[1:], plan.group_hits, strict=True):
        group.share_hits(allocator, hits)
    leader = groups[0]
    first = leader.committer.admit(leader_plan) if prepare else None
    if not prepare:
        leader.committer.add_row(leader_plan)
    row = leader.tables.row_of[leader_plan.seq_id]
    leader.released_of(np.array([row]))
    leader.released[row] = leader_plan.hits.count(0)  # a window leader's given-back columns
    filled = []
    if prepare and leader.planner.indexing and len(groups) > 1:
        # its prompt's blocks that filled, under the leader's keys
        filled = filled_blocks(allocator, leader.tables, np.array([row]),
                               np.array([leader_plan.num_hit]), [leader_plan.chain])
    batches = (first, *(group.add_row(allocator, leader_plan, hits, row, prepare, filled,
                                      device, plan.shared)
                        for group, hits in zip(groups[1:], plan.group_hits, strict=True)))
    for group in groups[1:]:
        group.mirror(allocator, filled)
    return batches if prepare else ()
