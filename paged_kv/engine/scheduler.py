"""The scheduler: a token budget per step mixing prefill chunks and decodes (vLLM v1's model).

Each sequence's computed tokens catch up with its tokens: a step gives every running
sequence ``min(len(tokens) - num_computed, budget left)`` new tokens, then swapped-in and
waiting ones get what is left (a sequence recomputed in a pool its window layers could
not hold in one step: in the largest steps the pool holds). When blocks run out, the most
recently admitted running sequence is preempted: freed and requeued (recompute), or moved
to the host pool (swap).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.batch import StepBatch
from ..core.cache import PagedKVCache
from ..core.step.plan import Admission, fits
from ..errors import OutOfBlocksError
from ..keys import block_keys, root_hash
from .fetches import TierFetches
from .inputs import StepInputs
from .limits import catch_up_tokens
from .misses import CacheReports
from .request import Request, Sequence, Status
from .steady import SteadyDecode


class Scheduler(TierFetches):
    """Decides each step's ``{sequence: number of new tokens}``; the only caller of the cache's
    add / free / swap for sequences."""

    def __init__(self, cache: PagedKVCache, *, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption: str, tiers: Any = None) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption = preemption
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.swapped: collections.deque[Sequence] = collections.deque()
        self.loading: list[Sequence] = []  # waiting for their prompts' blocks from the tiers
        self.tiers = tiers  # a tiers.TierManager, or None
        self.failed: list[Sequence] = []  # hand-offs the `fail` policy fails (the engine does)
        self.reports = CacheReports(cache.config.block_size, cache.allocator.ghost, tiers,
                                    cache.allocator.is_indexed if cache.config.num_state_slots
                                    else None)
        self.num_preemptions = 0
        self._reserved = 0  # blocks this step's scheduled sequences will take
        # the last batch of sequences resolved to rows and their ids: a decode step repeats
        # the same batch, whose ids tuple is then reused (no per-sequence rebuild, and the
        # cache's `rows_of` compares it by identity)
        self._last_batch: tuple[tuple[Sequence, ...], tuple[tuple[int, int], ...]] = ((), ())
        self._decode_rows = np.empty(0, dtype=np.int64)  # the last all-decode plan's rows
        self._decode_batch: tuple[Sequence, ...] = ()  # and its sequences
        self.steady = SteadyDecode()  # the steady decode step's arrays, and their carry
        # request id -> request of n > 1 added whose samples may not all be forked yet
        # (pruned by `_num_slots`): while it is empty, the running sequences are the slots
        self._forking: dict[int, Request] = {}

    @property
    def has_work(self) -> bool:
        """Whether any sequence is waiting, running or swapped out."""
        return bool(self.waiting or self.running or self.swapped or self.loading or self.failed)

    def schedule(self) -> dict[Sequence, int]:
        """This step's new tokens per sequence; may preempt, swap in, and admit."""
        step: dict[Sequence, int] = {}
        if self.loading:
            self.land_fetches()
        preempted, budget = self._schedule_running(step)
        if not preempted:
            budget = self._schedule_swapped(step, budget)
            self._schedule_waiting(step, budget)
        self.steady.planned(step)
        return step

    def _available(self, step_blocks: int) -> int:
        return self.cache.allocator.num_obtainable_blocks - step_blocks

    def _schedule_running(self, step: dict[Sequence, int]) -> tuple[bool, int]:
        """Running sequences in order, as far as the budget goes; preempt from the back
        until their blocks fit. One block count for the whole set per try."""
        preempted = False
        while True:
            running, left = self.running, self.max_num_batched_tokens
            batch = tuple(running)
            if self.steady.start(batch, left) or self._all_decode():  # no per-sequence plan
                plan, left = dict.fromkeys(running, 1), left - len(running)
                self._decode_batch = batch  # (a carry has their rows)
                self._decode_rows = self.steady.rows if self.steady.carried else self._rows_of(
                    batch)
                needs = self.cache.num_blocks_needed(self._decode_rows)
                self.steady.plan = plan
            else:
                plan = []
                for seq in running:
                    if left <= 0:
                        break
                    plan.append((seq, min(self._step_tokens(seq), left)))
                    left -= plan[-1][1]
                needs = self._blocks_needed(plan)
            if needs <= self._available(0):
                break
            self._preempt(self.running[-1])
            preempted = True
        step.update(plan)
        self._reserved = needs
        return preempted, left

    def _all_decode(self) -> bool:
        """Whether every running sequence takes one token this step, all within the
        budget (each has exactly one token not computed): the plan is then 1 for each."""
        running = self.running
        if not running or len(running) > self.max_num_batched_tokens:
            return False
        return [len(seq.token_ids) - seq.num_computed for seq in running].count(1) == len(
            running)

    def _rows_of(self, seqs: tuple[Sequence, ...]) -> np.ndarray:
        """The cache's row handles of `seqs` (resident), their ids tuple reused while the
        batch is the last one (compared by identity, at C speed)."""
        if seqs != self._last_batch[0]:
            self._last_batch = (seqs, tuple(seq.seq_id for seq in seqs))
        return self.cache.rows_of(self._last_batch[1])

    def _blocks_needed(self, plan: list[tuple[Sequence, int]]) -> int:
        """Blocks `plan` takes. A decode step (one token each, the steady state) is counted
        on the rows the array step will use, with no mapping parsed; one that must copy a
        shared last block, and any other step, by `num_blocks_needed`."""
        if not plan:
            return 0
        if all(n == 1 for _, n in plan):
            return self.cache.num_blocks_needed(self._rows_of(tuple(seq for seq, _ in plan)))
        return self.cache.num_blocks_needed({seq.seq_id: n for seq, n in plan})

    def _schedule_swapped(self, step: dict[Sequence, int], budget: int) -> int:
        """Swapped sequences back in, oldest first, while blocks and `budget` last; returns
        the budget left."""
        while self.swapped and budget > 0 and self._num_slots() < self.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(self._step_tokens(seq), budget)
            # its blocks come back fresh (unshared), then grow by this step's tokens. The
            # swap-in takes them now, before the step's window give-backs (which make a
            # negative reservation) return any block: those cannot be counted on here
            need = self.cache.config.blocks_for_sequence(seq.num_computed + num_new, num_new)
            if need > self._available(max(self._reserved, 0)):
                break
            self.cache.swap_in(seq.seq_id)
            self.swapped.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._reserved += self.cache.num_blocks_needed({seq.seq_id: num_new})
            step[seq] = num_new
            budget -= num_new
        return budget

    def _step_tokens(self, seq: Sequence) -> int:
        """The tokens `seq` may take in its next step, before the budget: all it has not
        computed, except where a window layer would then hold more blocks than the request
        was accepted for. A window group holds its window plus a step's tokens, and the
        request limit (`limits.request_blocks`) counted the prompt's steps and decode steps
        only; a sequence recomputed after a preemption has more tokens than its prompt, and
        in one step could need more blocks than the whole pool (it then waited forever),
        even in a step of its prompt's length near its end. Such a sequence catches up in
        steps that fit (`limits.catch_up_tokens`) instead."""
        left = len(seq.token_ids) - seq.num_computed
        if left == 1 or len(seq.token_ids) <= len(seq.request.prompt_token_ids):
            return left  # decodes and the prompt's steps: what the limit counted
        return catch_up_tokens(self.cache.config, len(seq.token_ids), left)

    def _num_slots(self) -> int:
        """Running sequences plus the samples still to be forked off them: their count
        alone while no request added has samples left to fork (no pass over them; a
        request leaves the record once forked or retired)."""
        if self._forking:
            self._forking = {key: request for key, request in self._forking.items()
                             if request.params.n > len(request.samples)
                             and request.samples[0].finish_reason is None}
        if not self._forking:
            return len(self.running)
        return len(self.running) + sum(
            seq.request.params.n - len(seq.request.samples) for seq in self.running
            if seq.index == 0 and seq.request.params.n > len(seq.request.samples))

    def _schedule_waiting(self, step: dict[Sequence, int], budget: int) -> None:
        """Admit waiting sequences, oldest first, while slots, blocks and `budget` last: each
        planned once (its prompt's keys come with it, hashed at most once), tested with the
        cache's one capacity rule against what this step has reserved, then added."""
        used = -1  # `_num_slots`, counted once (a pass over the running sequences) and
        #            then kept: each admission takes the slots it was tested for
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            # a request's samples are forked together once its prompt is computed
            slots = seq.request.params.n if not seq.request.samples[1:] else 1
            used = self._num_slots() if used < 0 else used
            if used + slots > self.max_num_seqs:
                return
            reuse = seq.request.params.prompt_logprobs is None  # else compute every position
            admission = self._plan_admission(seq, min(self._step_tokens(seq), budget), reuse)
            if reuse and self.tiers is not None and not seq.tiered \
                    and self.start_fetch(seq, admission):
                self.waiting.popleft()  # loading while the others step
                continue
            # the cache's one capacity number for this tenant (its own reservation counts)
            obtainable = self.cache.allocator.obtainable(admission.root)
            if not fits(admission, obtainable - self._reserved):
                return
            # the plan is committed as tested (planned again only if the cache changed);
            # a prompt not looked up is added bare, its blocks indexed as they fill
            hit = (self.cache.commit_admission(admission) if reuse else self.cache.add_sequence(
                seq.seq_id, None, salt=seq.request.salt, keys=admission.keys))
            self.waiting.popleft()
            if seq.request.prefix_hit_tokens is None:
                seq.request.prefix_hit_tokens = hit
                self.reports.admitted(seq, admission, hit)
            seq.num_computed, seq.status = hit, Status.RUNNING
            self.running.append(seq)
            used += slots  # itself, and the samples to fork off it (`_num_slots`)
            step[seq] = admission.count
            self._reserved += admission.requested
            budget -= admission.count

    def _plan_admission(self, seq: Sequence, budget: int, reuse: bool) -> Admission:
        """What admitting `seq` with at most `budget` tokens would take now. Its block keys
        are computed once and kept on it (only blocks it gained since, by decoding before a
        preemption, are hashed): the device lookup, the tiers and the commit all use them."""
        admission = self.cache.plan_admission(seq.seq_id, seq.token_ids, salt=seq.request.salt,
                                              keys=seq.block_keys, max_tokens=budget,
                                              lookup=reuse)
        if len(admission.keys) > len(seq.block_keys):
            seq.block_keys = admission.keys
        return admission

    def _leave(self, seq: Sequence) -> bool:
        """Take `seq` off the running list, telling the carry where it stood; False when
        it was not running."""
        try:
            index = self.running.index(seq)
        except ValueError:
            return False
        del self.running[index]
        self.steady.left(index)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Make room: swap `seq` to the host pool, or free it to be recomputed later."""
        self._leave(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.preemption == "swap":
            try:
                self.cache.swap_out(seq.seq_id)
            except OutOfBlocksError:
                pass  # the host pool is full: recompute this one instead
            else:
                seq.status = Status.SWAPPED
                self.swapped.append(seq)
                return
        self.cache.free(seq.seq_id)
        seq.num_computed, seq.status, seq.tiered = 0, Status.WAITING, False
        self.waiting.appendleft(seq)

    def add(self, seq: Sequence) -> None:
        """Queue a new request's first sample, with its prompt's block keys (made here, once
        per request, when prefix caching is on: every later reader takes them from it)."""
        request = seq.request
        if self.cache.config.enable_prefix_caching and not request.block_keys:
            request.block_keys = block_keys(np.asarray(request.prompt_token_ids, np.int64),
                                            self.cache.config.block_size,
                                            root_hash(request.salt))
        seq.block_keys = request.block_keys
        request.samples.append(seq)
        if request.params.n > len(request.samples):  # its other samples fork off it later
            self._forking[request.request_id] = request
        self.waiting.append(seq)

    def prepare(self, plan: dict[Sequence, int]) -> StepBatch:
        """The cache's batch for `plan`: one token per sequence (the steady decode state)
        through the array API, its rows resolved once per running set (`rows_of` returns
        the same handle while the set is unchanged); a mixed step (the running sequences'
        decode, then new prompts' chunks) through `prepare_decode` with counts, its
        decoding rows as a decode step's (their handles from its planning: a row stays
        where it is while others join, even when each joining one takes one token too: a
        sequence swapped back in, a prompt cached but for its last token); any other step
        through `prepare`."""
        decoding = self.steady.decoding(plan)
        if plan is self.steady.plan or (not decoding and list(plan.values()).count(1)
                                        == len(plan)):  # all 1
            seqs = self._decode_batch if plan is self.steady.plan else tuple(plan)
            rows = self._decode_rows if plan is self.steady.plan else self._rows_of(seqs)
            tokens, positions = self.steady.arrays(plan)
            batch = self.cache.prepare_decode(rows, tokens)
            self.steady.prepared(plan, seqs, rows, tokens, positions)
            return batch
        if decoding:  # the running sequences decoding, then new prompts: their rows as arrays
            return self.steady.prepare_mixed(self.cache, plan, decoding, self._decode_rows)
        new_tokens: dict = {}  # the model's inputs and the cache's mapping in one pass
        self.steady.prepared_general(plan, StepInputs.of(plan, new_tokens))
        return self.cache.prepare(new_tokens)

    def step_inputs(self, plan: dict[Sequence, int]) -> StepInputs:
        """The model's inputs for `plan` (prepared last): a steady decode step's from the
        token and position arrays `prepare` used (`SteadyDecode.inputs`)."""
        return self.steady.inputs(plan)

    def advance(self, plan: dict[Sequence, int],
                prompt_logprobs: list[tuple[Request, dict[int, float]]] = ()) -> None:
        """The model wrote the K/V of `plan`'s tokens: they are computed now; record the
        prompt positions' log-probabilities it gave (in prompt order, per request)."""
        for seq, n in plan.items():
            seq.num_computed += n
        for request, logprobs in prompt_logprobs:
            request.prompt_logprobs.append(logprobs)

    def update_from_output(self, samples: list[tuple[Sequence, int, dict[int, float] | None]],
                           eos_token_ids: frozenset[int]) -> list[Request]:
        """Append each sample's new token (and its log-probabilities), then finish the
        samples it stopped: a stop token, the model's EOS (unless ``ignore_eos``), or
        ``max_tokens``; finished samples' blocks are freed. Returns the requests whose
        last sample this finished."""
        now, finished = time.perf_counter(), []
        self.steady.carry_over(samples)
        # a carried step's appends run in C, and only the samples that may stop come back
        stepped = self.steady.append(samples, now, eos_token_ids)
        for seq, token, logprobs in samples if stepped is None else stepped:
            tokens, request = seq.token_ids, seq.request  # read once: this runs every token
            if stepped is None:
                tokens.append(token)
                seq.token_times.append(now)
                if request.first_token_time is None:
                    request.first_token_time = now
                if logprobs is not None:
                    seq.logprobs.append(logprobs)
                    seq.cumulative_logprob += logprobs[token]
            params = request.params
            if token in params.stop_token_ids or (token in eos_token_ids
                                                  and not params.ignore_eos):
                self.finish(seq, "stop")
            # the output's length (prompt + max_tokens: `Sequence.max_len`), not sliced out
            elif len(tokens) >= seq.max_len:
                self.finish(seq, "length")
            else:
                continue
            if request.is_finished:
                request.finish_time = now
                finished.append(request)
        return finished

    def add_children(self, parent: Sequence, children: list[Sequence]) -> None:
        """Fork a request's other samples off its first, right behind it."""
        position = self.running.index(parent) + 1
        parent.request.samples += children
        for child in children:
            self.cache.fork(parent.seq_id, child.seq_id)
            child.num_computed, child.status = parent.num_computed, Status.RUNNING
        self.running[position:position] = children

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire `seq` with `reason` and free its blocks."""
        if not self._leave(seq):
            raise ValueError(f"finish(): sequence {seq.seq_id} is not running")
        self.cache.free(seq.seq_id, **seq.request.retain)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def abort_request(self, request: Request, error: str | None = None,
                      on_abort: Callable[[Sequence], None] = lambda seq: None) -> None:
        """Retire `request`'s unfinished samples: "abort" (the client's), or "error" with
        `error` as the request's message (the engine failed it); `on_abort` sees each one
        as it is retired (the last sees the request finished)."""
        request.error = error
        for seq in [seq for seq in request.samples if seq.finish_reason is None]:
            self.abort(seq, "abort" if error is None else "error")
            on_abort(seq)
        request.finish_time = time.perf_counter()

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Retire `seq` wherever it is (waiting, running, swapped) and free its blocks;
        `reason` is "abort" (the client's) or "error" (the engine's)."""
        self._leave(seq)
        for queue in (self.waiting, self.swapped, self.loading, self.failed):
            if seq in queue:
                queue.remove(seq)
        if seq.fetch is not None:
            seq.fetch.cancelled, seq.fetch = True, None
        if seq.seq_id in self.cache:
            self.cache.free(seq.seq_id)
        seq.status, seq.finish_reason = Status.FINISHED, reason
