"""The scheduler's prompts loading from the tiers: a fetch started at admission, landed (or
given up) at the start of a later step.

`Scheduler` inherits them (as the cache inherits its admissions from
`paged_kv.core.admission.Admissions`): a prompt whose full blocks the device lacks but a
lower tier (host, disk, a store, or a hand-off's prefill engine) may hold waits in
``loading`` while its blocks are copied in, instead of being prefilled at once; the other
sequences step meanwhile.
"""

from __future__ import annotations

import collections
from typing import Any

from ..core.cache import PagedKVCache
from ..core.step.plan import Admission
from .request import Sequence, Status


class TierFetches:
    """`start_fetch` and `land_fetches` over a `Scheduler`'s queues (the attributes below
    are the scheduler's)."""

    cache: PagedKVCache
    tiers: Any  # a tiers.TierManager, or None
    waiting: collections.deque[Sequence]
    running: list[Sequence]
    loading: list[Sequence]  # waiting for their prompts' blocks from the tiers
    failed: list[Sequence]  # hand-offs the `fail` policy fails (the engine does)

    def start_fetch(self, seq: Sequence, admission: Admission) -> bool:
        """Ask the tiers for the prompt's full blocks the device lacks (under the keys the
        admission carries); True when a fetch started (`seq` is loading). A hand-off's
        request (``request.peer``, unsettled) asks its prefill engine instead, through the
        same fetch path; with nothing to ask, its hand-off is settled at once."""
        seq.tiered = True
        parent, keys, tokens = admission.missing(self.cache.config.block_size)
        peer = seq.request.peer
        if peer is None or peer.settled:
            seq.fetch = self.tiers.start_fetch(keys, tokens, parent)
        elif keys:  # a hand-off: from the prefill engine, until its lease ends
            seq.fetch = self.tiers.start_peer_fetch(keys, tokens, parent, peer, peer.deadline)
        else:  # every block it could load is on the device already
            peer.role.settle(seq.request, None, 0)
            seq.fetch = None
        if seq.fetch is None:
            return False
        seq.status = Status.LOADING
        self.loading.append(seq)
        return True

    def land_fetches(self) -> None:
        """Finished fetches load their blocks as cached device blocks (sparing a block per
        running sequence); expired ones are given up. Either way the sequence waits at the
        front again, where admission finds the loaded prefix like any cached one."""
        still, back = [], []
        for seq in self.loading:
            loaded = 0
            if seq.fetch.done:
                spare = self.cache.allocator.num_obtainable_blocks - len(self.running)
                loaded = self.tiers.land(seq.fetch, spare)
            elif seq.fetch.expired:
                self.tiers.fell_back(seq.fetch)
            else:
                still.append(seq)
                continue
            seq.request.fetch_report = (dict(getattr(seq.fetch, "loaded", None) or {}),
                                        getattr(seq.fetch, "failure", None))
            peer = getattr(seq.fetch, "peer", None)  # a hand-off's: its role settles it
            settled = peer is None or peer.role.settle(seq.request, seq.fetch, loaded)
            seq.fetch, seq.status = None, Status.WAITING
            (back if settled else self.failed).append(seq)
        self.loading = still
        self.waiting.extendleft(reversed(back))
