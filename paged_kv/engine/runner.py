"""`ModelRunner`: one step of the model over the scheduled tokens, and its tensor-parallel
twin; the engine calls either the same way and cannot tell which it has."""

from __future__ import annotations

import dataclasses

import torch

from ..config import CacheConfig
from ..core.batch import StepBatch
from ..core.cache import PagedKVCache
from ..errors import InvariantError
from .errors import EngineDeadError
from .inputs import StepInputs
from .parallel import (
    Collectives,
    ModelSpec,
    TensorParallelGroup,
    check_splittable,
    local_cache_config,
    shard_model,
)
from .request import Request, Sequence
from .sampling import token_logprobs


@dataclasses.dataclass(frozen=True)
class ModelStep:
    """What one model call gave: ``logits [len(sampled), vocab]`` of the sequences whose next
    token is due (in `sampled` order), and the prompt log-probabilities it computed
    (``(request, dict)`` in prompt order; the scheduler records them)."""

    logits: torch.Tensor
    sampled: list[Sequence]
    prompt_logprobs: list[tuple[Request, dict[int, float]]] = dataclasses.field(
        default_factory=list)

    @staticmethod
    def join(steps: list[ModelStep]) -> ModelStep:
        """The steps as one (a failed step's requests rerun one by one come back apart)."""
        if len(steps) == 1:
            return steps[0]
        if not steps:
            return ModelStep(torch.empty(0, 0), [])
        return ModelStep(torch.cat([s.logits for s in steps]),
                         [seq for s in steps for seq in s.sampled],
                         [pair for s in steps for pair in s.prompt_logprobs])


class ModelRunner:
    """Runs the model on a step's tokens; rolls the step's slots back when the model fails.

    Parameters
    ----------
    model : torch.nn.Module
        Called as ``model(token_ids, positions, cache, batch, logits_indices) -> logits``.
    cache : PagedKVCache
    """

    tensor_parallel_size = 1
    collectives: Collectives | None = None  # the timed collectives, under tensor parallelism

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache) -> None:
        self.model, self.cache = model, cache

    def run(self, plan: dict[Sequence, int], batch: StepBatch,
            inputs: StepInputs | None = None) -> ModelStep:
        """The model over `plan`'s tokens (`inputs`: made from `plan` when not given); on an
        error the step's slots are given back and the error re-raised. Changes no request
        (the scheduler records what it gave)."""
        inputs = StepInputs.of(plan) if inputs is None else inputs
        try:
            logits = self._call(inputs.tokens, inputs.positions, batch, inputs.logits_rows)
        except Exception:
            for seq in plan:  # give back the slots of K/V that was never written
                self.cache.truncate(seq.seq_id, seq.num_computed, unwritten=True)
            raise
        sampled, prompt_rows = inputs.sampled, inputs.prompt_rows
        prompt_logprobs = [(request, token_logprobs(row, target, request.params.prompt_logprobs))
                           for (request, _, target), row
                           in zip(prompt_rows, logits[len(sampled):], strict=True)
                           ] if prompt_rows else []  # iterating a tensor costs, even empty
        return ModelStep(logits[:len(sampled)], sampled, prompt_logprobs)

    def _call(self, tokens: torch.Tensor, positions: torch.Tensor, batch: StepBatch,
              logits_indices: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, positions, self.cache, batch, logits_indices)

    def pool_bytes_per_rank(self) -> list[int]:
        """KV pool bytes of every rank."""
        return [self.cache.pool.nbytes]

    def check(self) -> None:
        """`PagedKVCache.check` (and, with tensor parallelism, that the ranks agree)."""
        self.cache.check()

    def close(self) -> None:
        """Release what the runner holds (nothing here)."""


class TensorParallelRunner(ModelRunner):
    """The model split over `world_size` processes: rank 0 (this one) decides, and every
    step's plan (with the pool operations since the last one) goes to every rank first.

    Build it with `TensorParallelRunner.start`, which validates the split before any
    process starts and shards a model of its own (the caller's stays whole).
    """

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache,
                 group: TensorParallelGroup) -> None:
        super().__init__(model, cache)
        self.group = group
        self.tensor_parallel_size = group.world_size
        self.collectives = group.collectives  # the bench reads its seconds (comm_seconds)
        cache.pool.record_ops()

    @staticmethod
    def start(model: torch.nn.Module, cache_config: CacheConfig, world_size: int,
              ) -> tuple[torch.nn.Module, CacheConfig, TensorParallelGroup]:
        """Rank 0's shard of `model`, its share of `cache_config`, and the started group."""
        spec = ModelSpec.of(model)
        check_splittable(*spec.shape(), world_size)
        shard, collectives = spec.build(), Collectives()
        kv_heads = shard_model(shard, 0, world_size, collectives)
        group = TensorParallelGroup(spec, cache_config, world_size, collectives=collectives)
        return shard, local_cache_config(cache_config, kv_heads), group

    def run(self, plan: dict[Sequence, int], batch: StepBatch,
            inputs: StepInputs | None = None) -> ModelStep:
        """As `ModelRunner.run`; but any error leaves the ranks out of step (the workers
        ran, or will run, a step rank 0 gave back), so it is an `EngineDeadError`."""
        try:
            return super().run(plan, batch, inputs)
        except EngineDeadError:
            raise
        except Exception as exc:
            self.group.fail(f"a tensor-parallel step failed ({exc!r})")
            raise EngineDeadError(self.group.failed) from exc

    def _call(self, tokens: torch.Tensor, positions: torch.Tensor, batch: StepBatch,
              logits_indices: torch.Tensor) -> torch.Tensor:
        self.group.broadcast_step(tokens, positions, logits_indices, batch,
                                  self.cache.pool.take_ops())
        return super()._call(tokens, positions, batch, logits_indices)

    def pool_bytes_per_rank(self) -> list[int]:
        return [nbytes for _, nbytes in self._gather_info()]

    def check(self) -> None:
        """Also that every rank's pool has the same blocks (rank 0's ids, by construction)."""
        super().check()
        counts = {num_blocks for num_blocks, _ in self._gather_info()}
        if counts != {self.cache.config.num_blocks}:
            raise InvariantError(f"ranks hold different block counts: {sorted(counts)}")

    def _gather_info(self) -> list[tuple[int, int]]:
        return self.group.gather_info((self.cache.config.num_blocks, self.cache.pool.nbytes))

    def close(self) -> None:
        """Stop the workers."""
        self.group.close()
