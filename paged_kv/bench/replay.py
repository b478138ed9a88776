"""Replay a trace through any block manager's bookkeeping (no K/V work).

The manager needs ``can_allocate(num_blocks)``, ``add_sequence(seq_id, prompt_token_ids)``
(returning the tokens found cached), ``prepare({seq_id: token_ids})`` and ``free(seq_id)``:
`PagedKVCache` and `SimpleBlockManager` both qualify. Admission depends on the trace alone
(a request enters when it has arrived, fewer than `max_running` run, and the blocks that
all running requests will hold at their full length fit in `capacity_blocks`), so every
manager replays the very same schedule; ``can_allocate`` is asked too, as an engine would.
Each step prefills the admitted prompts whole and decodes one token for every other
running request; a request is freed once it has generated its tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

from .trace import TraceRequest, output_token_id


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayResult:
    """Per-step bookkeeping seconds and running requests, and blocks moved in all."""

    step_times: tuple[float, ...]
    running: tuple[int, ...]
    num_block_ops: int

    @property
    def total_time(self) -> float:
        return sum(self.step_times)


def replay(trace: Sequence[TraceRequest], manager, *, capacity_blocks: int, block_size: int,
           max_running: int = 256, count_block_ops: Callable[[], int] = lambda: 0,
           on_step: Callable[[], None] | None = None) -> ReplayResult:
    """Replay `trace` through `manager`, timing only the manager's calls.

    Parameters
    ----------
    trace : sequence of TraceRequest
        In arrival order.
    manager : object
        See the module docstring.
    capacity_blocks : int
        Blocks the running requests may hold at their full length together.
    count_block_ops : callable
        Called after each step (timed): blocks allocated and freed since the last call.
    on_step : callable, optional
        Called after each step, untimed (e.g. to sample memory statistics).

    Examples
    --------
    >>> from paged_kv.bench.baselines import SimpleBlockManager
    >>> from paged_kv.bench.trace import TraceSpec, make_trace
    >>> trace = make_trace(TraceSpec(num_requests=8, mean_prompt_len=40, system_prompt_len=16))
    >>> result = replay(trace, SimpleBlockManager(256, 16), capacity_blocks=255, block_size=16)
    >>> len(result.step_times) == len(result.running) > 0
    True
    """
    state = _Replay(trace, manager, capacity_blocks, block_size, max_running)
    step, num_ops, step_times = 0, 0, []
    while state.pending or state.running:
        if not state.running and state.pending[0].arrival_step > step:
            step = state.pending[0].arrival_step  # nothing to do until the next arrival
        spent = state.step(step)
        start = time.perf_counter()
        num_ops += count_block_ops()
        step_times.append(spent + time.perf_counter() - start)
        if on_step is not None:
            on_step()
        step += 1
    return ReplayResult(tuple(step_times), tuple(state.running_counts), num_ops)


class _Replay:
    """The replay's state: requests not yet admitted, running ones, blocks committed."""

    def __init__(self, trace: Sequence[TraceRequest], manager, capacity_blocks: int,
                 block_size: int, max_running: int) -> None:
        self.pending = collections.deque(trace)
        self.running: dict[int, list] = {}  # request id -> [request, tokens generated so far]
        self.running_counts: list[int] = []
        self.manager, self.capacity, self.block_size = manager, capacity_blocks, block_size
        self.max_running = max_running
        self.committed = 0

    def blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def admit(self, step: int) -> tuple[list[tuple[TraceRequest, int]], float]:
        """Add the requests that may start now; returns them with their prefix hits."""
        spent, admitted, pending = 0.0, [], self.pending
        while pending and pending[0].arrival_step <= step and \
                len(self.running) + len(admitted) < self.max_running:
            request = pending[0]
            need = self.blocks(request.total_len)
            if self.committed + need > self.capacity or \
                    not self.manager.can_allocate(self.blocks(len(request.prompt_token_ids))):
                break
            start = time.perf_counter()
            hit = self.manager.add_sequence(request.request_id, request.prompt_token_ids)
            spent += time.perf_counter() - start
            pending.popleft()
            self.committed += need
            admitted.append((request, hit))
        if not self.running and not admitted:
            raise ValueError(f"request {pending[0].request_id} needs more than "
                             f"capacity_blocks={self.capacity} blocks")
        return admitted, spent

    def step(self, step: int) -> float:
        """Admit, prefill and decode, free the finished; returns seconds in the manager."""
        admitted, spent = self.admit(step)
        new_tokens = {rid: [output_token_id(rid, generated - 1)]
                      for rid, (_, generated) in self.running.items()}
        new_tokens.update((r.request_id, r.prompt_token_ids[hit:]) for r, hit in admitted)
        start = time.perf_counter()
        self.manager.prepare(new_tokens)
        spent += time.perf_counter() - start
        self.running.update((r.request_id, [r, 0]) for r, _ in admitted)
        self.running_counts.append(len(self.running))
        finished = []
        for rid, entry in self.running.items():
            entry[1] += 1
            if entry[1] == entry[0].output_len:
                finished.append(rid)
        start = time.perf_counter()
        for rid in finished:
            self.manager.free(rid)
        spent += time.perf_counter() - start
        for rid in finished:
            self.committed -= self.blocks(self.running.pop(rid)[0].total_len)
        return spent


def paged_block_ops(cache) -> Callable[[], int]:
    """Counter of blocks allocated, revived, cached or freed, from the allocator's events."""
    kinds = {"allocated", "hit", "cached", "freed"}

    def count() -> int:
        return sum(len(e.block_ids) for e in cache.take_events() if e.kind in kinds)

    return count


def simple_block_ops(manager) -> Callable[[], int]:
    """The same counter for `SimpleBlockManager` (it counts as it goes)."""
    seen = [0]

    def count() -> int:
        new, seen[0] = manager.num_block_ops - seen[0], manager.num_block_ops
        return new

    return count
