"""CPU thread policy of the engine's steps (see paged_kv/engine/threads.py): all of torch's
threads while the machine's cores are free, fewer while other processes use them, an explicit
``num_threads`` always honoured, and torch's setting restored after every step."""

from __future__ import annotations

import pytest
import torch

from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig, threads
from paged_kv.engine.config import EngineConfig
from paged_kv.engine.threads import ThreadGovernor, intra_op_threads


class FakeMachine:
    """/proc/stat, the clocks and the core count of a machine whose other processes use
    `others` cores while this process uses `own`."""

    def __init__(self, monkeypatch, cores: int = 2) -> None:
        self.wall = self.own = 0.0
        self.busy = 0  # ticks of 1/100 s
        self.others, self.own_rate = 0.0, 1.0
        monkeypatch.setattr(threads, "_busy_ticks", lambda: (self.busy, 10**9))
        monkeypatch.setattr(threads.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(threads.time, "process_time", lambda: self.own)
        monkeypatch.setattr(threads.os, "cpu_count", lambda: cores)
        monkeypatch.setattr(threads.os, "sysconf", lambda name: 100)

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.own += self.own_rate * seconds
        self.busy += round(100 * (self.others + self.own_rate) * seconds)


def test_the_governor_follows_the_cores_other_processes_leave(monkeypatch):
    machine = FakeMachine(monkeypatch)
    governor = ThreadGovernor(max_threads=2)
    assert governor.step_threads() == 2
    machine.others = 1.0            # another process takes a core
    machine.advance(0.2)
    assert governor.step_threads() == 2, "re-measured at most every PERIOD_S"
    machine.advance(0.4)
    assert governor.step_threads() == 1
    machine.others = 0.0            # it left
    machine.advance(0.6)
    assert governor.step_threads() == 2
    machine.others = 3.0            # more load than cores: still one thread
    machine.advance(0.6)
    assert governor.step_threads() == 1


def test_without_proc_stat_torch_keeps_its_count(monkeypatch):
    machine = FakeMachine(monkeypatch)
    monkeypatch.setattr(threads, "_busy_ticks", lambda: None)
    governor = ThreadGovernor(max_threads=2)
    machine.others = 1.0
    machine.advance(1.0)
    assert governor.step_threads() == 2


def test_explicit_threads_win_and_bad_values_are_named():
    assert ThreadGovernor(3).step_threads() == 3
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="num_threads"):
            ThreadGovernor(bad)


def test_threads_are_set_for_the_block_and_restored():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with intra_op_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), intra_op_threads(other):
        raise RuntimeError("a failing step")
    assert torch.get_num_threads() == before


def test_engine_steps_on_its_threads_and_restores_them():
    model = TinyLlama(TinyLlamaConfig(num_layers=1, hidden_size=32, intermediate_size=32,
                                      vocab_size=40, num_heads=2, num_kv_heads=1, head_dim=16))
    seen = []
    forward = model.forward

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    model.forward = spy
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=16), num_threads=other))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert seen and set(seen) == {other}
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="num_threads"):
        Engine(model, EngineConfig(cache=model.cache_config(num_blocks=16), num_threads=0))
