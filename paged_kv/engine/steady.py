"""`SteadyDecode`: the scheduler's steady decode step, made from arrays.

A step is *steady* when every running sequence is one token behind (its last token not
computed) and nothing joins it: each takes that one token and is sampled after it. Its
inputs are then two ``[B]`` arrays, the tokens and their positions, which the cache's
`prepare_decode` and the model both take. They are built once a step from the sequences
or, when the step before was steady too and every one of its sequences got its one sample
in order, carried over from it: the sampled tokens at the next positions, with no pass
over the sequences at all.

The carry outlives a change of the running set. Sequences that leave (finished, aborted,
preempted: the scheduler tells `left` where each one stood) are dropped from it, and a
mixed step's new prompts sampled in it join it, so a loaded server's steps (a few requests
leaving and arriving every step) keep it too: vLLM's persistent input batch, which
condenses its rows as requests leave, in the running order.

A *mixed* step (the running sequences decoding, then new prompts' chunks behind them: a
loaded server's usual step, as requests finish and arrive every step) takes its decoding
part the same way: its tokens and positions as arrays, the cache's step as arrays
(`PagedKVCache.prepare_decode` with counts), and only the new prompts through
`StepInputs.of`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection, Iterable
from collections.abc import Sequence as Ints  # (`Sequence` is the engine's)
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._checks import read_only
from ..core.batch import StepBatch
from .inputs import StepInputs
from .request import Sequence

if TYPE_CHECKING:
    from ..core.cache import PagedKVCache

Plan = dict[Sequence, int]
Sample = tuple[Sequence, int, dict[int, float] | None]
# the next step's carry: (its sequences, [B] int32 tokens, [B] int64 positions, [B] int64
# read-only rows)
Carry = tuple[tuple[Sequence, ...], np.ndarray, np.ndarray, np.ndarray]

_MAX_LEFT = 64  # departures a carry is aligned past; more, and it is dropped (rare)
_NO_ROWS = read_only(np.empty(0, np.int64))


class _Appends(NamedTuple):
    """A carried batch's per-sequence lists and limits, made once per batch
    (`SteadyDecode.append`)."""

    seqs: tuple[Sequence, ...]
    tokens: list[list[int]]  # each sequence's `token_ids` (appended in place)
    times: list[list[float]]  # each sequence's `token_times`
    max_len: np.ndarray  # [B] int64 `Sequence.max_len`
    eos: np.ndarray  # [B] bool: its request stops at the model's EOS (not ``ignore_eos``)
    stops: np.ndarray  # [B] bool: its request has stop tokens
    plain: bool  # no request asks for log-probabilities
    # (listeners, request ids, sample indexes) when every request has a listener and one
    # sample (a sample then finishes only with its request): `SteadyDecode.outputs`
    listeners: tuple[list, list[int], list[int]] | None


class SteadyDecode:
    """The scheduler's record of its steady decode steps and of its mixed steps' decoding
    part (`Scheduler` is its one writer: `start` and `planned` in its planning, `arrays`
    and `prepared`, `decoding` and `prepare_mixed`, or `prepared_general` in `prepare`,
    `inputs` for the model, `carry_over` and `append` in `update_from_output`; the engine
    reads `outputs` to stream the step).

    The carry is valid while the running sequences are the carried ones in the same order:
    the scheduler is the one writer of their tokens and computed counts, and only
    `advance` and `update_from_output` change those without changing the running list (an
    admission, a fork, a finish, an abort or a preemption all do). `start` compares the
    running sequences with the carried ones by identity, in C. Where they differ by
    sequences that left (`left`), the carry drops those first (`_align`) and is compared
    again: a carry is used only for exactly the running sequences.
    """

    def __init__(self) -> None:
        self.plan: Plan | None = None  # the last plan the scheduler made steady
        # the last mixed plan, and how many of its first sequences decode (`planned`)
        self._mixed: tuple[Plan | None, int] = (None, 0)
        self.carried = False  # that plan's arrays are the carry
        self.rows: np.ndarray = _NO_ROWS  # the carry's rows, when `carried`
        # (the carried batch, the indexes of those that left it) when `start` last dropped
        # them from the carry: for the sampler's setup (`draw.DrawSetup.of`)
        self.dropped: tuple[tuple[Sequence, ...], list[int]] | None = None
        # the last steady or mixed plan once prepared: (plan, its sequences in order, their
        # rows, [D] int32 tokens and [D] int64 positions of its D decoding sequences)
        self._prepared: tuple[Plan | None, tuple[Sequence, ...], np.ndarray, np.ndarray,
                              np.ndarray] = (None, (), _NO_ROWS, np.empty(0, np.int32),
                                             np.empty(0, np.int64))
        # any other plan once prepared, and its model inputs (made in the same pass as
        # the cache's mapping: `Scheduler.prepare`)
        self._general: tuple[Plan | None, StepInputs | None] = (None, None)
        self._carry: Carry | None = None  # the next step's
        # where each sequence that left the running list since the carry was made stood
        # (its index then), in order (`left`)
        self._left: list[int] = []
        self._appends: _Appends | None = None  # the last carried batch's lists
        self._sampled: Ints[int] = ()  # the tokens `carry_over` carried, as ints
        self._appended: Ints[int] | None = None  # the same, once `append` ran
        self._checked: list[int] = []  # the indexes of the samples `append` handed back

    def start(self, batch: tuple[Sequence, ...], budget: int) -> bool:
        """A new plan of the running sequences `batch` (in order) within `budget` tokens:
        whether it is steady by the carry (else the scheduler checks the sequences); when
        it is, `rows` are their row handles."""
        self.plan, self.dropped, carry = None, None, self._carry
        if carry is not None and batch != carry[0]:  # identities compared, in C
            carry = self._align(batch)
        self.carried = carry is not None and 0 < len(batch) <= budget
        self.rows = carry[3] if self.carried else _NO_ROWS
        return self.carried

    def left(self, index: int) -> None:
        """The running sequence at `index` (of the running list as it is) left it: finished,
        aborted or preempted. Noted while a carry waits for the next step."""
        if self._carry is not None:
            self._left.append(index)

    def _align(self, batch: tuple[Sequence, ...]) -> Carry | None:
        """The carry less the sequences that left since it was made (`left`), kept when
        that is `batch`; else the carry is dropped (None)."""
        seqs, tokens, positions, rows = self._carry
        left, self._left, self._carry = self._left, [], None
        if not left or len(left) > _MAX_LEFT or len(seqs) - len(left) != len(batch):
            return None
        gone: list[int] = []  # the carry's indexes of those that left, ascending
        for index in left:  # (an index of the list as it was then: less those before it)
            for earlier in gone:
                if earlier > index:
                    break
                index += 1
            bisect.insort(gone, index)
        aligned = tuple(without(seqs, gone))
        if aligned != batch:  # (identities: the running list changed otherwise too)
            return None
        keep = np.ones(len(seqs), dtype=bool)
        keep[gone] = False
        kept = np.flatnonzero(keep)
        self._carry = (aligned, tokens[kept], positions[kept], read_only(rows[kept]))
        self.dropped = (seqs, gone)
        appends = self._appends
        if appends is not None and appends.seqs is seqs and appends.plain \
                and appends.listeners is not None:
            self._appends = _kept_appends(appends, aligned, gone, kept)
        else:  # made again when wanted: the one not plain may be among those that left
            self._appends = None
        return self._carry

    def planned(self, step: Plan) -> None:
        """The scheduler's whole plan `step`, whose first sequences are the running ones'
        all-decode plan (`plan`, when it made one): steady when nothing joined it; else a
        mixed plan, whose first ``len(plan)`` sequences decode (`decoding`)."""
        decode, self.plan, self._mixed = self.plan, None, (None, 0)
        if decode is not None and len(step) == len(decode):
            self.plan = step
        elif decode is not None:
            self._mixed = (step, len(decode))

    def decoding(self, plan: Plan) -> int:
        """How many of `plan`'s first sequences decode, when it is the last mixed plan
        (else 0): each has one token left, its last, and is sampled after it."""
        mixed, count = self._mixed
        return count if plan is mixed else 0

    def prepare_mixed(self, cache: PagedKVCache, plan: Plan, decoding: int,
                      rows: np.ndarray) -> StepBatch:
        """The cache's batch for a mixed `plan` through `PagedKVCache.prepare_decode`: its
        first `decoding` sequences (``rows``: their row handles) each take their last token
        at their computed count, from the carry when it is theirs, else in two passes in C;
        the other sequences' chunks follow (`StepInputs.of` of them alone). The model's
        inputs are kept for `inputs`: the decoding part made as a decode step's."""
        seqs = list(itertools.islice(plan, decoding))
        if self.carried:  # the running sequences are the carried ones
            _, tokens, positions, _ = self._carry
        else:
            tokens, positions = _next_tokens(seqs), _computed(seqs)
        tail = dict(itertools.islice(plan.items(), decoding, None))
        rest = StepInputs.of(tail)
        counts = np.ones(len(plan), dtype=np.int64)
        counts[decoding:] = list(tail.values())
        all_rows = read_only(np.concatenate((rows, cache.rows_of([seq.seq_id for seq in tail]))))
        batch = cache.prepare_decode(
            all_rows, np.concatenate((tokens, rest.tokens.numpy().astype(np.int32))), counts)
        self._general = (plan, StepInputs.joined(seqs, tokens, positions, rest))
        self._prepared = (plan, tuple(plan), all_rows, tokens, positions)
        return batch

    def arrays(self, plan: Plan) -> tuple[np.ndarray, np.ndarray | None]:
        """``[B]`` int32 tokens of a plan of one token per sequence (each one's first not
        computed), and ``[B]`` int64 positions when carried (else None: `prepared` makes
        them if the plan is steady)."""
        if plan is self.plan and self.carried:  # the last step's samples
            _, tokens, positions, _ = self._carry
            return tokens, positions
        return _next_tokens(plan), None

    def prepared(self, plan: Plan, batch: tuple[Sequence, ...], rows: np.ndarray,
                 tokens: np.ndarray, positions: np.ndarray | None) -> None:
        """`plan` (its sequences `batch`, in order, at `rows`) was prepared with `tokens`
        (`arrays`): kept for `inputs` and the carry when steady."""
        if plan is self.plan:
            if positions is None:
                positions = _computed(plan)
            self._prepared = (plan, batch, rows, tokens, positions)

    def prepared_general(self, plan: Plan, inputs: StepInputs) -> None:
        """`plan`, not a decode step, is being prepared; `inputs` are its model inputs,
        made from the sequences as they are now (their tokens and computed counts change
        only after the model ran: `advance`, `update_from_output`)."""
        self._general = (plan, inputs)

    def inputs(self, plan: Plan) -> StepInputs:
        """The model's inputs for `plan` (prepared last): a steady step's from its arrays
        (every sequence sampled, no per-sequence slicing), another step's as its
        preparation made them, any other plan's through `StepInputs.of`."""
        prepared, _, _, tokens, positions = self._prepared
        if plan is prepared and plan is self.plan:
            return StepInputs.decode(list(plan), tokens, positions)
        general, inputs = self._general
        self._general = (None, None)  # used once: the next plan is another
        return inputs if plan is general else StepInputs.of(plan)

    def carry_over(self, samples: list[Sample]) -> None:
        """Carry this step's arrays to the next when its plan was steady or mixed and
        prepared as such, and `samples` are its sequences' one sample each, in order (a
        mixed step's new prompts all took their last prompt token: each is sampled, and
        its next position is its computed count, read after `advance`); else drop the
        carry."""
        plan, batch, rows, _, positions = self._prepared
        self._carry, self._left = None, []
        if (not samples or plan is None or len(samples) != len(batch)
                or (plan is not self.plan and plan is not self._mixed[0])):
            return
        drawn = getattr(samples, "tokens", None)  # `draw.Samples`: kept as drawn
        if drawn is not None and len(drawn) == len(samples):
            seqs, tokens = tuple(samples.seqs), drawn
        else:
            seqs, tokens, _ = zip(*samples, strict=True)
        if seqs != batch:
            return
        positions = positions + 1
        if len(positions) < len(batch):  # a mixed step's prompts (a few)
            positions = np.concatenate((positions, _computed(batch[len(positions):])))
        as_drawn = getattr(tokens, "array", None)  # `sampling.Drawn`: the array as drawn
        self._carry = (seqs, np.array(tokens, dtype=np.int32) if as_drawn is None
                       else as_drawn.astype(np.int32), positions, rows)
        self._sampled = tokens

    def append(self, samples: list[Sample], now: float, eos_token_ids: frozenset[int],
               ) -> Iterable[Sample] | None:
        """`Scheduler.update_from_output`'s appends for a carried step (after
        `carry_over`): each sample's token and `now` appended to its sequence, in C, and the
        samples that may stop returned, in order (a stop token's or EOS's request, or at its
        length), for the scheduler's own checks. None, appending nothing, for any other step
        (the scheduler appends): one not carried, whose samples are not the carried batch's,
        or one asking for log-probabilities.

        A carried step's decoding sequences were all sampled in the step before, so each
        request's first token time is set already; a mixed step's new prompts (after them)
        are sampled for the first time: theirs is set here."""
        carry, self._appended = self._carry, None
        if not self.carried or carry is None:  # (a carry is only made of a prepared plan)
            return None
        seqs, tokens, positions, _ = carry
        decoding, appends = len(self._prepared[4]), self._appends
        if appends is None or appends.seqs != seqs:
            appends = self._appends = (
                _joined_appends(appends, _appends_of(seqs[decoding:]), seqs)
                if decoding < len(seqs) and appends is not None
                and appends.seqs == seqs[:decoding] else _appends_of(seqs))
        elif appends.seqs is not seqs:  # the carry's own tuple: `_align` knows it by identity
            appends = self._appends = appends._replace(seqs=seqs)
        if not appends.plain:
            return None
        for seq in seqs[decoding:]:
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
        self._appended = appended = self._sampled
        list(map(list.append, appends.tokens, appended))
        list(map(list.append, appends.times, itertools.repeat(now)))
        # each sequence's length is now its next position + 1
        may_stop = (positions + 1 >= appends.max_len) | appends.stops
        if eos_token_ids:
            may_stop |= appends.eos & np.isin(tokens, list(eos_token_ids))
        self._checked = checked = np.flatnonzero(may_stop).tolist()
        return map(samples.__getitem__, checked)

    def outputs(self, finished: list,
                ) -> tuple[list, list[int], list[int], Ints[int], list[int]] | None:
        """``(listeners, request ids, sample indexes, tokens, checked)`` of this step's
        samples, in order, when `append` made its appends and every request has a listener
        and one sample; else None. Each output is plain (no finish reason, no request
        output) but those at the indexes `checked` (ascending), which may have finished:
        the samples `append` handed back to be checked when any request finished
        (`finished`: the requests `update_from_output` returned), else none."""
        appends = self._appends
        if self._appended is None or appends.listeners is None:
            return None
        return (*appends.listeners, self._appended, self._checked if finished else [])


def _next_tokens(seqs: Collection[Sequence]) -> np.ndarray:
    """``[B]`` int32: each sequence's first token not computed (a decoding one's last)."""
    return np.fromiter((seq.token_ids[seq.num_computed] for seq in seqs), np.int32,
                       len(seqs))


def _computed(seqs: Collection[Sequence]) -> np.ndarray:
    """``[B]`` int64: each sequence's computed count (its next token's position)."""
    return np.fromiter((seq.num_computed for seq in seqs), np.int64, len(seqs))


def without(entries: Ints, gone: list[int]) -> Iterable:
    """`entries` less those at the indexes `gone` (ascending), in order: the runs between
    them sliced whole, in C (a carry's sequences, and the sampler's setup of them, less
    those that left: `SteadyDecode._align`, `draw.DrawSetup.of`)."""
    runs = zip([-1, *gone], [*gone, len(entries)], strict=True)
    return itertools.chain.from_iterable(entries[start + 1: end] for start, end in runs)


def _kept_appends(appends: _Appends, seqs: tuple[Sequence, ...], gone: list[int],
                  kept: np.ndarray) -> _Appends:
    """`appends` of the carried batch less its entries at `gone` (ascending; `kept`: the
    others), now of `seqs`: its lists edited in place (its own), its arrays indexed."""
    lists = [appends.tokens, appends.times, *(appends.listeners or ())]
    for index in reversed(gone):
        for entries in lists:
            del entries[index]
    return appends._replace(seqs=seqs, max_len=appends.max_len[kept], eos=appends.eos[kept],
                            stops=appends.stops[kept])


def _joined_appends(first: _Appends, then: _Appends, seqs: tuple[Sequence, ...],
                    ) -> _Appends:
    """The appends of `first`'s batch followed by `then`'s: of `seqs`, both batches'."""
    listeners = None
    if first.listeners is not None and then.listeners is not None:
        listeners = tuple(a + b for a, b in zip(first.listeners, then.listeners, strict=True))
    return _Appends(seqs, first.tokens + then.tokens,
                    first.times + then.times, np.concatenate((first.max_len, then.max_len)),
                    np.concatenate((first.eos, then.eos)),
                    np.concatenate((first.stops, then.stops)), first.plain and then.plain,
                    listeners)


def _appends_of(seqs: tuple[Sequence, ...]) -> _Appends:
    """The lists and limits of a carried batch, read once from its sequences."""
    params = [seq.request.params for seq in seqs]
    listeners = [seq.request.on_output for seq in seqs]
    plain_outputs = None not in listeners and all(p.n == 1 for p in params)
    return _Appends(seqs, [seq.token_ids for seq in seqs], [seq.token_times for seq in seqs],
                    np.fromiter((seq.max_len for seq in seqs), np.int64, len(seqs)),
                    np.fromiter((not p.ignore_eos for p in params), bool, len(params)),
                    np.fromiter((bool(p.stop_token_ids) for p in params), bool, len(params)),
                    all(p.logprobs is None for p in params),
                    (listeners, [seq.request.request_id for seq in seqs],
                     [seq.index for seq in seqs]) if plain_outputs else None)
