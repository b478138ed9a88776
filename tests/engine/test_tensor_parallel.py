"""Tensor parallelism over 2 gloo processes on loopback equals one process, token for token.

Each test bounds its wall time (pytest's faulthandler prints the stacks of a hang) and every
engine is closed in a ``with`` block, so no worker outlives its test.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

from paged_kv.engine import Engine, EngineDeadError, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.engine.parallel import TensorParallelError, kv_heads_of_rank

from ..conftest import ROOT, tiny_llama_config

CONFIG = TinyLlamaConfig(num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=100,
                         num_heads=4, num_kv_heads=2, head_dim=16)
MODEL_SEED = 3
SYSTEM = list(range(1, 21))
PROMPTS = [[*SYSTEM, 30, 31], [*SYSTEM, 40], [5, 6, 7], [9] * 33, SYSTEM[:17]]
PARAMS = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=12),
          SamplingParams(max_tokens=8, n=2, temperature=0.8, seed=7),
          SamplingParams(max_tokens=10), SamplingParams(max_tokens=6)]


def _tokens(outputs) -> list:
    return [[o.token_ids for o in out.outputs] for out in outputs]


@pytest.mark.parametrize(("case", "num_blocks", "block_size", "preemption", "budget"), [
    ("mixed prefill and decode, prefix hits, a fork", 64, 16, "recompute", 16),
    ("recompute preemption in a small pool", 16, 4, "recompute", 32),
    ("swap preemption in a small pool", 16, 4, "swap", 32),
])
def test_two_ranks_equal_one_process(model, case, num_blocks, block_size, preemption, budget):
    def run(tp: int):
        config = model.cache_config(num_blocks=num_blocks, block_size=block_size,
                                    num_host_blocks=num_blocks if preemption == "swap" else 0)
        with Engine(model, EngineConfig(cache=config, max_num_batched_tokens=budget,
                                        preemption=preemption, tensor_parallel_size=tp)) as engine:
            outputs = engine.generate(PROMPTS, PARAMS)
            engine.check()
            preempted = engine.scheduler.num_preemptions
            hits = engine.cache.allocator.prefix_hit_tokens
        return _tokens(outputs), preempted, hits

    start = time.monotonic()
    single, tp_run = run(1), run(2)
    assert tp_run == single, case
    if "small pool" in case:
        assert single[1] > 0, "the pool was meant to force preemption"
    else:
        assert single[2] > 0, "the prompts were meant to hit the prefix cache"
    assert time.monotonic() - start < 120


def test_each_rank_holds_its_heads_of_the_same_blocks(model):
    config = model.cache_config(num_blocks=32)
    with Engine(model, EngineConfig(cache=config)) as single:
        single.generate(PROMPTS[:3], PARAMS[:3])
        whole = single.cache.pool.kv.clone()
        assert single.runner.collectives is None
    with Engine(model, EngineConfig(cache=config, tensor_parallel_size=2)) as engine:
        engine.generate(PROMPTS[:3], PARAMS[:3])
        assert engine.pool_bytes_per_rank() == [whole.nbytes // 2] * 2
        timed = engine.runner.collectives  # what the bench's communication split reads
        assert timed.all_reduce_s > 0 and timed.broadcast_s > 0
        assert timed.comm_seconds == timed.all_reduce_s + timed.broadcast_s
        pools = engine.runner.group.gather_pools(engine.cache.pool.kv)
    for rank, pool in enumerate(pools):
        first, count = kv_heads_of_rank(CONFIG.num_kv_heads, 2, rank)
        # [layers, 2, blocks, block_size, heads, dim]: the same block ids, a head slice
        torch.testing.assert_close(pool, whole[..., first:first + count, :], atol=1e-5,
                                   rtol=1e-4)


def test_a_killed_worker_is_a_clear_error_not_a_hang(model):
    config = model.cache_config(num_blocks=32)
    engine = Engine(model, EngineConfig(cache=config, tensor_parallel_size=2))
    try:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        engine.runner.group.processes[0].kill()
        engine.runner.group.processes[0].wait(timeout=30)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1 exited"):
            engine.generate([[4, 5, 6]], SamplingParams(max_tokens=2))
        assert time.monotonic() - start < 30
        for _ in range(2):  # dead for good: every later step says so, whatever is queued
            with pytest.raises(EngineDeadError, match="restart the engine"):
                engine.step()
    finally:
        engine.close()
    # a new engine starts afterwards, on fresh ports
    with Engine(model, EngineConfig(cache=config, tensor_parallel_size=2)) as again:
        assert _tokens(again.generate([[1, 2, 3]], SamplingParams(max_tokens=2)))


@pytest.mark.parametrize(("heads", "kv_heads", "size", "message"), [
    (4, 2, 3, "num_heads=4 is not a multiple"),
    (6, 3, 2, "num_kv_heads=3 neither divides"),
    (4, 2, 0, "tensor_parallel_size"),
])
def test_a_model_that_cannot_split_is_refused_before_any_process_starts(heads, kv_heads, size,
                                                                        message):
    model = TinyLlama(TinyLlamaConfig(num_layers=1, hidden_size=48, intermediate_size=48,
                                      vocab_size=50, num_heads=heads, num_kv_heads=kv_heads,
                                      head_dim=8))
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        Engine(model, EngineConfig(cache=model.cache_config(num_blocks=8),
                                   tensor_parallel_size=size))
    assert time.monotonic() - start < 5, "it must fail before spawning workers"


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    assert [kv_heads_of_rank(1, 2, r) for r in range(2)] == [(0, 1), (0, 1)]
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_heads_of_rank(4, 2, r) for r in range(2)] == [(0, 2), (2, 2)]


def test_a_local_llama_checkpoint_through_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    from paged_kv.engine.hf import HFCausalLM

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path)
    runner = HFCausalLM.from_pretrained(tmp_path)
    cache_config = runner.cache_config(num_blocks=48)
    params = SamplingParams(max_tokens=8)
    with Engine(runner, EngineConfig(cache=cache_config, max_num_batched_tokens=16)) as single:
        expected = _tokens(single.generate(PROMPTS[:4], params))
    with Engine(runner, EngineConfig(cache=cache_config, max_num_batched_tokens=16,
                                     tensor_parallel_size=2)) as engine:
        assert _tokens(engine.generate(PROMPTS[:4], params)) == expected
        whole = cache_config.bytes_per_block * cache_config.num_blocks
        assert engine.pool_bytes_per_rank() == [whole // 2] * 2


def test_the_same_workers_run_under_torchrun():
    """torchrun starts every rank; rank 0 is the engine, the others follow its plans."""
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = ["torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "paged_kv.cli", "demo",
               "--num-requests", "3", "--tensor-parallel-size", "2", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["tensor parallel"]["ranks"] == 2
    assert report["num_requests"] == 3
