"""Tensor parallelism when things go wrong (issue 20): the order of replayed pool operations,
a failed construction, a SIGKILLed rank 0, and Ctrl-C in the terminal."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytest.importorskip("torch.distributed")

from paged_kv import PagedKVCache
from paged_kv.engine import (
    Engine,
    EngineDeadError,
    SamplingParams,
    TinyLlama,
    TinyLlamaConfig,
)
from paged_kv.engine import engine as engine_module
from paged_kv.engine.config import EngineConfig
from paged_kv.engine.parallel import group
from paged_kv.engine.parallel.plan import apply_ops
from paged_kv.engine.parallel.sharding import ModelSpec

from ..conftest import ROOT, tiny_config

CONFIG = TinyLlamaConfig(num_layers=1, hidden_size=64, intermediate_size=64, vocab_size=100,
                         num_heads=4, num_kv_heads=2, head_dim=16)


def test_replayed_pool_operations_keep_their_order():
    """Planted fault 3 (a worker replaying a step's operations reversed): one step swaps a
    sequence out and copies on write into the very block the swap freed; reversed, the copy
    lands first and the host pool keeps the copy instead of the swapped sequence."""
    config = tiny_config(num_layers=1, num_blocks=5, block_size=4, num_host_blocks=4)
    leader = PagedKVCache(config)
    for seq_id, n in (("x", 8), ("p", 6)):  # x: 2 full blocks; p: 1 full + 1 partial
        leader.add_sequence(seq_id)
        batch = leader.prepare({seq_id: n})
        leader.write(0, torch.randn(n, 2, 4), torch.randn(n, 2, 4), batch)
    leader.fork("p", "c")  # shares p's partial block: the next write into it copies
    assert leader.stats().num_free_blocks == 0
    follower = PagedKVCache(config)
    follower.pool.kv.copy_(leader.pool.kv)  # the ranks agree before the step
    leader.pool.record_ops()
    leader.swap_out("x")
    leader.prepare({"c": 1})  # copy-on-write into one of x's freed blocks
    ops = leader.pool.take_ops()
    assert [kind for kind, _, _ in ops] == [2, 1], "swap out, then copy"
    apply_ops(follower, ops)
    assert torch.equal(follower.pool.host, leader.pool.host), "x's swapped blocks differ"
    assert torch.equal(follower.pool.kv, leader.pool.kv)


def test_reversed_replay_is_detected():
    """The same step replayed reversed does not reproduce rank 0's pools (so the order
    check above can fail)."""
    config = tiny_config(num_layers=1, num_blocks=5, block_size=4, num_host_blocks=4)
    leader = PagedKVCache(config)
    for seq_id, n in (("x", 8), ("p", 6)):
        leader.add_sequence(seq_id)
        batch = leader.prepare({seq_id: n})
        leader.write(0, torch.randn(n, 2, 4), torch.randn(n, 2, 4), batch)
    leader.fork("p", "c")
    before = leader.pool.kv.clone()
    leader.pool.record_ops()
    leader.swap_out("x")
    leader.prepare({"c": 1})
    ops = leader.pool.take_ops()
    follower = PagedKVCache(config)
    follower.pool.kv.copy_(before)
    apply_ops(follower, list(reversed(ops)))
    assert not torch.equal(follower.pool.host, leader.pool.host)


def test_a_failed_construction_leaves_the_process_usable(monkeypatch):
    """Bug 5: a construction failing after the group started left torch.distributed
    initialised, so every later Engine(..., tensor_parallel_size=2) failed."""
    model = TinyLlama(CONFIG, seed=1)
    config = model.cache_config(num_blocks=32)

    def broken_metrics(*args):
        raise RuntimeError("a failure after the workers joined")

    with monkeypatch.context() as patch:
        patch.setattr(engine_module, "EngineMetrics", broken_metrics)
        with pytest.raises(RuntimeError, match="after the workers joined"):
            Engine(model, EngineConfig(cache=config, tensor_parallel_size=2))
    assert not torch.distributed.is_initialized()
    _assert_tensor_parallel_serves(model, config)


def test_workers_that_never_join_leave_the_process_usable(monkeypatch):
    """Bug 5, the rendezvous itself failing (the issue's "did not join ... initialize the
    default process group twice"): torch keeps the failed group's number, so the next
    group's keys never meet its fresh workers' and every retry timed out."""
    model = TinyLlama(CONFIG, seed=1)
    config = model.cache_config(num_blocks=32)
    with monkeypatch.context() as patch:
        patch.setattr(group.sys, "executable", "/bin/false")  # workers exit at once
        with pytest.raises(EngineDeadError, match="did not join"):
            group.TensorParallelGroup(ModelSpec.of(model), config, 2, timeout_s=2)
    assert not torch.distributed.is_initialized()
    _assert_tensor_parallel_serves(model, config)


_RANK0 = textwrap.dedent("""
    import sys, time
    from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
    from paged_kv.engine.config import EngineConfig
    model = TinyLlama(TinyLlamaConfig(num_layers=1, hidden_size=64, intermediate_size=64,
                                      vocab_size=100, num_heads=4, num_kv_heads=2,
                                      head_dim=16))
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=32),
                                        tensor_parallel_size=2))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    print(" ".join(str(p.pid) for p in engine.runner.group.processes), flush=True)
    if sys.argv[1] == "sigint":  # Ctrl-C reaches the workers' old process group: they live
        import os, signal
        for pid in [p.pid for p in engine.runner.group.processes]:
            os.kill(pid, signal.SIGINT)
        time.sleep(1.0)
        out = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=2))
        print("after sigint", len(out[0].outputs[0].token_ids), flush=True)
        engine.close()
    else:
        time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone for our purpose
        return stat.read().split()[2] != "Z"


@contextlib.contextmanager
def _rank0(mode: str):
    """Rank 0 in a subprocess with its two workers started; yields it and the workers'
    pids, and kills whatever is left after the test."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _RANK0, mode], env=env,
                            stdout=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        line = proc.stdout.readline()
        assert line.strip(), "rank 0 did not start its workers"
        workers = [int(pid) for pid in line.split()]
        yield proc, workers
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_workers_exit_when_rank_0_is_killed():
    """Bug 5: a SIGKILLed rank 0 left workers running (one kept allocating)."""
    with _rank0("kill") as (proc, workers):
        assert all(_alive(pid) for pid in workers)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in workers), "a worker outlived rank 0"


def test_sigint_to_the_workers_does_not_kill_them():
    """Bug 6: Ctrl-C reached the workers, which died before rank 0 could drain."""
    with _rank0("sigint") as (proc, _):
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        assert "after sigint 2" in out

def test_a_failed_tensor_parallel_step_leaves_the_engine_dead(monkeypatch):
    """A model error on rank 0 after the plan went out leaves the ranks out of step: unlike
    a single-process engine, which fails the step's requests and goes on, the engine
    raises `EngineDeadError` from that step and from every one after; `close` then stops
    the workers at once (they sit in an all-reduce rank 0 never joins: a polite stop would
    wait out the collective's 60 s timeout)."""
    model = TinyLlama(CONFIG, seed=1)
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=32),
                                        tensor_parallel_size=2))
    try:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))

        def broken(*args, **kwargs):
            raise RuntimeError("rank 0's shard failed")

        monkeypatch.setattr(engine.runner.model, "forward", broken)
        engine.add_request([4, 5, 6], SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError, match="shard failed"):
            engine.step()
        monkeypatch.undo()
        for _ in range(2):
            with pytest.raises(EngineDeadError, match="restart the engine"):
                engine.step()
    finally:
        start = time.monotonic()
        engine.close()
    assert time.monotonic() - start < 10, "close() waited for the stuck workers"
    assert all(p.poll() is not None for p in engine.runner.group.processes)


def _assert_tensor_parallel_serves(model, config) -> None:
    """The process can still start a tensor-parallel engine, and it gives one engine's
    greedy tokens."""
    want = Engine(model, EngineConfig(cache=config)).generate([[1, 2, 3]],
                                                              SamplingParams(max_tokens=4))
    with Engine(model, EngineConfig(cache=config, tensor_parallel_size=2)) as engine:
        got = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
