"""Hand-off faults the engine tests do not reach: a fetch that lands one block short with
no failure named (`DecodeRole.settle` must count it), a hybrid prompt of an exact number
of blocks (the block holding its last token is never leased, and ``group_starts`` follow
from the keys that are), and a window group's block missing on the prefill engine (the
lease starts that group after it, and the decode engine recomputes instead of failing).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("prometheus_client")

from paged_kv import CacheConfig, PagedKVCache  # noqa: E402
from paged_kv.core.groups.rules import group_key  # noqa: E402
from paged_kv.engine import SamplingParams, TinyLlama, TinyLlamaConfig  # noqa: E402
from paged_kv.handoff import HandoffConfig  # noqa: E402
from paged_kv.handoff.params import HandoffParams, parse_params  # noqa: E402
from paged_kv.handoff.peer import DecodeRole, PeerSource  # noqa: E402
from paged_kv.keys import block_keys, encode_tokens, root_hash  # noqa: E402
from paged_kv.tiers.codec import Fingerprint  # noqa: E402

from ..conftest import prometheus_value  # noqa: E402
from ..engine.conftest import prompt  # noqa: E402
from ..engine.test_tiny_hybrid import SHAPE  # noqa: E402
from .conftest import signed  # noqa: E402
from .test_handoff_hybrid import (  # noqa: E402
    GREEDY,
    TINY,
    assert_idle,
    close,
    engines,
    fallbacks,
    prefill,
    run,
)

BLOCK = 4
# exact multiples of the block: inside the window (8), at it, several windows, one and two
# chunks of 16, past two
EXACT_LENGTHS = (8, 12, 16, 24, 32, 40)


def transfer_failed(text: str) -> float:
    return prometheus_value(text, "paged_kv_handoff_fallbacks_total",
                            '{reason="transfer_failed"}')


# -- 1. settle: a fetch one block short is a transfer that failed ----------------------------
@pytest.fixture
def prefill_engine_socket():
    """A ROUTER standing in for a prefill engine's page server: settle's release lands
    there at once (so closing the role waits on nothing)."""
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    socket.close()
    context.term()


def decode_role(failure: str) -> DecodeRole:
    cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4,
                                     block_size=BLOCK, num_blocks=8))
    return DecodeRole(HandoffConfig("decode", secret="s", failure=failure), cache,
                      Fingerprint.of(cache.config, "model", "config"))


def admitted(role: DecodeRole, endpoint: str, request_id: int) -> tuple[object, object]:
    """A request of 13 tokens whose 3 full blocks are leased at `endpoint`, with its
    `PeerSource`, and a finished fetch of those 3 blocks that names no failure."""
    tokens = list(range(13))
    keys = block_keys(np.asarray(tokens, dtype=np.int64), BLOCK, root_hash(None))[:3]
    handoff = HandoffParams(do_remote_prefill=True, remote_engine=endpoint, lease="ab" * 16,
                            block_keys=[key.hex() for key in keys], num_prompt_tokens=13)
    request = SimpleNamespace(request_id=request_id, prompt_token_ids=tokens, salt=None,
                              error=None, peer=None)
    request.peer = PeerSource(handoff, role)
    return request, SimpleNamespace(keys=keys, failure=None)


@pytest.mark.parametrize("failure", ["recompute", "fail"])
def test_a_fetch_one_block_short_with_no_failure_named_is_a_transfer_failed(
        failure, prefill_engine_socket):
    role = decode_role(failure)
    try:
        request, fetch = admitted(role, prefill_engine_socket, 1)
        assert role.settle(request, fetch, len(fetch.keys)) is True
        assert request.error is None and request.peer.settled
        assert transfer_failed(role.text()) == 0, "every block loaded, yet a fallback"

        request, fetch = admitted(role, prefill_engine_socket, 2)
        settled = role.settle(request, fetch, len(fetch.keys) - 1)
        assert transfer_failed(role.text()) == 1, "2 of 3 blocks loaded, not counted"
        assert request.peer.settled  # its lease released either way
        if failure == "fail":
            assert settled is False
            assert "transfer_failed" in request.error and "2 of 3" in request.error
        else:
            assert settled is True and request.error is None
    finally:
        role.close()


# -- 2. a hybrid prompt of an exact number of blocks --------------------------------------
@pytest.mark.parametrize("variant", ["mixed", "chunked", "sinks", "sliding"])
def test_a_hybrid_prompt_of_whole_blocks_leases_all_but_its_last_block(variant):
    """The decode engine never asks for the block holding the prompt's last token, so
    neither ``block_keys`` nor the other groups' ``group_starts`` count it; every other
    block comes from the peer with no fallback, and the tokens are the single engine's."""
    built = engines(lambda: TinyLlama(TinyLlamaConfig(**SHAPE, **TINY[variant])), BLOCK)
    pre, dec, both = built["prefill"], built["decode"], built["both"]
    try:
        for length in EXACT_LENGTHS:
            case = f"{variant}, prompt of {length}"
            tokens = prompt(length, seed=length, vocab_size=SHAPE["vocab_size"])
            params = prefill(pre, tokens)
            num_keys = (length - 1) // BLOCK
            assert len(params["block_keys"]) == num_keys, case
            assert params["group_starts"] == [
                group.skipped_blocks(num_keys * BLOCK)
                for group in pre.cache.groups[1:]], case
            handoff = parse_params({**params, "do_remote_prefill": True})
            out = run(dec, dec.add_request(tokens, GREEDY, handoff=handoff))
            [ref] = both.generate([tokens], GREEDY)
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, case
            assert out.cached_by_source.get("peer", 0) == num_keys * BLOCK, case
            assert fallbacks(dec) == 0, f"{case}: the hand-off fell back"
        assert_idle(built)
    finally:
        close(built)


# -- 3. a window group's block missing on the prefill engine ------------------------------
@pytest.mark.parametrize("variant", ["mixed", "chunked"])
def test_a_window_block_missing_on_the_prefill_engine_starts_its_group_after_it(variant):
    """The first block of the window group's last window leaves the prefill engine's
    prefix cache: `export` leases that group from the next column on (what
    ``group_starts`` says, exactly `HandoffParams.leased_keys`), and the decode engine,
    recomputing what it cannot load, gives the single engine's tokens."""
    built = engines(lambda: TinyLlama(TinyLlamaConfig(**SHAPE, **TINY[variant])), BLOCK)
    pre, dec, both = built["prefill"], built["decode"], built["both"]
    try:
        tokens = prompt(41, seed=41, vocab_size=SHAPE["vocab_size"])
        ran = run(pre, pre.add_request(tokens, SamplingParams(max_tokens=1, temperature=0)))
        [group] = pre.cache.groups[1:]
        num_keys = (len(tokens) - 1) // BLOCK
        column = group.skipped_blocks(num_keys * BLOCK)
        assert column + 1 < num_keys, "the window must span two columns"
        keys = block_keys(np.asarray(tokens, dtype=np.int64), BLOCK, root_hash(None))
        piece = encode_tokens(np.asarray(tokens[column * BLOCK:(column + 1) * BLOCK]))
        block = pre.cache.allocator.lookup(group_key(keys[column], group.index), piece)
        assert block is not None and pre.cache.allocator.unregister([block]) == 1
        pre.check()

        role = pre.handoff
        leased, values, starts = role.export(tokens, None)
        assert leased == keys[:num_keys]
        assert starts == [column + 1], "group_starts must name the column after the gap"
        params = {"remote_engine": role.server.endpoint,
                  "lease": role.leases.create(values, None),
                  "block_keys": [key.hex() for key in leased],
                  "first_token": ran.outputs[0].token_ids[0],
                  "num_prompt_tokens": len(tokens), "lease_seconds": 30.0,
                  "group_starts": starts}
        handoff = parse_params({**signed(params, "s"), "do_remote_prefill": True})
        assert set(values) == set(handoff.leased_keys())
        assert len(values) == len(handoff.leased_keys()) == num_keys + 1

        out = run(dec, dec.add_request(tokens, GREEDY, handoff=handoff))
        [ref] = both.generate([tokens], GREEDY)
        assert out.error is None
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        deadline = time.monotonic() + 5
        while prometheus_value(pre.metrics_text(), "paged_kv_handoff_leases",
                               '{state="live"}') and time.monotonic() < deadline:
            time.sleep(0.02)
        assert prometheus_value(pre.metrics_text(), "paged_kv_handoff_leases",
                                '{state="live"}') == 0, "the decode engine kept its lease"
        for e in built.values():
            e.check()
            assert e.stats().num_live_blocks == 0
    finally:
        close(built)
