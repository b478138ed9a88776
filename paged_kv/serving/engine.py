"""`Engine`: continuous batching over a `PagedKVCache` and a model, with vLLM-shaped outputs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from ..cache import PagedKVCache
from ..config import CacheConfig
from .metrics import EngineMetrics
from .sampling import SamplingParams, sample
from .scheduler import Request, Scheduler, Sequence


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One sample of a request: vLLM's ``CompletionOutput`` fields that apply here."""

    index: int
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    num_preemptions: int


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A finished request: its `n` samples and what serving it cost.

    ``time_to_first_token`` and ``token_latencies`` (gaps between a sample's consecutive
    tokens) are in seconds.
    """

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prefix_hit_tokens: int
    num_preemptions: int
    time_to_first_token: float
    token_latencies: list[float]


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one step gave one sample of a request, for streaming.

    ``new_token_ids`` is the token this step appended (empty when the sample only finished,
    e.g. aborted); ``finish_reason`` is set once the sample is done ("stop", "length",
    "abort"); ``output`` is the whole `RequestOutput` on the request's last step output,
    with ``prefix_hit_tokens`` (the cached prompt tokens) for usage.
    """

    request_id: int
    index: int
    new_token_ids: list[int]
    finish_reason: str | None
    output: RequestOutput | None = None


class Engine:
    """Continuous batching: chunked prefill, prefix reuse, parallel sampling, preemption.

    Parameters
    ----------
    model : torch.nn.Module
        Called as ``model(token_ids, positions, cache, batch, logits_indices) -> logits``;
        ``model.config.vocab_size`` and ``max_position`` bound the requests.
    cache_config : CacheConfig
        Shape of the paged cache (must match the model's K/V).
    max_num_seqs : int
        Sequences running at once.
    max_num_batched_tokens : int
        Tokens per step (prefill chunks and decodes together).
    preemption : {"recompute", "swap"}
        What to do with a sequence when blocks run out ("swap" needs
        ``cache_config.num_host_blocks``).

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

    def __init__(self, model: torch.nn.Module, cache_config: CacheConfig, *,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 preemption: str = "recompute") -> None:
        if preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption: expected 'recompute' or 'swap', got {preemption!r}")
        if preemption == "swap" and not cache_config.num_host_blocks:
            raise ValueError("preemption='swap' needs cache_config.num_host_blocks > 0")
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if value < 1:
                raise ValueError(f"{name}: expected >= 1, got {value}")
        self.model = model
        self.cache = PagedKVCache(cache_config)
        self.scheduler = Scheduler(self.cache, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   preemption=preemption)
        self.metrics = EngineMetrics()
        self._next_id = 0
        self._requests: dict[int, Request] = {}  # unfinished, by id
        self._seed_source = torch.Generator().manual_seed(0)

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
        self.scheduler.waiting.append(first)
        self._requests[request.request_id] = request
        self._next_id += 1
        return request.request_id

    def check_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise what `add_request` would for this request, changing nothing (it reads only
        fixed configuration, so any thread may call it)."""
        self._validate(prompt_token_ids, params)

    def abort(self, request_id: int) -> bool:
        """Stop a request now: its samples finish with reason "abort" and their blocks are
        freed before the next step. Returns False when the request is unknown or done."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.samples:
            if seq.finish_reason is None:
                self.scheduler.abort(seq)
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
        plan = self.scheduler.schedule()
        if not plan:
            return []
        batch = self.cache.prepare({seq.seq_id: seq.token_ids[seq.num_computed:
                                                              seq.num_computed + n]
                                    for seq, n in plan.items()})
        tokens, positions, logits_rows, sampled = [], [], [], []
        for seq, n in plan.items():
            tokens += seq.token_ids[seq.num_computed: seq.num_computed + n]
            positions += range(seq.num_computed, seq.num_computed + n)
            if seq.num_computed + n == len(seq.token_ids):  # caught up: its next token is due
                logits_rows.append(len(tokens) - 1)
                sampled.append(seq)
        try:
            logits = self.model(torch.tensor(tokens), torch.tensor(positions), self.cache,
                                batch, torch.tensor(logits_rows, dtype=torch.long))
        except BaseException:
            for seq in plan:  # give back the slots of K/V that was never written
                self.cache.truncate(seq.seq_id, seq.num_computed)
            raise
        for seq, n in plan.items():  # only once the model has written their K/V
            seq.num_computed += n
        finished, num_generated = [], 0
        for row, seq in enumerate(sampled):
            for target in self._fork_samples(seq):
                self._append_token(target, sample(logits[row], target.request.params,
                                                  target.generator))
                self._emit(target, target.token_ids[-1:])
                num_generated += 1
            if seq.request.is_finished and seq.request.finish_time is None:
                finished.append(self._finish_request(seq.request))
        self.metrics.observe(self.cache, self.scheduler, num_generated)
        return finished

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

    def _append_token(self, seq: Sequence, token: int) -> None:
        now = time.perf_counter()
        seq.token_ids.append(token)
        seq.token_times.append(now)
        if seq.request.first_token_time is None:
            seq.request.first_token_time = now
        params = seq.request.params
        if token in params.stop_token_ids:
            self.scheduler.finish(seq, "stop")
        elif len(seq.output_token_ids) >= params.max_tokens:
            self.scheduler.finish(seq, "length")

    def _emit(self, seq: Sequence, new_token_ids: list[int]) -> None:
        """Tell the request's listener about `seq`'s step; the request's last step output
        (all samples finished, or aborted) carries the whole `RequestOutput`."""
        request = seq.request
        if request.on_output is None:
            return
        done = all(s.finish_reason for s in request.samples) and (
            len(request.samples) == request.params.n or seq.finish_reason == "abort")
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
            outputs=[CompletionOutput(s.index, s.output_token_ids, s.finish_reason,
                                      s.num_preemptions) for s in request.samples],
            finished=True,
            prefix_hit_tokens=request.prefix_hit_tokens or 0,
            num_preemptions=sum(s.num_preemptions for s in request.samples),
            time_to_first_token=first - request.arrival_time,
            token_latencies=latencies,
        )

    def metrics_text(self) -> str:
        """The engine's metrics in Prometheus exposition format."""
        return self.metrics.text(self.cache)


def _generator(params: SamplingParams, seed: int, index: int) -> torch.Generator | None:
    """Sample `index`'s own generator: ``seed + index``, so it equals that seed run alone."""
    if params.temperature == 0:
        return None
    return torch.Generator().manual_seed(seed + index)
