"""The ``step_cost`` workload's second part: one decode step's bookkeeping against the number
of running sequences (256, 512, 1,024), for one layer group and for three.

A step's bookkeeping is everything the engine does for it outside the model: the
scheduler's plan, the block manager's step (blocks, copy-on-write, prefix indexing, window
give-backs, state checkpoints) and the step's input arrays (`StepBatch`: block tables, slot
mapping, lengths, one per layer group). Two lines per layout:

- ``cache``: the running set's row handles resolved once (`rows_of`), then per step one
  ``[B]`` int32 token array and `prepare_decode` (what the scheduler's `prepare` calls);
- ``scheduler``: the engine's `Scheduler` driven without a model: `schedule`, `prepare`,
  `advance` and `update_from_output` (the sampled token stands in as
  `output_token_id`). The list of samples handed to `update_from_output` stands in for
  the model and its sampler (the engine's `draw_rows` builds it from the drawn tokens), so
  it is built off the clock: it is not the step's bookkeeping, and the stand-in's own
  per-sequence token arithmetic is work no engine does.
- ``engine``: `Engine.step` whole, over a model that does no work (`NullModel`: logits
  whose greedy token is a function of the position), less the model's own time: the
  scheduler's and the cache's part as above, plus the model's input arrays (token ids,
  positions, the sampled rows), greedy sampling of a 64-token vocabulary, the token
  appends and stop checks, and one `StepOutput` per sample handed to its request's
  listener. What a user's engine pays outside the forward, every step.

Layouts: ``1 group`` is a uniform full-attention cache; ``3 groups`` a cache whose layers
are full attention, a sliding window of `WINDOW` tokens and a recurrent state layer (a
full group, a window group giving blocks back, the state group offering a checkpoint at
every filled block). The sequences are the serving trace's prompts (`make_trace`),
admitted through the scheduler in steps of `PREFILL_TOKENS` tokens, then decoded; every
stepper of one size holds the same prompts and takes the same tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from ...config import CacheConfig, LayerKind, StateSpec
from ...core.cache import PagedKVCache
from ...engine.config import EngineConfig
from ...engine.draw import Samples
from ...engine.engine import Engine
from ...engine.request import Request, Sequence
from ...engine.sampling import Drawn, SamplingParams
from ...engine.scheduler import Scheduler
from ..results import Plot, Series
from ..timing import Figure, Stat
from ..trace import TraceSpec, make_trace, output_token_id

BLOCK_SIZE = 16
WINDOW = 256  # tokens of the sliding-window layer (16 blocks, as Gemma's 512 at block 32)
PREFILL_TOKENS = 8192  # the scheduler's token budget per step while the prompts are admitted
LAYOUTS = {1: (LayerKind(),),
           3: (LayerKind(), LayerKind.sliding(WINDOW),
               LayerKind.recurrent((StateSpec("ssm", (1,), torch.float32),)))}
KINDS = ("cache", "scheduler", "engine")


def bookkeeping_config(num_groups: int, prompts: list[tuple[int, ...]], decode_steps: int,
                       ) -> CacheConfig:
    """A cache of `num_groups` layer groups whose pool is negligible (one head of width 1
    per layer) and holds `prompts` through `decode_steps` more tokens each, with room left
    over so no allocation evicts a live block; state slots for every sequence's live state
    and as many checkpoints again (more are offered: the policy then evicts)."""
    kinds = LAYOUTS[num_groups]
    tokens = [len(p) + decode_steps + PREFILL_TOKENS // BLOCK_SIZE for p in prompts]
    blocks = sum(-(-n // BLOCK_SIZE) for n in tokens)
    window = (len(kinds) > 1) * len(prompts) * (WINDOW // BLOCK_SIZE + 2)
    recurrent = sum(kind.is_recurrent for kind in kinds)
    return CacheConfig(num_layers=len(kinds), num_kv_heads=1, head_dim=1,
                       block_size=BLOCK_SIZE, num_blocks=blocks + window + 64,
                       dtype=torch.float16, max_num_seqs=len(prompts),
                       layer_kinds=kinds if len(kinds) > 1 else (),
                       num_state_slots=recurrent * (2 * len(prompts) + 1024))


def trace_prompts(num_seqs: int, seed: int = 0) -> list[tuple[int, ...]]:
    """The first `num_seqs` prompts of the serving trace (`TraceSpec`'s defaults: mean 512
    tokens, at most 4,096, half behind a 256-token system prompt)."""
    return [r.prompt_token_ids for r in make_trace(TraceSpec(num_requests=num_seqs), seed)]


class NullModel(torch.nn.Module):
    """A model that does no work: ``[rows, VOCAB]`` logits whose greedy token is the row
    position's `VOCAB`-th residue (so every sequence's tokens change each step), read from
    a table made once; it keeps the seconds its calls take (`seconds`)."""

    VOCAB = 64

    class config:  # what the engine's request checks read: the trace's token ids
        vocab_size = TraceSpec().vocab_size
        max_position = 1 << 16

    def __init__(self) -> None:
        super().__init__()
        self.table, self.seconds = torch.eye(self.VOCAB), 0.0

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                batch: object, logits_indices: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.table[positions[logits_indices] % self.VOCAB]
        self.seconds += time.perf_counter() - start
        return logits


class DecodeStepper:
    """`len(prompts)` running sequences of a `num_groups`-group cache, all admitted and
    decoding; `step` runs one decode step of every one of them (`kind`: see the module
    docstring) and returns the seconds of its bookkeeping."""

    def __init__(self, kind: str, num_groups: int, prompts: list[tuple[int, ...]],
                 decode_steps: int) -> None:
        self.kind, self.step_index = kind, 0
        config = bookkeeping_config(num_groups, prompts, decode_steps)
        advance = (self._start_engine(config, prompts, decode_steps) if kind == "engine"
                   else self._start_scheduler(config, prompts))
        while self.scheduler.waiting or any(
                seq.num_computed < len(seq.token_ids) - 1 for seq in self.scheduler.running):
            advance()  # admit, prefill in chunks, then decode until all decode
        self.rows = self.cache.rows_of([seq.seq_id for seq in self.scheduler.running])
        self.step = {"cache": self._cache_step, "scheduler": self._scheduler_step,
                     "engine": self._engine_step}[kind]

    def _start_scheduler(self, config: CacheConfig, prompts: list[tuple[int, ...]],
                         ) -> Callable[[], object]:
        """The ``cache`` and ``scheduler`` kinds: a `Scheduler` over its own cache, the
        prompts queued; returns its step."""
        # the engine's cache keeps its block tables (each batch dropped in its step)
        self.cache = PagedKVCache(dataclasses.replace(config, reuse_block_tables=True))
        self.scheduler = Scheduler(self.cache, max_num_seqs=len(prompts),
                                   max_num_batched_tokens=PREFILL_TOKENS,
                                   preemption="recompute")
        params = SamplingParams(max_tokens=1 << 30, ignore_eos=True)
        for request_id, prompt in enumerate(prompts):
            request = Request(request_id, list(prompt), params, 0.0)
            self.scheduler.add(Sequence(request, 0, list(prompt), None))
        return self._scheduler_step

    def _start_engine(self, config: CacheConfig, prompts: list[tuple[int, ...]],
                      decode_steps: int) -> Callable[[], object]:
        """The ``engine`` kind: an `Engine` over `NullModel`, the prompts queued; returns
        its step."""
        self.model, self.outputs = NullModel(), collections.deque(maxlen=1)
        self.engine = Engine(self.model, EngineConfig(
            cache=config, max_num_seqs=len(prompts), max_num_batched_tokens=PREFILL_TOKENS,
            num_threads=1))  # the step's bookkeeping is Python on one thread
        # as many tokens as the pool holds (`bookkeeping_config`): the first sequences
        # decode while the last are prefilled, and none may finish within the timed steps
        params = SamplingParams(max_tokens=decode_steps + PREFILL_TOKENS // BLOCK_SIZE,
                                ignore_eos=True, temperature=0.0)
        for prompt in prompts:
            self.engine.add_request(list(prompt), params, on_output=self.outputs.append)
        self.scheduler, self.cache = self.engine.scheduler, self.engine.cache
        return self.engine.step

    def _engine_step(self) -> float:
        before, start = self.model.seconds, time.perf_counter()
        self.engine.step()
        return time.perf_counter() - start - (self.model.seconds - before)

    def _scheduler_step(self) -> float:
        scheduler, clock = self.scheduler, time.perf_counter
        start = clock()
        plan = scheduler.schedule()
        scheduler.prepare(plan)
        scheduler.advance(plan)
        paused = clock()
        samples = model_samples(plan)  # the model and sampler's part: off the clock
        resumed = clock()
        scheduler.update_from_output(samples, frozenset())
        return clock() - resumed + paused - start

    def _cache_step(self) -> float:
        start = time.perf_counter()
        # the token array built inside the step, as the scheduler's `prepare` builds it
        tokens = np.full(self.rows.size, output_token_id(0, self.step_index), dtype=np.int32)
        self.cache.prepare_decode(self.rows, tokens)
        self.step_index += 1
        return time.perf_counter() - start


class MixedSteps:
    """A loaded server's usual step, as the step benchmarks drive it: an engine's
    `DecodeStepper` over the trace's first `num_seqs` prompts, and before each step (off
    the clock, `churn`) `turnover` running requests aborted and, with arrivals, as many
    of the trace's next prompts (their first `prompt` tokens) added, to be prefilled
    within the step beside the decoding ones.

    Attributes
    ----------
    stepper : DecodeStepper
        The engine's stepper (``"engine"`` kind), room for ``3 * num_steps`` more steps.
    """

    def __init__(self, num_groups: int, num_seqs: int, num_steps: int, prompt: int = 128,
                 turnover: int = 1) -> None:
        self.num_seqs, self.prompt, self.turnover = num_seqs, prompt, turnover
        self.prompts = trace_prompts(num_seqs + num_steps * turnover + 2)
        self.stepper = DecodeStepper("engine", num_groups, self.prompts[:num_seqs],
                                     3 * num_steps + 8)
        self.params = SamplingParams(max_tokens=4 * num_steps, ignore_eos=True,
                                     temperature=0.0)

    def churn(self, step: int, arrivals: bool = True) -> None:
        """Before step number `step`: `turnover` requests spread over the running set go
        (and, with `arrivals`, as many new ones come)."""
        engine, running = self.stepper.engine, self.stepper.scheduler.running
        for k in range(self.turnover):
            engine.abort(running[(37 * step + k * 101) % len(running)].request.request_id)
            if arrivals:
                new = self.prompts[self.num_seqs + step * self.turnover + k][:self.prompt]
                engine.add_request(list(new), self.params,
                                   on_output=self.stepper.outputs.append)


class TurnoverSteps:
    """A loaded server in its steady state: `num_seqs` running requests of staggered
    lengths (``20 + 37 i mod 200`` tokens: ~120 on average), so about ``num_seqs / 120``
    finish inside each step, and before each step (`refill`, off the clock) as many of
    the trace's next prompts (their first `prompt` tokens, of staggered lengths too) as
    keep `num_seqs` requests in the engine, to be prefilled within it. Requests leave and
    join every step, as in `MixedSteps`, but by finishing inside the step, as they do.

    Attributes
    ----------
    engine : Engine
        Over `NullModel`, its pool sized for `num_seqs` sequences and `warm` steps.
    model : NullModel
    """

    WARM = 170  # steps before the turnover settles: the prompts prefilled, lengths spread

    def __init__(self, num_groups: int, num_seqs: int, prompt: int = 128) -> None:
        self.num_seqs, self.prompt, self.next = num_seqs, prompt, num_seqs
        self.prompts = trace_prompts(num_seqs * 8)
        self.model, self.outputs = NullModel(), collections.deque(maxlen=1)
        config = bookkeeping_config(num_groups, self.prompts[:num_seqs], 400)
        self.engine = Engine(self.model, EngineConfig(
            cache=config, max_num_seqs=num_seqs, max_num_batched_tokens=PREFILL_TOKENS,
            num_threads=1))
        for i in range(num_seqs):
            self._add(list(self.prompts[i]), i)
        for _ in range(self.WARM):
            self.refill()
            self.engine.step()

    def _add(self, prompt: list[int], i: int) -> None:
        params = SamplingParams(max_tokens=20 + 37 * i % 200, ignore_eos=True,
                                temperature=0.0)
        self.engine.add_request(prompt, params, on_output=self.outputs.append)

    def refill(self) -> None:
        """New requests up to `num_seqs` in the engine (before a step, off the clock)."""
        scheduler = self.engine.scheduler
        while len(scheduler.running) + len(scheduler.waiting) < self.num_seqs:
            self._add(list(self.prompts[self.next % len(self.prompts)][:self.prompt]),
                      self.next)
            self.next += 1

    def step(self) -> float:
        """One engine step; seconds of its bookkeeping (less the model's own time)."""
        before, start = self.model.seconds, time.perf_counter()
        self.engine.step()
        return time.perf_counter() - start - (self.model.seconds - before)


def model_samples(plan: dict[Sequence, int]) -> Samples:
    """What the model and its sampler hand `Scheduler.update_from_output` after `plan`:
    a token for each sequence whose next token is due (`output_token_id` of its position),
    as the engine's sampler hands them (`Samples`: the sequences and tokens beside, the
    tokens a `Drawn` list with their array)."""
    seqs = [seq for seq in plan if seq.num_computed == len(seq.token_ids)]
    tokens = Drawn([output_token_id(seq.request.request_id, len(seq.token_ids))
                    for seq in seqs])
    tokens.array = np.array(tokens, dtype=np.int64)
    return Samples.of(seqs, tokens)


def time_steps(stepper: DecodeStepper, num_steps: int) -> float:
    """Median seconds of `num_steps` decode steps' bookkeeping (after one untimed)."""
    stepper.step()
    return statistics.median(stepper.step() for _ in range(num_steps))


def measure(num_seqs: tuple[int, ...], decode_steps: int, repeats: int, seed: int = 0,
            ) -> dict[tuple[int, str, int], Stat]:
    """``{(groups, kind, sequences): seconds per step}`` over `repeats` fresh steppers of
    each, the sizes and layouts interleaved in every repeat."""
    prompts = {n: trace_prompts(n, seed) for n in num_seqs}
    keys = [(groups, kind, n) for n in num_seqs for groups in LAYOUTS for kind in KINDS]
    times: dict[tuple[int, str, int], list[float]] = {key: [] for key in keys}
    for _ in range(repeats):
        for groups, kind, n in keys:
            stepper = DecodeStepper(kind, groups, prompts[n], decode_steps + 1)
            times[(groups, kind, n)].append(time_steps(stepper, decode_steps))
    return {key: Stat(tuple(values), "s") for key, values in times.items()}


def growth(stats: dict[tuple[int, str, int], Stat], groups: int, kind: str,
           ) -> list[tuple[int, float]]:
    """``(sequences, step time over the step at half as many)`` for each doubling measured."""
    sizes = sorted(n for g, k, n in stats if (g, k) == (groups, kind))
    return [(n, stats[(groups, kind, n)].median / stats[(groups, kind, n // 2)].median)
            for n in sizes if n // 2 in sizes]


def label(groups: int, kind: str) -> str:
    """A line's name: the layout (`LAYOUTS`: 1 group is full attention; 3 are full, sliding
    and state) and what the step runs; short, as the summary table cuts long names."""
    return f"{groups} group{'s' if groups > 1 else ''}, {kind}"


def growth_rows(stats: dict[tuple[int, str, int], Stat]) -> tuple[list[Figure], dict, Plot]:
    """The growth figures (each step against the one at half the sequences, and three
    groups against one), the growth per doubling as info, and the plot of ms per step."""
    ms = {key: stat.scaled(1e3, "ms") for key, stat in stats.items()}
    lines = sorted({(g, k) for g, k, _ in ms})
    figures = [Figure(f"decode step, {n} seqs, {label(g, k)}", ms[(g, k, n)],
                      f"the same at {n // 2} seqs", ms[(g, k, n // 2)], False)
               for g, k in lines for n, _ in growth(stats, g, k)]
    figures += [Figure(f"decode step, {n} seqs, {kind}: 3 groups", ms[(3, kind, n)],
                       "1 group", ms[(1, kind, n)], False)
                for groups, kind, n in ms if groups == 3 and (1, kind, n) in ms]
    info = {f"{label(g, k)}: growth per doubling": ", ".join(
        f"{n // 2}->{n}: {ratio:.2f}x" for n, ratio in growth(stats, g, k)) for g, k in lines}
    info.update({f"{label(g, k)}: ms per step": ", ".join(
        f"{n}: {ms[(g, k, n)].median:.3f}" for gg, kk, n in sorted(ms) if (gg, kk) == (g, k))
        for g, k in lines})
    series = []
    for g, k in lines:
        sizes = sorted(n for gg, kk, n in ms if (gg, kk) == (g, k))
        series.append(Series(label(g, k), tuple(float(n) for n in sizes),
                             tuple(ms[(g, k, n)].median for n in sizes),
                             tuple(ms[(g, k, n)].min for n in sizes),
                             tuple(ms[(g, k, n)].max for n in sizes)))
    plot = Plot("one decode step's bookkeeping", "running sequences", "ms per step",
                tuple(series), kind="line", logx=True, logy=True)
    return figures, info, plot
