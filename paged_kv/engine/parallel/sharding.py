"""Tensor-parallel sharding: a model's picklable recipe, whether it splits over N ranks, and
each rank's share of the weights (Megatron's layout, as vLLM and SGLang use it).

q/k/v and gate/up are split by output rows (heads), o_proj and down by input columns, each
followed by an all-reduce of its partial sums. Embeddings and lm_head are replicated: at
these sizes a vocab-parallel head would add an all-gather per step to save a few MB, and
only rank 0 samples. When there are fewer KV heads than ranks, each KV head is replicated
on ``N / num_kv_heads`` ranks (vLLM does the same).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from ..model import TinyLlama, TinyLlamaConfig


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
        from ..hf import HFCausalLM

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


@dataclasses.dataclass
class Collectives:
    """This process's collectives, timed: seconds in all-reduces and in plan broadcasts
    (the bench's model / communication / bookkeeping split reads them)."""

    all_reduce_s: float = 0.0
    broadcast_s: float = 0.0

    @property
    def comm_seconds(self) -> float:
        """Seconds this rank spent communicating: all-reduces and plan broadcasts."""
        return self.all_reduce_s + self.broadcast_s

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place."""
        start = time.perf_counter()
        dist.all_reduce(tensor)
        self.all_reduce_s += time.perf_counter() - start
        return tensor


def shard_model(model: torch.nn.Module, rank: int, world_size: int,
                collectives: Collectives) -> int:
    """Keep `rank`'s share of `model`'s weights (in place) and make its row-parallel
    projections all-reduce through `collectives`; returns the rank's number of KV heads."""
    shard = _shard_tinyllama if isinstance(model, TinyLlama) else _shard_hf
    return shard(model, rank, world_size, collectives.all_reduce)


def _rows(weight: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return weight[start:start + count].clone()


def _shard_tinyllama(model: TinyLlama, rank: int, world: int, reduce) -> int:
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
        if hasattr(layer, "sinks"):  # one learned sink logit per query head: the rank's heads
            layer.sinks = _param(_rows(layer.sinks.data, rank * heads, heads))
        gate, up = layer.gate_up.data.chunk(2)
        layer.gate_up = _param(torch.cat([_rows(gate, rank * inter, inter),
                                          _rows(up, rank * inter, inter)]))
        layer.down = _param(layer.down.data[:, rank * inter:(rank + 1) * inter].clone())
    model.config = dataclasses.replace(c, num_heads=heads, num_kv_heads=kv_heads,
                                       intermediate_size=inter)
    model.reduce = reduce
    return kv_heads


def _param(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.contiguous(), requires_grad=False)


def _shard_hf(model: torch.nn.Module, rank: int, world: int, reduce) -> int:
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
        linear.register_forward_hook(lambda _module, _inputs, output: reduce(output))

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
    num_layers, _, head_dim = model.kv_shape
    model.kv_shape = (num_layers, kv_heads, head_dim)
    return kv_heads
