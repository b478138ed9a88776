"""Tensor parallelism over torch.distributed: one scheduler, the step plan broadcast.

Rank 0 is the engine's own process: it owns the `Scheduler`, the `BlockAllocator` and the
`PageTables` (ints only) and runs its share of the model. Ranks 1..N-1 are worker processes
the engine spawns (or that ``torchrun`` starts, see `worker_main`). Every step rank 0
broadcasts the plan (`plan`); every rank replays the step's pool operations on its own
`KVPool`, which holds its share of the KV heads for the same block ids, and runs its model
shard (`sharding`); the shards meet in one all-reduce after each row-parallel projection.
This module is the process group's lifetime: start, broadcast, stop, watch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ...config import CacheConfig
from ...core.batch import StepBatch
from ...core.cache import PagedKVCache
from ..errors import EngineDeadError
from .plan import CMD_INFO, CMD_POOL, CMD_STOP, HEADER, apply_ops, pack_step, unpack_step
from .sharding import Collectives, ModelSpec, shard_model

__all__ = ["TensorParallelError", "TensorParallelGroup", "local_cache_config", "torchrun_worker",
           "worker_main"]


class TensorParallelError(EngineDeadError):
    """A tensor-parallel worker died, raised or timed out; the engine cannot step on."""


def local_cache_config(config: CacheConfig, num_kv_heads: int) -> CacheConfig:
    """`config` with this rank's share of the KV heads (same block ids and counts)."""
    return dataclasses.replace(config, num_kv_heads=num_kv_heads)


def worker_main(rank: int, world_size: int, init_method: str, timeout_s: float = 60.0,
                threads: int = 1) -> None:
    """A worker rank: join the group, receive the model recipe and cache config from rank 0,
    build and shard the model, then follow rank 0's plans until told to stop. Spawned
    workers and ``torchrun`` workers (``init_method="env://"``) run this same function."""
    torch.set_num_threads(threads)
    # Ctrl-C in the terminal is rank 0's to handle (it drains, then stops the workers)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent()
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        received: list = [None]
        dist.broadcast_object_list(received, 0)
        spec, cache_config = received[0]
        model = spec.build()
        kv_heads = shard_model(model, rank, world_size, Collectives())
        cache = PagedKVCache(local_cache_config(cache_config, kv_heads))
        header = torch.empty(HEADER, dtype=torch.int64)
        while True:
            dist.broadcast(header, 0)
            command = int(header[0])
            if command == CMD_STOP:
                break
            if command == CMD_INFO:
                dist.all_gather_object([None] * world_size,
                                       (cache.config.num_blocks, cache.pool.nbytes))
                continue
            if command == CMD_POOL:
                dist.gather(cache.pool.kv, None, dst=0)
                continue
            payload = torch.empty(int(header[1]), dtype=torch.int64)
            dist.broadcast(payload, 0)
            tokens, positions, logits, batch, ops = unpack_step(
                header, payload, cache.config.block_size, cache.config.device)
            apply_ops(cache, ops)
            model(tokens, positions, cache, batch, logits)
    finally:
        dist.destroy_process_group()


def watch_parent(interval_s: float = 0.5) -> threading.Thread:
    """Exit this process when the one that started it dies (it is then re-parented): a
    worker blocked in a collective would otherwise outlive a SIGKILLed rank 0."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(3)

    thread = threading.Thread(target=watch, name="paged-kv-parent-watch", daemon=True)
    thread.start()
    return thread


def _send_command(command: int) -> None:
    """Broadcast a header that carries a command and no step plan."""
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[0] = command
    dist.broadcast(header, 0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TensorParallelGroup:
    """Rank 0's side: spawns ranks 1..N-1 on loopback, broadcasts each step's plan, stops
    them on `close` (also at garbage collection and interpreter exit)."""

    def __init__(self, spec: ModelSpec, cache_config: CacheConfig, world_size: int, *,
                 timeout_s: float = 60.0, collectives: Collectives | None = None) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        # rank 0's model shard reduces through the same object: one place for the timings
        self.collectives = collectives if collectives is not None else Collectives()
        self.processes: list = []
        under_torchrun = "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ
        if under_torchrun:  # the other ranks were started by torchrun: env:// rendezvous
            if int(os.environ["WORLD_SIZE"]) != world_size:
                raise ValueError(f"tensor_parallel_size={world_size} but torchrun started "
                                 f"WORLD_SIZE={os.environ['WORLD_SIZE']} processes")
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            # fresh interpreters running this module: no re-import of the caller's main
            # module (multiprocessing's spawn would need an ``if __name__`` guard there)
            # a session of their own: the terminal's Ctrl-C reaches rank 0 only
            self.processes = [subprocess.Popen(
                [sys.executable, "-m", "paged_kv.engine.parallel.worker", str(rank),
                 str(world_size), init_method, str(timeout_s)], start_new_session=True)
                for rank in range(1, world_size)]
        self._finalizer = weakref.finalize(self, _stop_processes, self.processes)
        self.closed = False
        self.failed: str | None = None
        try:
            dist.init_process_group("gloo", init_method=init_method, rank=0,
                                    world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            dist.broadcast_object_list([(spec, cache_config)], 0)
        except BaseException as exc:  # Ctrl-C while waiting too: never leave the group set
            self.fail(f"tensor-parallel workers did not join within {timeout_s:.0f} s: {exc}")
            self.close()
            _forget_failed_rendezvous()
            if not isinstance(exc, Exception):
                raise
            raise TensorParallelError(self.failed) from exc

    def fail(self, reason: str) -> None:
        """Mark the group broken (the ranks are out of step): no collective is tried again,
        and `close` stops the workers by force instead of asking them."""
        self.failed = self.failed or reason

    def check_alive(self) -> None:
        """Raise `TensorParallelError` if a worker is gone (before a collective would hang)."""
        if self.failed:
            raise TensorParallelError(self.failed)
        for rank, process in enumerate(self.processes, 1):
            if process.poll() is not None:
                self.failed = (f"tensor-parallel worker rank {rank} exited (code "
                               f"{process.returncode}); close() this engine and start a new one")
                raise TensorParallelError(self.failed)

    def broadcast_step(self, token_ids: torch.Tensor, positions: torch.Tensor,
                       logits_indices: torch.Tensor, batch: StepBatch,
                       ops: Sequence[tuple[int, np.ndarray, np.ndarray]]) -> None:
        """Send one step's plan to every worker."""
        self.check_alive()
        header, payload = pack_step(token_ids, positions, logits_indices, batch, ops)
        start = time.perf_counter()
        self._collective(lambda: (dist.broadcast(header, 0), dist.broadcast(payload, 0)))
        self.collectives.broadcast_s += time.perf_counter() - start

    def _collective(self, call):
        try:
            return call()
        except Exception as exc:
            self.fail(f"tensor-parallel collective failed: {exc}")
            raise TensorParallelError(self.failed) from exc

    def gather_info(self, mine: tuple[int, int]) -> list[tuple[int, int]]:
        self.check_alive()
        out: list = [None] * self.world_size
        self._collective(lambda: (_send_command(CMD_INFO),
                                  dist.all_gather_object(out, mine)))
        return out

    def gather_pools(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's K/V pool (for tests and debugging: copies the whole pools)."""
        self.check_alive()
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._collective(lambda: (_send_command(CMD_POOL),
                                  dist.gather(mine, out, dst=0)))
        return out

    def close(self) -> None:
        """Stop the workers (politely, then by force) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        if self.failed:  # a worker may sit in a collective rank 0 never joins: no waiting
            for process in self.processes:
                process.kill()
        else:
            with contextlib.suppress(Exception):
                _send_command(CMD_STOP)
        self._finalizer()
        if dist.is_initialized():
            dist.destroy_process_group()


def _forget_failed_rendezvous() -> None:
    """Undo what a failed ``init_process_group`` leaves behind. It numbers the default group
    before the rendezvous and keeps the number when the rendezvous fails, so the next
    attempt's store keys (``default_pg/1/...``) never meet a fresh worker's
    (``default_pg/0/...``) and every retry times out. torch resets the counter only in
    ``destroy_process_group``, which needs a group that was made; so reset it here (torch's
    private state: there is no public way), unless some group is live."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if not dist.is_initialized() and hasattr(world, "group_count"):
        world.group_count = 0


def _stop_processes(processes: list) -> None:
    for process in processes:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def torchrun_worker() -> None:
    """Ranks >= 1 under ``torchrun``: rank 0 is the process that builds the `Engine`
    (``paged-kv demo`` / ``serve --tensor-parallel-size N``); the others call this, which
    the CLI does by itself when ``RANK`` > 0."""
    worker_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")

