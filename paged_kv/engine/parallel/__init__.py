"""Tensor parallelism: one scheduler on rank 0, the step plan broadcast to every rank.

- `sharding`: a model's picklable recipe (`ModelSpec`), whether it splits over N ranks, and
  each rank's share of the weights (Megatron's layout).
- `plan`: the step plan on the wire, packed by rank 0 and replayed by every rank on its pool.
- `group`: the process group's lifetime (`TensorParallelGroup`: start, broadcast, stop,
  watch) and a worker rank's loop (`worker_main`).
- `worker`: ``python -m paged_kv.engine.parallel.worker``, the entry point of a spawned rank.

`serving.runner.TensorParallelRunner` is the engine's side: the same interface as
`ModelRunner`, with the plan broadcast first.
"""

from .group import (
    TensorParallelError,
    TensorParallelGroup,
    local_cache_config,
    torchrun_worker,
    worker_main,
)
from .plan import apply_ops
from .sharding import Collectives, ModelSpec, check_splittable, kv_heads_of_rank, shard_model

__all__ = ["Collectives", "ModelSpec", "TensorParallelError",
           "TensorParallelGroup", "apply_ops", "check_splittable", "kv_heads_of_rank",
           "local_cache_config", "shard_model", "torchrun_worker", "worker_main"]
