"""The tiers workload's pieces that need no model: the private redis-server, the delay
proxy (latency added, bandwidth kept), and the store figures."""

from __future__ import annotations

import os
import shutil
import time

import pytest

pytest.importorskip("redis")

from paged_kv.bench.netdelay import DelayProxy, redis_server
from paged_kv.bench.workloads import tiers
from paged_kv.tiers.remote import RedisStore

if shutil.which("redis-server") is None:
    if os.environ.get("CI"):
        pytest.fail("redis-server is missing (apt-get install redis-server)",
                    pytrace=False)
    pytest.skip("redis-server is missing", allow_module_level=True)


def test_the_proxy_adds_one_delay_each_way_and_keeps_bandwidth():
    with redis_server() as url:
        proxy = DelayProxy(int(url.rsplit(":", 1)[1].split("/")[0]), 0.05)
        store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", value_bytes=1 << 20)
        try:
            start = time.perf_counter()
            assert store.contains(["ab:" + "0" * 64]) == [False]  # connect + ping done before
            assert 0.09 < time.perf_counter() - start < 0.5
            values = [(f"ab:{i:064x}", os.urandom(1 << 20)) for i in range(8)]
            assert store.put(values) == 8
            start = time.perf_counter()
            assert store.get([k for k, _ in values]) == [v for _, v in values]
            # 8 MiB in one round trip: a proxy that delayed each chunk in turn would take
            # a delay per chunk (over a second here)
            assert time.perf_counter() - start < 0.6
        finally:
            store.close()
            proxy.close()


def test_store_figures_measure_one_round_trip_and_near_payload_memory():
    with redis_server() as url:
        figures, info = tiers._store_figures(url, repeats=1, nbytes=64 * 1024)
    assert figures[0].value.unit == "MiB/s" and figures[0].ratio > 0
    assert 0.8 < info["round trips per 64-block lookup (its time / the added RTT)"] < 1.6
    assert info["Redis memory / payload bytes"] < 1.05
