"""Tensor parallelism over torch.distributed: one scheduler, the step plan broadcast.

Rank 0 is the engine's own process: it owns the `Scheduler`, the `BlockAllocator` and the
`PageTables` (ints only) and runs its share of the model. Ranks 1..N-1 are worker processes
the engine spawns (or that ``torchrun`` starts, see `worker_main`). Every step rank 0 packs
the plan — token ids, positions, logits rows, slot mapping, block tables, sequence lengths,
query starts, and the pool operations of the step (copy-on-write copies, swap-outs/ins) —
into one int64 tensor and broadcasts it (a fixed 8-entry header first, then the payload).
Every rank applies the pool operations to its own `KVPool`, which holds its share of the KV
heads for the same block ids, and runs its model shard; the shards meet in one all-reduce
after each row-parallel projection.

Sharding (Megatron's layout, as vLLM and SGLang use it): q/k/v and gate/up are split by
output rows (heads), o_proj and down by input columns, each followed by an all-reduce of
its partial sums. Embeddings and lm_head are replicated: at these sizes a vocab-parallel
head would add an all-gather per step to save a few MB, and only rank 0 samples. When
there are fewer KV heads than ranks, each KV head is replicated on ``N / num_kv_heads``
ranks (vLLM does the same).
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

from ..cache import PagedKVCache
from ..config import CacheConfig
from ..page_table import StepBatch
from ..pool import OP_COPY, OP_SWAP_OUT
from .errors import EngineDeadError
from .model import TinyLlama, TinyLlamaConfig

HEADER = 8  # cmd, payload length, tokens, batch size, block-table width, logits rows, ops
CMD_STEP, CMD_STOP, CMD_INFO, CMD_POOL = 1, 2, 3, 4


class TensorParallelError(EngineDeadError):
    """A tensor-parallel worker died, raised or timed out; the engine cannot step on."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A picklable recipe for a model: workers build their own copy and shard it, so no
    weights cross process boundaries."""

    kind: str  # "tinyllama" | "hf"
    tiny_config: TinyLlamaConfig | None = None
    seed: int = 0
    path: str | None = None
    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelSpec:
        """The spec of the embedded `TinyLlama` or of an `HFCausalLM` loaded from a path."""
        if isinstance(model, TinyLlama):
            return cls("tinyllama", tiny_config=model.config, seed=model.seed)
        if hasattr(model, "path") and hasattr(model, "model"):  # HFCausalLM
            if model.path is None:
                raise ValueError("tensor_parallel_size > 1 needs an HFCausalLM loaded with "
                                 "HFCausalLM.from_pretrained(path): workers load the same files")
            return cls("hf", path=model.path, dtype=model.model.dtype)
        raise TypeError(f"tensor parallelism supports TinyLlama and HFCausalLM, got "
                        f"{type(model).__name__}")

    def shape(self) -> tuple[int, int, int]:
        """``(num_heads, num_kv_heads, intermediate_size)`` of the full model."""
        if self.kind == "tinyllama":
            c = self.tiny_config
            return c.num_heads, c.num_kv_heads, c.intermediate_size
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(self.path, local_files_only=True)
        return (c.num_attention_heads, getattr(c, "num_key_value_heads", None)
                or c.num_attention_heads, c.intermediate_size)

    def build(self) -> torch.nn.Module:
        """The full model, built afresh from the recipe."""
        if self.kind == "tinyllama":
            return TinyLlama(self.tiny_config, seed=self.seed)
        from .hf import HFCausalLM

        return HFCausalLM.from_pretrained(self.path, dtype=self.dtype)


def check_splittable(num_heads: int, num_kv_heads: int, intermediate_size: int,
                     world_size: int) -> None:
    """ValueError, naming the numbers, unless the model splits over `world_size` ranks."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size: expected an int >= 1, got {world_size!r}")
    problems = []
    if num_heads % world_size:
        problems.append(f"num_heads={num_heads} is not a multiple of it")
    if num_kv_heads % world_size and world_size % num_kv_heads:
        problems.append(f"num_kv_heads={num_kv_heads} neither divides it nor is a multiple")
    if intermediate_size % world_size:
        problems.append(f"intermediate_size={intermediate_size} is not a multiple of it")
    if problems:
        raise ValueError(f"tensor_parallel_size={world_size} cannot split this model: "
                         + "; ".join(problems))


def kv_heads_of_rank(num_kv_heads: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(first kv head, count)`` rank `rank` holds; replicated when there are fewer heads
    than ranks."""
    if num_kv_heads >= world_size:
        count = num_kv_heads // world_size
        return rank * count, count
    return rank // (world_size // num_kv_heads), 1


# seconds this process spent in collectives (all-reduce, plan broadcast): the bench's
# model / communication / bookkeeping split reads it
COMM_SECONDS = {"all_reduce": 0.0, "broadcast": 0.0}


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    start = time.perf_counter()
    dist.all_reduce(tensor)
    COMM_SECONDS["all_reduce"] += time.perf_counter() - start
    return tensor


def shard_model(model: torch.nn.Module, rank: int, world_size: int) -> int:
    """Keep `rank`'s share of `model`'s weights (in place) and make its row-parallel
    projections all-reduce; returns the rank's number of KV heads."""
    if isinstance(model, TinyLlama):
        return _shard_tinyllama(model, rank, world_size)
    return _shard_hf(model, rank, world_size)


def _rows(weight: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return weight[start:start + count].clone()


def _shard_tinyllama(model: TinyLlama, rank: int, world: int) -> int:
    c = model.config
    d, heads, inter = c.head_dim, c.num_heads // world, c.intermediate_size // world
    kv_first, kv_heads = kv_heads_of_rank(c.num_kv_heads, world, rank)
    q_dim, kv_dim = c.num_heads * d, c.num_kv_heads * d
    for layer in model.layers:
        q, k, v = layer.qkv.data.split([q_dim, kv_dim, kv_dim])
        layer.qkv = _param(torch.cat([_rows(q, rank * heads * d, heads * d),
                                      _rows(k, kv_first * d, kv_heads * d),
                                      _rows(v, kv_first * d, kv_heads * d)]))
        layer.out = _param(layer.out.data[:, rank * heads * d:(rank + 1) * heads * d].clone())
        gate, up = layer.gate_up.data.chunk(2)
        layer.gate_up = _param(torch.cat([_rows(gate, rank * inter, inter),
                                          _rows(up, rank * inter, inter)]))
        layer.down = _param(layer.down.data[:, rank * inter:(rank + 1) * inter].clone())
    model.config = dataclasses.replace(c, num_heads=heads, num_kv_heads=kv_heads,
                                       intermediate_size=inter)
    model.reduce = _all_reduce
    return kv_heads


def _param(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.contiguous(), requires_grad=False)


def _shard_hf(model: torch.nn.Module, rank: int, world: int) -> int:
    """Llama-family layout: ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``."""
    hf = model.model.config
    heads, kv_total = hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) \
        or hf.num_attention_heads
    d = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    local_heads, inter = heads // world, hf.intermediate_size // world
    kv_first, kv_heads = kv_heads_of_rank(kv_total, world, rank)

    def column(linear: torch.nn.Linear, start: int, count: int) -> None:  # output rows
        linear.weight = _param(_rows(linear.weight.data, start, count))
        if linear.bias is not None:
            linear.bias = _param(_rows(linear.bias.data, start, count))
        linear.out_features = count

    def row(linear: torch.nn.Linear, start: int, count: int) -> None:  # input columns
        linear.weight = _param(linear.weight.data[:, start:start + count].clone())
        if linear.bias is not None and rank:  # the bias is added once, by rank 0
            linear.bias = _param(torch.zeros_like(linear.bias))
        linear.in_features = count
        linear.register_forward_hook(lambda _module, _inputs, output: _all_reduce(output))

    for layer in model.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        column(attn.q_proj, rank * local_heads * d, local_heads * d)
        column(attn.k_proj, kv_first * d, kv_heads * d)
        column(attn.v_proj, kv_first * d, kv_heads * d)
        row(attn.o_proj, rank * local_heads * d, local_heads * d)
        if hasattr(attn, "num_key_value_groups"):
            attn.num_key_value_groups = local_heads // kv_heads
        column(mlp.gate_proj, rank * inter, inter)
        column(mlp.up_proj, rank * inter, inter)
        row(mlp.down_proj, rank * inter, inter)
    num_layers, _, head_dim = model._kv_shape
    model._kv_shape = (num_layers, kv_heads, head_dim)
    return kv_heads


# -- the plan ----------------------------------------------------------------------------
def pack_step(token_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
              batch: StepBatch, ops: Sequence[tuple[int, np.ndarray, np.ndarray]],
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header [8], payload)`` int64 tensors of one step."""
    block_tables, num_blocks, _ = batch._host
    op_parts = []
    for kind, src, dst in ops:
        op_parts += [np.array([kind, src.size], dtype=np.int64), src.astype(np.int64),
                     dst.astype(np.int64)]
    parts = [token_ids.numpy(), positions.numpy(), logits_indices.numpy(),
             batch.slot_mapping.cpu().numpy(), block_tables.ravel(), num_blocks,
             batch.seq_lens.cpu().numpy(), batch.query_start_loc.cpu().numpy(), *op_parts]
    payload = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
    header = torch.tensor([CMD_STEP, payload.numel(), batch.num_tokens, batch.batch_size,
                           block_tables.shape[1], logits_indices.numel(), len(ops), 0])
    return header, payload


def unpack_step(header: torch.Tensor, payload: torch.Tensor, block_size: int,
                device: torch.device) -> tuple:
    """Inverse of `pack_step`: tokens, positions, logits rows, the batch, the pool ops."""
    _, _, num_tokens, size, width, num_logits, num_ops, _ = header.tolist()
    data = payload.numpy()
    cuts = np.cumsum([num_tokens, num_tokens, num_logits, num_tokens, size * width, size, size,
                      size + 1])
    tokens, positions, logits, slots, tables, num_blocks, seq_lens, starts, rest = \
        np.split(data, cuts)
    ops, at = [], 0
    for _ in range(num_ops):
        kind, count = int(rest[at]), int(rest[at + 1])
        ops.append((kind, rest[at + 2:at + 2 + count], rest[at + 2 + count:at + 2 + 2 * count]))
        at += 2 + 2 * count
    batch = StepBatch.from_host(tuple(range(size)), tables.reshape(size, width).astype(np.int32),
                                num_blocks, seq_lens.astype(np.int32), starts.astype(np.int32),
                                slots.copy(), num_tokens, int(np.diff(starts).max()),
                                block_size, device)
    return (torch.from_numpy(tokens.copy()), torch.from_numpy(positions.copy()),
            torch.from_numpy(logits.copy()), batch, ops)


def apply_ops(cache: PagedKVCache, ops: Sequence[tuple[int, np.ndarray, np.ndarray]]) -> None:
    """Replay rank 0's pool operations on this rank's pool (same block ids)."""
    pool = cache.pool
    for kind, src, dst in ops:
        if kind == OP_COPY:
            pool.copy(src, dst)
        elif kind == OP_SWAP_OUT:
            pool.swap_out(src, dst)
        else:
            pool.swap_in(src, dst)


# -- the workers -------------------------------------------------------------------------
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
        kv_heads = shard_model(model, rank, world_size)
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
                 timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
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
                [sys.executable, "-m", "paged_kv.serving._tp_worker", str(rank), str(world_size),
                 init_method, str(timeout_s)], start_new_session=True)
                for rank in range(1, world_size)]
        self._finalizer = weakref.finalize(self, _stop_processes, self.processes)
        try:
            dist.init_process_group("gloo", init_method=init_method, rank=0,
                                    world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            dist.broadcast_object_list([(spec, cache_config)], 0)
        except Exception as exc:
            self._finalizer()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise TensorParallelError(f"tensor-parallel workers did not join within "
                                      f"{timeout_s:.0f} s: {exc}") from exc
        self.closed = False
        self.failed: str | None = None

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
        COMM_SECONDS["broadcast"] += time.perf_counter() - start

    def _collective(self, call):
        try:
            return call()
        except Exception as exc:
            self.failed = f"tensor-parallel collective failed: {exc}"
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
        if not self.failed:  # a dead peer would fail it: the processes are stopped below
            with contextlib.suppress(Exception):
                _send_command(CMD_STOP)
        self._finalizer()
        if dist.is_initialized():
            dist.destroy_process_group()


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

