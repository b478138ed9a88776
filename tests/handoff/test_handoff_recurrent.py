"""The hand-off of models with recurrent layers between two `Engine`s in one process (real
ZMQ on loopback): the prefill engine leases the prompt's blocks and the state checkpoint
at their end (block-sized chunks under their own keys, `paged_kv.core.groups.state_values`),
the decode engine loads both and starts from that state: every full block but the last
comes from the peer, and the tokens are a single engine's (transformers' own greedy ones,
`tests/engine/test_recurrent_models.py`).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("prometheus_client")
transformers = pytest.importorskip("transformers")

from paged_kv.engine import Engine, SamplingParams  # noqa: E402
from paged_kv.engine.config import EngineConfig  # noqa: E402
from paged_kv.engine.hf import HFCausalLM  # noqa: E402
from paged_kv.engine.threads import intra_op_threads  # noqa: E402
from paged_kv.handoff import HandoffConfig  # noqa: E402
from paged_kv.handoff.params import parse_params  # noqa: E402

from ..conftest import prometheus_value  # noqa: E402
from ..engine.conftest import prompt, save_random_checkpoints  # noqa: E402
from ..engine.test_recurrent_models import BLOCK, recurrent_configs  # noqa: E402
from .test_handoff_hybrid import fallbacks, prefill, run  # noqa: E402

FAMILIES = ["qwen3_next", "bamba", "lfm2", "mamba2"]
# inside a block, whole blocks (the checkpoint before the last block), several chunks
LENGTHS = (5, 37, 64, 149)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread():
    with intra_op_threads(1):
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    configs = recurrent_configs()
    return save_random_checkpoints(tmp_path_factory, {f: configs[f][0] for f in FAMILIES})


def engines(path) -> dict[str, Engine]:
    built = {}
    for role in ("prefill", "decode", "both"):
        runner = HFCausalLM.from_pretrained(path)
        built[role] = Engine(runner, EngineConfig(
            cache=runner.cache_config(num_blocks=96, block_size=BLOCK, num_state_slots=32),
            max_num_seqs=8, num_threads=1,
            handoff=None if role == "both" else HandoffConfig(role, secret="s")))
    return built


@pytest.mark.parametrize("family", FAMILIES)
def test_the_decode_engine_starts_from_the_handed_over_state(family, checkpoints):
    built = engines(checkpoints[family])
    pre, dec, both = built["prefill"], built["decode"], built["both"]
    try:
        for length in LENGTHS:
            tokens = prompt(length, seed=length, vocab_size=128)
            params = {**prefill(pre, tokens), "do_remote_prefill": True}
            out = run(dec, dec.add_request(tokens, GREEDY, handoff=parse_params(params)))
            [ref] = both.generate([tokens], GREEDY)
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, length
            full = (length - 1) // BLOCK * BLOCK
            assert out.cached_by_source.get("peer", 0) == full, length
            assert out.prefix_hit_tokens == full, length  # started from the peer's state
            assert fallbacks(dec) == 0, length
        deadline = time.monotonic() + 5
        while prometheus_value(pre.metrics_text(), "paged_kv_handoff_leases",
                               '{state="live"}') and time.monotonic() < deadline:
            time.sleep(0.02)
        for e in built.values():
            e.check()
            assert e.stats().num_live_blocks == 0
    finally:
        for e in built.values():
            e.close()
