"""`Engine`: continuous batching over a `PagedKVCache` and a model, with vLLM-shaped outputs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from .._threads import ThreadGovernor, intra_op_threads
from ..cache import PagedKVCache
from ..config import CacheConfig
from .errors import EngineDeadError
from .metrics import EngineMetrics
from .outputs import CompletionOutput, EngineStats, RequestOutput, StepOutput
from .request import Request, Sequence
from .runner import ModelRunner, ModelStep, TensorParallelRunner
from .sampling import SamplingParams, sample_rows, token_logprobs
from .scheduler import Scheduler
from .sizing import DEFAULT_MEMORY_FRACTION, cache_config_for_free_memory

logger = logging.getLogger(__name__)


class Engine:
    """Continuous batching: chunked prefill, prefix reuse, parallel sampling, preemption.

    Parameters
    ----------
    model : torch.nn.Module
        Called as ``model(token_ids, positions, cache, batch, logits_indices) -> logits``;
        ``model.config.vocab_size`` and ``max_position`` bound the requests; a sequence stops
        at any of ``model.eos_token_ids`` (if it has them) unless ``SamplingParams.ignore_eos``.
    cache_config : CacheConfig, optional
        Shape of the paged cache (must match the model's K/V). None: ``model.cache_config``
        with as many blocks as `memory_fraction` of the device's free memory holds.
    max_num_seqs : int
        Sequences running at once.
    max_num_batched_tokens : int
        Tokens per step (prefill chunks and decodes together).
    preemption : {"recompute", "swap"}
        What to do with a sequence when blocks run out ("swap" needs
        ``cache_config.num_host_blocks``).
    memory_fraction : float, optional
        Without `cache_config`: the share of free memory the pool takes, in (0, 1] (default
        0.9, as vLLM's ``gpu_memory_utilization``); see `paged_kv.serving.sizing`.
    tensor_parallel_size : int
        Split the model's heads and the KV pool over this many processes (torch.distributed:
        gloo on CPU); the engine starts the workers itself and stops them on `close` (see
        `paged_kv.serving.parallel`). The model must be a `TinyLlama` or an `HFCausalLM` loaded
        with ``from_pretrained``; `cache_config` is the whole model's.
    num_threads : int, optional
        torch intra-op threads while the engine runs a step (restored after each step).
        Default on the CPU: torch's count while the cores are free, fewer (at least one)
        while other processes use them, re-measured every half second, so a busy core
        cannot stall every step; see `paged_kv._threads`.

    Examples
    --------
    >>> from paged_kv.serving import TinyLlama, TinyLlamaConfig
    >>> model = TinyLlama(TinyLlamaConfig(num_layers=1, hidden_size=64, intermediate_size=64,
    ...                                   vocab_size=50, num_heads=4, head_dim=16))
    >>> engine = Engine(model, model.cache_config(num_blocks=32))
    >>> [out] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    >>> len(out.outputs[0].token_ids), out.outputs[0].finish_reason
    (4, 'length')
    """

    def __init__(self, model: torch.nn.Module, cache_config: CacheConfig | None = None, *,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 preemption: str = "recompute", memory_fraction: float | None = None,
                 num_threads: int | None = None, tensor_parallel_size: int = 1) -> None:
        if cache_config is not None and memory_fraction is not None:
            raise ValueError("memory_fraction: give it or cache_config, not both")
        if cache_config is None:
            cache_config = cache_config_for_free_memory(
                model, DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction)
        _check_limits(cache_config, preemption, max_num_seqs, max_num_batched_tokens)
        # CPU steps run on the cores other processes leave free (see paged_kv._threads)
        self._threads = (ThreadGovernor(num_threads) if cache_config.device.type == "cpu"
                         or num_threads is not None else None)
        self.eos_token_ids = frozenset(getattr(model, "eos_token_ids", ()))
        group = None
        if tensor_parallel_size != 1:
            model, cache_config, group = TensorParallelRunner.start(model, cache_config,
                                                                    tensor_parallel_size)
        try:
            self.cache = PagedKVCache(cache_config)
            self.runner = (ModelRunner(model, self.cache) if group is None
                           else TensorParallelRunner(model, self.cache, group))
            self.scheduler = Scheduler(self.cache, max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=max_num_batched_tokens,
                                       preemption=preemption)
            self.metrics = EngineMetrics(self.pool_bytes_per_rank())
        except BaseException:
            if group is not None:  # no half-built engine leaves the group initialised
                group.close()
            raise
        self.model = model
        self._next_id = 0
        self._requests: dict[int, Request] = {}  # unfinished, by id
        self._seed_source = torch.Generator().manual_seed(0)
        self._dead: str | None = None  # why the engine cannot step any more

    # -- requests ------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams | None = None,
                    *, salt: str | None = None,
                    on_output: Callable[[StepOutput], None] | None = None) -> int:
        """Queue a request; returns its id.

        Parameters
        ----------
        prompt_token_ids : sequence of int
        params : SamplingParams, optional
        salt : str, optional
            Prefix-cache salt: only requests with the same salt share cached blocks.
        on_output : callable, optional
            Called on the engine's thread with a `StepOutput` for every token of every
            sample as it is generated, and once more per sample when it finishes.

        Raises
        ------
        ValueError
            Naming the problem, for a request that can never run; the engine is unchanged.
        """
        params = params or SamplingParams()
        prompt = self._validate(prompt_token_ids, params)
        if salt is not None and not isinstance(salt, str):
            raise TypeError(f"salt: expected str or None, got {type(salt).__name__}")
        request = Request(self._next_id, prompt, params, time.perf_counter(), salt=salt,
                          on_output=on_output)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_source))
        first = Sequence(request, 0, list(prompt), _generator(params, seed, 0))
        request.samples.append(first)
        self.scheduler.add(first)
        self._requests[request.request_id] = request
        self._next_id += 1
        return request.request_id

    def check_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
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
        request.error = error
        for seq in request.samples:
            if seq.finish_reason is None:
                self.scheduler.abort(seq, "abort" if error is None else "error")
                self._emit(seq, [])
        request.finish_time = time.perf_counter()
        return True

    @property
    def num_waiting_requests(self) -> int:
        """Sequences waiting to be admitted (a request's samples count once until forked)."""
        return len(self.scheduler.waiting)

    def _validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids: empty prompt; give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: token ids must be ints in [0, {vocab}), "
                             f"got {bad[:5]}")
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"SamplingParams.n={params.n} exceeds max_num_seqs="
                             f"{self.scheduler.max_num_seqs}")
        total = len(prompt) + params.max_tokens
        if total > self.model.config.max_position:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) = "
                             f"{total} exceeds the model's max_position "
                             f"({self.model.config.max_position})")
        needed = self.cache.config.blocks_for(total - 1)
        if needed > self.cache.config.num_usable_blocks:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) needs "
                             f"{needed} blocks, more than the pool's "
                             f"{self.cache.config.num_usable_blocks}; raise num_blocks")
        return prompt

    def generate(self, prompts: Seq[Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
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
        ids = [self.add_request(p, q) for p, q in zip(prompts, params_list, strict=True)]
        finished: dict[int, RequestOutput] = {}
        while any(i not in finished for i in ids):
            finished.update((out.request_id, out) for out in self.step())
        return [finished[i] for i in ids]

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
        if not plan:
            return []
        batch = self.cache.prepare(self.scheduler.step_tokens(plan))
        try:
            step = self.runner.run(plan, batch)
        except Exception as exc:
            self._fail_step(plan, exc)
            return []
        self.scheduler.advance(plan)  # only once the model has written their K/V
        samples = self._sample(step)
        for sample in samples:  # each sample's output streams as soon as it is updated
            self.scheduler.update_from_output([sample], self.eos_token_ids)
            self._emit(sample[0], [sample[1]])
        self.metrics.observe(self.stats(), len(samples))
        return [self._finish_request(seq.request) for seq in step.sampled
                if seq.request.is_finished and seq.request.finish_time is None]

    def _sample(self, step: ModelStep) -> list[tuple[Sequence, int, dict[int, float] | None]]:
        """Every sample's next token in one batched call (a forked request's samples share
        their row), with its log-probabilities when asked for."""
        targets = [(row, target) for row, seq in enumerate(step.sampled)
                   for target in self._fork_samples(seq)]
        if not targets:
            return []
        rows = [row for row, _ in targets]
        picked = sample_rows(step.logits[rows], [t.request.params for _, t in targets],
                             [t.generator for _, t in targets])
        return [(seq, token, None if seq.request.params.logprobs is None else
                 token_logprobs(step.logits[row], token, seq.request.params.logprobs))
                for (row, seq), token in zip(targets, picked, strict=True)]

    def _fail_step(self, plan: dict[Sequence, int], exc: Exception) -> None:
        """A failed model call fails the requests of its step, not the others; with tensor
        parallelism the ranks are out of step, so the engine is dead."""
        if self.runner.tensor_parallel_size > 1:
            self._dead = f"a tensor-parallel step failed ({exc}); restart the engine"
            if isinstance(exc, EngineDeadError):
                raise exc
            raise EngineDeadError(self._dead) from exc
        message = f"the model failed on this step: {exc!r}"
        logger.exception("model step failed; failing its %d requests", len(plan))
        for request_id in {seq.request.request_id for seq in plan}:
            self.abort(request_id, error=message)

    def _fork_samples(self, seq: Sequence) -> list[Sequence]:
        """`seq`, plus its request's other samples when its prompt was just computed."""
        request = seq.request
        if seq.index or request.params.n == 1 or len(request.samples) == request.params.n:
            return [seq]
        seed = request.samples[0].generator.initial_seed() if request.samples[0].generator \
            else 0
        children = [Sequence(request, i, list(seq.token_ids), _generator(request.params,
                                                                         seed, i))
                    for i in range(1, request.params.n)]
        request.samples += children
        self.scheduler.add_children(seq, children)
        return [seq, *children]

    def _emit(self, seq: Sequence, new_token_ids: list[int]) -> None:
        """Tell the request's listener about `seq`'s step; the request's last step output
        (all samples finished, or aborted) carries the whole `RequestOutput`."""
        request = seq.request
        if request.on_output is None:
            return
        done = all(s.finish_reason for s in request.samples) and (
            len(request.samples) == request.params.n or seq.finish_reason in ("abort", "error"))
        request.on_output(StepOutput(request.request_id, seq.index, new_token_ids,
                                     seq.finish_reason,
                                     self._request_output(request) if done else None))

    def _finish_request(self, request: Request) -> RequestOutput:
        self._requests.pop(request.request_id, None)
        request.finish_time = time.perf_counter()
        return self._request_output(request)

    def _request_output(self, request: Request) -> RequestOutput:
        end = request.finish_time or time.perf_counter()
        first = request.first_token_time or end
        latencies = [b - a for s in request.samples
                     for a, b in zip(s.token_times, s.token_times[1:], strict=False)]
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[_completion(s) for s in request.samples],
            finished=True,
            prefix_hit_tokens=request.prefix_hit_tokens or 0,
            num_preemptions=sum(s.num_preemptions for s in request.samples),
            time_to_first_token=first - request.arrival_time,
            token_latencies=latencies,
            prompt_logprobs=(list(request.prompt_logprobs)
                             if request.params.prompt_logprobs is not None else None),
            error=request.error,
        )

    # -- lifetime and observation -------------------------------------------------------
    @property
    def tensor_parallel_size(self) -> int:
        """Ranks the model and the KV pool are split over (1: this process alone)."""
        return self.runner.tensor_parallel_size

    def pool_bytes_per_rank(self) -> list[int]:
        """KV pool bytes of every rank (each holds its share of the KV heads)."""
        return self.runner.pool_bytes_per_rank()

    def check(self) -> None:
        """`PagedKVCache.check`, and with tensor parallelism that every rank's pool has the
        same blocks."""
        self.runner.check()

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any); the engine cannot step afterwards
        (`step` raises `EngineDeadError`)."""
        self._dead = self._dead or "the engine was closed"
        self.runner.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stats(self) -> EngineStats:
        """A read-only snapshot of the queues and the cache's counters (no per-sequence
        work: cheap enough for every step)."""
        scheduler, allocator = self.scheduler, self.cache.allocator
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_swapped=len(scheduler.swapped), num_preemptions=scheduler.num_preemptions,
            num_live_blocks=allocator.num_live_blocks,
            num_cached_blocks=allocator.num_cached_blocks,
            num_free_blocks=allocator.num_free_blocks,
            prefix_query_tokens=allocator.prefix_query_tokens,
            prefix_hit_tokens=allocator.prefix_hit_tokens)

    def metrics_text(self) -> str:
        """The engine's metrics in Prometheus exposition format, gauges as of now."""
        self.metrics.observe(self.stats(), 0)
        return self.metrics.text(self.cache)


def _check_limits(cache_config: CacheConfig, preemption: str, max_num_seqs: int,
                  max_num_batched_tokens: int) -> None:
    """ValueError naming the argument, before anything is built."""
    if preemption not in ("recompute", "swap"):
        raise ValueError(f"preemption: expected 'recompute' or 'swap', got {preemption!r}")
    if preemption == "swap" and not cache_config.num_host_blocks:
        raise ValueError("preemption='swap' needs cache_config.num_host_blocks > 0")
    for name, value in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
        if value < 1:
            raise ValueError(f"{name}: expected >= 1, got {value}")


def _completion(seq: Sequence) -> CompletionOutput:
    wanted = seq.request.params.logprobs is not None
    return CompletionOutput(seq.index, seq.output_token_ids, seq.finish_reason,
                            seq.num_preemptions, list(seq.logprobs) if wanted else None,
                            seq.cumulative_logprob if wanted else None)


def _generator(params: SamplingParams, seed: int, index: int) -> torch.Generator | None:
    """Sample `index`'s own generator: ``seed + index``, so it equals that seed run alone."""
    if params.temperature == 0:
        return None
    return torch.Generator().manual_seed(seed + index)
