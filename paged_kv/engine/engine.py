"""`Engine`: continuous batching over a `PagedKVCache` and a model, with vLLM-shaped outputs."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import abc
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .._checks import check_retain
from ..core.cache import PagedKVCache
from ..parts import EnginePart, build_parts, close_parts
from .config import EngineConfig
from .draw import DrawSetup, Sample, by_request, draw_rows
from .errors import EngineDeadError
from .limits import check_request
from .metrics import EngineMetrics, engine_stats
from .outputs import EngineStats, RequestOutput, StepOutput
from .request import Request, Sequence
from .runner import ModelRunner, ModelStep, TensorParallelRunner
from .sampling import SamplingParams, sample_generator
from .scheduler import Scheduler
from .sizing import state_line
from .stream import emit, emit_samples
from .threads import ThreadGovernor, intra_op_threads

if TYPE_CHECKING:  # the hand-off and the events need the serve extra (pyzmq, msgspec)
    from ..events.publisher import EventPublisher
    from ..handoff.params import HandoffParams
    from ..tiers.manager import TierManager

logger = logging.getLogger(__name__)
_SEED_BATCH = 64  # unseeded requests' seeds drawn at once (`Engine._next_seed`)



class Engine:
    """Continuous batching: chunked prefill, prefix reuse, parallel sampling, preemption.

    Parameters
    ----------
    model : torch.nn.Module
        Called as ``model(token_ids, positions, cache, batch, logits_indices) -> logits``;
        ``model.config.vocab_size`` and ``max_position`` bound the requests; a sequence stops
        at any of ``model.eos_token_ids`` (if it has them) unless ``SamplingParams.ignore_eos``.
    config : EngineConfig, optional
        The cache, the scheduler's knobs, threads, tensor parallelism and the optional parts
        (tiers, KV events, a hand-off role, the caller's own: see `EngineConfig`). None:
        every default (the pool sized from the free memory). Checked when it is made, so
        a bad field raises before anything here is built.

    Examples
    --------
    >>> from paged_kv.engine import TinyLlama, TinyLlamaConfig
    >>> model = TinyLlama(TinyLlamaConfig(num_layers=1, hidden_size=64, intermediate_size=64,
    ...                                   vocab_size=50, num_heads=4, head_dim=16))
    >>> engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=32)))
    >>> [out] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    >>> len(out.outputs[0].token_ids), out.outputs[0].finish_reason
    (4, 'length')
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config: expected EngineConfig, got {type(config).__name__} "
                            f"(a CacheConfig goes in EngineConfig(cache=...))")
        config = (config or EngineConfig()).sized_for(model)
        # each batch is run and dropped before the next step is prepared: the cache may
        # update its block tables in place rather than write new ones each step
        self.config = config = dataclasses.replace(config, cache=dataclasses.replace(
            config.cache, reuse_block_tables=True))
        # CPU steps run on the cores other processes leave free (see paged_kv._threads)
        self._threads = (ThreadGovernor(config.num_threads) if config.cache.device.type
                         == "cpu" or config.num_threads is not None else None)
        self.eos_token_ids = frozenset(getattr(model, "eos_token_ids", ()))
        cache_config, group = config.cache, None
        if config.tensor_parallel_size != 1:
            model, cache_config, group = TensorParallelRunner.start(
                model, cache_config, config.tensor_parallel_size)
        self._named: dict[str, EnginePart] = {}  # the optional parts, by name
        try:
            self.cache = PagedKVCache(cache_config)
            self.runner = (ModelRunner(model, self.cache) if group is None
                           else TensorParallelRunner(model, self.cache, group))
            # the parts the config names, each from those before it: the engine names none
            self._named = build_parts(config.part_factories(), self.cache, model)
            self.parts = list(self._named.values())  # each hook called on each, in order
            self.scheduler = Scheduler(self.cache, max_num_seqs=config.max_num_seqs,
                                       max_num_batched_tokens=config.max_num_batched_tokens,
                                       preemption=config.preemption, tiers=self.tiers)
            self.metrics = EngineMetrics(self.pool_bytes_per_rank())
            if cache_config.num_state_slots:  # recurrent layers: what the slab holds
                logger.info("# %s", state_line(cache_config, config.max_num_seqs))
        except BaseException:
            self._close_parts(group)
            raise
        self.model = model
        self._next_id = 0
        self._requests: dict[int, Request] = {}  # unfinished, by id
        self._unforked: set[int] = set()  # requests of n > 1 whose samples are not forked
        self._draw_setup = DrawSetup()  # the last batch's sampling setup, for the same next
        self._seed_source = torch.Generator().manual_seed(0)
        self._seeds: abc.Iterator[int] = iter(())  # drawn from it, not yet given out
        self._dead: str | None = None  # why the engine cannot step any more

    def _close_parts(self, group) -> None:
        """Undo a constructor that failed part-way: no half-built engine leaves the group
        initialised, or the tiers' threads running and their disk directory locked (a retry
        in this process would be refused it)."""
        close_parts(self._named.values())
        if group is not None:
            group.close()

    def part(self, name: str) -> EnginePart | None:
        """The part built under `name` (``"tiers"``, ``"events"``, ``"handoff"``,
        ``"parts[i]"``: `EngineConfig.part_factories`), or None when there is none."""
        return self._named.get(name)

    @property
    def tiers(self) -> TierManager | None:
        """The tiers behind the pool (a decode engine always has them), or None."""
        return self._named.get("tiers")

    @property
    def events(self) -> EventPublisher | None:
        """The KV-event publisher, or None."""
        return self._named.get("events")

    @property
    def handoff(self) -> EnginePart | None:
        """The hand-off role (a `PrefillRole` or a `DecodeRole`), or None."""
        return self._named.get("handoff")

    # -- requests ------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: abc.Sequence[int], params: SamplingParams | None = None,
                    *, salt: str | None = None, priority: int | None = None,
                    retention_seconds: float | None = None,
                    on_output: Callable[[StepOutput], None] | None = None,
                    handoff: HandoffParams | None = None) -> int:
        """Queue a request; returns its id.

        Parameters
        ----------
        prompt_token_ids : sequence of int
        params : SamplingParams, optional
        salt : str, optional
            Prefix-cache salt: only requests with the same salt share cached blocks.
        priority, retention_seconds : optional
            Soft retention of the request's cached blocks once it finishes (0-99, seconds;
            None: its tenant's defaults), under the cache's tenant policy (see
            `paged_kv.tenants`; without one nothing is retained).
        on_output : callable, optional
            Called on the engine's thread with a `StepOutput` for every token of every
            sample as it is generated, and once more per sample when it finishes.
        handoff : HandoffParams, optional
            The request's ``kv_transfer_params``: on a prefill engine ``do_remote_decode``
            leases its prompt's pages (its output's ``kv_transfer_params`` say where); on
            a decode engine, where to pull them from (without them: a fallback, counted,
            and under the ``fail`` policy the request fails).

        Raises
        ------
        ValueError
            Naming the problem, for a request that can never run; the engine is unchanged.
        """
        params = params or SamplingParams()
        prompt = self._validate(prompt_token_ids, params)
        if salt is not None and not isinstance(salt, str):
            raise TypeError(f"salt: expected str or None, got {type(salt).__name__}")
        retain = check_retain("add_request()", priority, retention_seconds)
        request = Request(self._next_id, prompt, params, time.perf_counter(), salt=salt,
                          on_output=on_output, retain=retain)
        seed = params.seed if params.seed is not None else self._next_seed()
        self.scheduler.add(Sequence(request, 0, list(prompt), sample_generator(params, seed, 0)))
        self._requests[request.request_id] = request
        if params.n > 1:
            self._unforked.add(request.request_id)
        self._next_id += 1
        for part in self.parts:
            error = part.admit(request, handoff)
            if error is not None:
                self.abort(request.request_id, error=error)
                break
        return request.request_id

    def _next_seed(self) -> int:
        """An unseeded request's seed: the seed source's next draw, drawn `_SEED_BATCH` at
        a time (the same seeds in the same order as one `torch.randint` a request: a CPU
        generator's draws of 64-bit ints are serial), since one torch call costs an idle
        core's first request ~0.13 ms of its ~0.4 ms `add_request`, the draw itself none."""
        seed = next(self._seeds, None)
        if seed is None:
            self._seeds = iter(torch.randint(0, 2**62, (_SEED_BATCH,),
                                             generator=self._seed_source).tolist())
            seed = next(self._seeds)
        return seed

    def flush_tenant(self, tenant: str, *, retention_only: bool = False) -> int:
        """Evict `tenant`'s cached blocks from the pool (its running requests keep theirs),
        or with `retention_only` end their soft retention; returns how many (an admin's
        flush / unretain; `PagedKVCache.reset_prefix_cache`)."""
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant: expected a non-empty string, got {tenant!r}")
        return self.cache.reset_prefix_cache(tenant, retention_only=retention_only)

    def check_request(self, prompt_token_ids: abc.Sequence[int], params: SamplingParams) -> None:
        """Raise what `add_request` would for this request, changing nothing (it reads only
        fixed configuration, so any thread may call it)."""
        self._validate(prompt_token_ids, params)

    def abort(self, request_id: int, error: str | None = None) -> bool:
        """Stop a request now: its samples finish with reason "abort" (or "error" when an
        `error` message is given: the engine failed it) and their blocks are freed before
        the next step. Returns False when the request is unknown or done."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self._unforked.discard(request_id)
        for part in self.parts:
            part.forget(request)
        self.scheduler.abort_request(request, error, lambda seq: emit(seq, []))
        return True

    @property
    def num_waiting_requests(self) -> int:
        """Sequences waiting to be admitted (a request's samples count once until forked)."""
        return len(self.scheduler.waiting) + len(self.scheduler.loading)

    def _validate(self, prompt_token_ids: abc.Sequence[int], params: SamplingParams) -> list[int]:
        return check_request(prompt_token_ids, params, self.model.config,
                             self.scheduler.max_num_seqs, self.cache.config,
                             self.scheduler.max_num_batched_tokens)

    def generate(self, prompts: abc.Sequence[abc.Sequence[int]],
                 params: SamplingParams | abc.Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Serve `prompts` to completion; outputs in prompt order."""
        params_list = (list(params) if isinstance(params, list | tuple)
                       else [params or SamplingParams()] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"params: {len(params_list)} given for {len(prompts)} prompts")
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            try:
                self._validate(prompt, p)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"prompt {i}: {exc}") from None
        finished: dict[int, RequestOutput] = {}

        def keep_failed(out: StepOutput) -> None:  # step() returns only the served ones
            if out.output is not None and out.output.error is not None:
                finished[out.request_id] = out.output

        ids = [self.add_request(p, q, on_output=keep_failed)
               for p, q in zip(prompts, params_list, strict=True)]
        while any(i not in finished for i in ids):
            finished.update((out.request_id, out) for out in self.step())
        return [finished[i] for i in ids]

    @property
    def max_num_seqs(self) -> int:
        """Sequences that run at once (the server's free slots: this less ``num_running``)."""
        return self.scheduler.max_num_seqs

    def unfinished_request_ids(self) -> list[int]:
        """Ids of the requests waiting, running or swapped out, oldest first."""
        return list(self._requests)

    @property
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or swapped out."""
        return self.scheduler.has_work

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns the requests that finished."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        threads = None if self._threads is None else self._threads.step_threads()
        with intra_op_threads(threads):  # the whole step: sampling runs torch ops too
            return self._step()

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        for part in self.parts:  # e.g. heartbeats; hand-offs the `fail` policy fails
            for request_id, error in part.tick(self.scheduler):
                self.abort(request_id, error=error)
        if not plan:
            if self.scheduler.loading:  # only fetches to wait for: let their thread run
                time.sleep(0.001)
            return []
        step = ModelStep.join(self._run(plan))  # prepare -> run, per request after a failure
        samples = self._sample(step)
        finished = self.scheduler.update_from_output(samples, self.eos_token_ids)
        for part in self.parts if finished else ():  # e.g. a prefill's lease, before the
            for request in finished:  # request's last output is emitted
                part.finished(request)
        # each finished request's output made once: its listener's and the step's return
        outputs = {request.request_id: request.output(request.finish_time)
                   for request in finished}
        emit_samples(samples, finished, self.scheduler.steady.outputs(finished), outputs)
        watching = [part for part in self.parts if part.wants_events]
        if watching:  # e.g. the blocks this step wrote, copied out; the index's changes
            events = self.cache.take_events()
            for part in watching:
                part.after_step(events)
        self.metrics.after_step(self.stats, len(samples))
        return [outputs[request.request_id] for request in finished
                if self._requests.pop(request.request_id, None)]

    def _run(self, plan: dict[Sequence, int]) -> list[ModelStep]:
        """The model over `plan`. When it fails, each request's part runs alone, so only
        the requests whose own part fails are failed, not their batch-mates (a model error
        is a property of some request's input as often as of the step)."""
        try:
            batch = self.scheduler.prepare(plan)
            start = time.perf_counter()
            inputs = self.scheduler.step_inputs(plan)
            step = self.runner.run(plan, batch, inputs)  # on an error it gave the slots back
            seconds = time.perf_counter() - start
            for part in self.parts:  # e.g. the recompute rate a fetch must beat
                part.observe_prefill(batch.num_tokens, seconds)
        except EngineDeadError as exc:  # the runner cannot go on (a rank died, or is behind)
            self._dead = f"{exc}; restart the engine"
            raise
        except Exception as exc:
            parts = by_request(plan)
            if len(parts) == 1:
                self._fail(plan, f"the model failed on this step: {exc!r}")
                return []
        else:
            self.scheduler.advance(plan, step.prompt_logprobs)  # once their K/V is written
            return [step]
        logger.warning("a step of %d requests failed; rerunning them one by one", len(parts))
        return [step for part in parts for step in self._run(part)]

    def _sample(self, step: ModelStep) -> list[Sample]:
        """Every sample's next token (a forked request's samples share their row)."""
        if not self._unforked:  # no request has samples still to fork: a row each
            return self._draw(step.logits, step.sampled)
        targets = [(row, target) for row, seq in enumerate(step.sampled)
                   for target in self._fork_samples(seq)]
        return self._draw(step.logits, [t for _, t in targets], [row for row, _ in targets])

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence],
              rows: list[int] | None = None) -> list[Sample]:
        """The tokens of `seqs` from their `logits` rows (`rows`; None: row i for the i-th)
        in one batched call; when the call fails, request by request, failing only the
        requests whose own call fails."""
        # kept: no pass a step, nor past the sequences that left it
        setup = self._draw_setup.of(seqs, logits.shape[-1], self.scheduler.steady.dropped)
        states = [(generator, generator.get_state()) for generator in setup.seeded]
        try:
            return draw_rows(logits, seqs, rows, setup)
        except Exception as exc:
            parts = by_request(dict(zip(seqs, range(len(seqs)) if rows is None else rows,
                                        strict=True)))
            if len(parts) == 1:
                self._fail(seqs, f"sampling failed on this step: {exc!r}")
                return []
        for generator, state in states:  # as if the failed call had never drawn
            generator.set_state(state)
        return [sample for part in parts
                for sample in self._draw(logits, list(part), list(part.values()))]

    def _fail(self, seqs: abc.Iterable[Sequence], message: str) -> None:
        """Fail the requests of `seqs` (finish reason "error", `message` as their error);
        called while their exception is handled, so the log has its traceback."""
        requests = dict.fromkeys(seq.request.request_id for seq in seqs)  # in step order
        logger.exception("failing %d requests: %s", len(requests), message)
        for request_id in requests:
            self.abort(request_id, error=message)

    def _fork_samples(self, seq: Sequence) -> list[Sequence]:
        """`seq`, plus its request's other samples when its prompt was just computed."""
        request = seq.request
        if seq.index or request.params.n == 1 or len(request.samples) == request.params.n:
            return [seq]
        self._unforked.discard(request.request_id)
        seed = seq.generator.initial_seed() if seq.generator else 0  # (seq is sample 0)
        children = [Sequence(request, i, list(seq.token_ids), sample_generator(request.params,
                                                                         seed, i))
                    for i in range(1, request.params.n)]
        for child in children:  # the same prompt: its keys, should a child be admitted again
            child.block_keys = seq.block_keys
        self.scheduler.add_children(seq, children)
        return [seq, *children]

    # -- lifetime and observation -------------------------------------------------------
    @property
    def tensor_parallel_size(self) -> int:
        """Ranks the model and the KV pool are split over (1: this process alone)."""
        return self.runner.tensor_parallel_size

    def pool_bytes_per_rank(self) -> list[int]:
        """KV pool bytes of every rank (each holds its share of the KV heads)."""
        return self.runner.pool_bytes_per_rank()

    def check(self) -> None:
        """`PagedKVCache.check`; with tensor parallelism, every rank's pool has its blocks."""
        self.runner.check()

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any); the engine cannot step afterwards
        (`step` raises `EngineDeadError`)."""
        self._dead = self._dead or "the engine was closed"
        self.runner.close()
        for part in self.parts:
            part.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stats(self) -> EngineStats:
        """A read-only snapshot of the queues and the cache's counters (no per-sequence
        work: cheap enough for every step). With tenants (a policy, or salted requests
        running) the live blocks by tenant add one pass over the running sequences' block
        ids (`tenant_stats.tenant_blocks`)."""
        return engine_stats(self.scheduler, self.cache, self.tiers)

    def metrics_text(self) -> str:
        """The engine's metrics in Prometheus exposition format, gauges as of now."""
        self.metrics.observe(self.stats(), 0)
        text = self.metrics.text(self.cache)
        return text + "".join(part.text() for part in self.parts)

