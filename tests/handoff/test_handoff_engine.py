"""The hand-off between two `Engine`s in one process (real ZMQ on loopback): float and
8-bit pages give the single engine's tokens, a waiting request's heartbeats keep its lease
alive, and an abort during the transfer releases the lease and leaks no block."""

from __future__ import annotations

import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("prometheus_client")

from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig  # noqa: E402
from paged_kv.engine.config import EngineConfig  # noqa: E402
from paged_kv.handoff import HandoffConfig  # noqa: E402
from paged_kv.handoff.params import parse_params  # noqa: E402

from ..conftest import prometheus_value  # noqa: E402
from .conftest import signed  # noqa: E402

CONFIG = TinyLlamaConfig(num_layers=2, hidden_size=64, intermediate_size=64, vocab_size=100,
                         num_heads=4, head_dim=16)
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def engine(role: str, dtype: str = "auto", **kwargs) -> Engine:
    model = TinyLlama(CONFIG, seed=1)
    handoff = None if role == "both" else HandoffConfig(role, secret="s", **kwargs)
    return Engine(model, EngineConfig(
        cache=model.cache_config(num_blocks=64, block_size=4, kv_cache_dtype=dtype),
        handoff=handoff))


def run(e: Engine, request_id: int, limit: int = 5000):
    for _ in range(limit):
        for out in e.step():
            if out.request_id == request_id:
                return out
    raise AssertionError("the request did not finish")


def prefill(e: Engine, prompt: list[int]) -> dict:
    rid = e.add_request(prompt, SamplingParams(max_tokens=1, temperature=0),
                        handoff=parse_params({"do_remote_decode": True}))
    return run(e, rid).kv_transfer_params


def live_leases(e: Engine) -> float:
    return prometheus_value(e.metrics_text(), "paged_kv_handoff_leases", '{state="live"}')


@pytest.mark.parametrize("dtype", ["auto", "int8", "fp8_e4m3"])
def test_pages_of_every_format_give_the_single_engines_tokens(dtype):
    pre, dec, both = engine("prefill", dtype), engine("decode", dtype), engine("both", dtype)
    try:
        for length in (3, 13, 30):
            prompt = [(7 * i + length) % 100 for i in range(length)]
            params = {**prefill(pre, prompt), "do_remote_prefill": True}
            out = run(dec, dec.add_request(prompt, GREEDY, handoff=parse_params(params)))
            [ref] = both.generate([prompt], GREEDY)
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            assert out.cached_by_source.get("peer", 0) == (length - 1) // 4 * 4
        deadline = time.monotonic() + 5
        while live_leases(pre) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert live_leases(pre) == 0
        assert dec.stats().num_live_blocks == 0
        dec.check()
    finally:
        for e in (pre, dec, both):
            e.close()


def test_heartbeats_keep_a_waiting_requests_lease_alive():
    pre = engine("prefill", lease_s=0.6)
    model = TinyLlama(CONFIG, seed=1)
    dec = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=1100, block_size=4),
                                     max_num_seqs=1, handoff=HandoffConfig("decode", secret="s")))
    try:
        prompt = list(range(1, 30))
        params = {**prefill(pre, prompt), "do_remote_prefill": True}
        hog = dec.add_request([5, 6, 7], SamplingParams(max_tokens=4090, ignore_eos=True))
        rid = dec.add_request(prompt, GREEDY, handoff=parse_params(params))
        start = time.monotonic()
        while time.monotonic() - start < 1.8:  # three leases long, waiting for the slot
            dec.step()
        assert dec.num_waiting_requests == 1
        dec.abort(hog)
        out = run(dec, rid)
        assert out.cached_by_source.get("peer") == 28
        text = dec.metrics_text()
        assert prometheus_value(text, "paged_kv_handoff_fallbacks_total",
                                '{reason="lease_expired"}') == 0
    finally:
        pre.close()
        dec.close()


def test_an_abort_during_the_transfer_releases_the_lease_and_frees_every_block():
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    seen, stop = [], threading.Event()

    def slow_peer() -> None:  # answers nothing to a get: a transfer that never ends
        while not stop.is_set():
            if sock.poll(50):
                seen.append(sock.recv_multipart()[1])
    thread = threading.Thread(target=slow_peer, daemon=True)
    thread.start()
    dec = engine("decode")
    try:
        prompt = list(range(1, 30))
        keys = [k.hex() for k in _keys(prompt)]
        params = parse_params({"do_remote_prefill": True, **signed({
            "remote_engine": f"tcp://127.0.0.1:{port}", "lease": "ab" * 16,
            "block_keys": keys, "num_prompt_tokens": len(prompt)}, "s")})
        rid = dec.add_request(prompt, GREEDY, handoff=params)
        dec.step()
        assert dec.stats().num_loading == 1
        deadline = time.monotonic() + 5
        while b"get" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dec.abort(rid)
        while b"release" not in seen and time.monotonic() < deadline:
            dec.step()
            time.sleep(0.01)
        assert b"release" in seen
        assert dec.stats().num_live_blocks == 0 and not dec.has_unfinished_requests
        dec.check()
    finally:
        dec.close()
        stop.set()
        thread.join(5)
        sock.close()
        context.term()


def _keys(prompt: list[int]) -> list[bytes]:
    import numpy as np

    from paged_kv.keys import block_keys, root_hash

    return block_keys(np.asarray(prompt), 4, root_hash(None))
