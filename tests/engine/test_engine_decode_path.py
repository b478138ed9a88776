"""The engine's decode steps through the array API (`Scheduler.prepare` and the scheduler's
block count on `rows_of` handles), mixed steps' decoding parts included, equal the mapping
API they replaced: same tokens, same preemptions, same cache state after every step, forks
(copy-on-write) and a pool small enough to preempt included."""

from __future__ import annotations

import pytest
import torch

from paged_kv.core.cache import snapshot
from paged_kv.engine import SamplingParams, TinyLlama, TinyLlamaConfig

from ..conftest import assert_same_snapshot, make_engine

CONFIG = TinyLlamaConfig(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                         hidden_size=32, intermediate_size=64, vocab_size=64,
                         max_position=256)


def _mapping_only(engine) -> None:
    """Make `engine`'s scheduler count and prepare every step through the mapping API."""
    scheduler, cache = engine.scheduler, engine.cache
    scheduler.prepare = lambda plan: cache.prepare(
        {seq.seq_id: seq.token_ids[seq.num_computed: seq.num_computed + n]
         for seq, n in plan.items()})
    scheduler._blocks_needed = lambda plan: (
        cache.num_blocks_needed({seq.seq_id: n for seq, n in plan}) if plan else 0)


@pytest.mark.parametrize("num_blocks", [12, 64])
def test_array_decode_steps_equal_mapping_steps(num_blocks):
    model = TinyLlama(CONFIG, seed=0)
    # one thread each: the pools are compared bit for bit, and a thread count the governor
    # picks from the machine's load would sum the forward's dot products in other orders
    engines = [make_engine(model, num_blocks=num_blocks, block_size=4, max_num_seqs=6,
                           max_num_batched_tokens=24, num_threads=1) for _ in range(2)]
    _mapping_only(engines[1])
    steady, mixed = engines[0].scheduler.steady, []  # the mixed steps' array path, counted
    prepare_mixed = steady.prepare_mixed
    steady.prepare_mixed = lambda *args: mixed.append(1) or prepare_mixed(*args)
    generator = torch.Generator().manual_seed(3)
    for i in range(8):
        prompt = torch.randint(0, model.config.vocab_size, (int(3 + 5 * (i % 4)),),
                               generator=generator).tolist()
        params = SamplingParams(max_tokens=6 + i, n=2 if i % 3 == 1 else 1, seed=i,
                                temperature=0.7 if i % 2 else 0.0, ignore_eos=True)
        for engine in engines:
            engine.add_request(prompt, params)
    finished: list[list] = [[], []]
    steps = 0
    while engines[0].has_unfinished_requests:
        for engine, done in zip(engines, finished, strict=True):
            done += [(out.request_id, [c.token_ids for c in out.outputs])
                     for out in engine.step()]
            engine.check()
        assert finished[0] == finished[1], f"step {steps}"
        assert_same_snapshot(snapshot(engines[1].cache), snapshot(engines[0].cache),
                             f"step {steps}")
        steps += 1
    assert not engines[1].has_unfinished_requests
    assert len(finished[0]) == 8
    preemptions = [engine.stats().num_preemptions for engine in engines]
    assert preemptions[0] == preemptions[1]
    assert (preemptions[0] > 0) == (num_blocks == 12), "the small pool preempts"
    assert mixed, "no mixed step (decoding sequences beside an admission) was compared"
