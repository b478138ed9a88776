"""CPU thread policy of the engine's steps (see paged_kv/_threads.py): passive OpenMP waiting
when paged_kv loads before torch, one thread per step when it cannot be, and an explicit
``num_threads`` always honoured and restored after the step."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from paged_kv._threads import engine_threads, intra_op_threads
from paged_kv.serving import Engine, SamplingParams, TinyLlama, TinyLlamaConfig

PROBE = ("import os, {first}, {second}; from paged_kv import _threads; "
         "print(os.environ.get('OMP_WAIT_POLICY'), _threads.engine_threads(None, 'cpu'))")


@pytest.mark.parametrize(("order", "env", "expected"), [
    (("paged_kv", "torch"), {}, "PASSIVE None"),        # passive waiting: torch's threads
    (("torch", "paged_kv"), {}, "None 1"),              # too late for the policy: one thread
    (("paged_kv", "torch"), {"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE 1"),  # the user's choice
])
def test_policy_depends_on_import_order(order, env, expected):
    environment = {k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"}
    environment.update(env)
    result = subprocess.run([sys.executable, "-c", PROBE.format(first=order[0], second=order[1])],
                            env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == expected.split()


def test_explicit_threads_win_and_bad_values_are_named():
    assert engine_threads(3, "cpu") == 3 and engine_threads(2, "cuda") == 2
    assert engine_threads(None, "cuda") is None
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="num_threads"):
            engine_threads(bad, "cpu")


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
    engine = Engine(model, model.cache_config(num_blocks=16), num_threads=other)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert seen and set(seen) == {other}
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="num_threads"):
        Engine(model, model.cache_config(num_blocks=16), num_threads=0)
