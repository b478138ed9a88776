"""The hand-off wire alone (``--workloads disagg``): pages of 64 KiB pulled from a prefill
engine's `paged_kv.handoff.server.HandoffServer` in another process, 64 per get as the
tiers' fetcher asks, over one reused socket (`Channel`) and over a fresh socket per get;
every message carries its MAC and every value's MAC is checked, as a decode engine does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from ...tiers.fetcher import FETCH_BATCH
from ..timing import Stat

PAGE = 64 * 1024
SECRET = "bench-wire"
# the server's process: a lease of `n` encoded pages, its endpoint and keys on stdout,
# served until stdin closes
_SERVER = """
import json, os, sys
from paged_kv.handoff.lease import LeaseTable
from paged_kv.handoff.server import HandoffServer
from paged_kv.handoff.trust import HandoffTrust
from paged_kv.tiers import codec
n, size, secret = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
keys = [os.urandom(32) for _ in range(n)]
values = {k: codec.encode(k, b"\\0" * 32, os.urandom(size)) for k in keys}
table = LeaseTable(3600, 1 << 40)
lease = table.create(values, None)
server = HandoffServer(table, "127.0.0.1", 0, HandoffTrust(secret))
print(json.dumps({"endpoint": server.endpoint, "lease": lease,
                  "keys": [k.hex() for k in keys]}), flush=True)
sys.stdin.read()
server.close()
"""


def wire_bandwidth(pages: int, core: int | None, repeats: int) -> dict[str, Stat]:
    """MB/s pulling `pages` pages of 64 KiB (the server pinned to `core`): ``channel``
    (one socket, reused) and ``fresh`` (a socket per get), interleaved over `repeats`."""
    import zmq

    from ...handoff.server import Channel, call
    from ...handoff.trust import HandoffTrust

    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(pages), str(PAGE), SECRET],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ),
        preexec_fn=None if core is None else (lambda: os.sched_setaffinity(0, {core})))
    context = zmq.Context()
    channel = Channel(context)
    try:
        told = json.loads(server.stdout.readline())
        keys = [bytes.fromhex(k) for k in told["keys"]]
        head = (HandoffTrust(SECRET), told["lease"].encode())
        fresh = lambda frames: call(context, told["endpoint"], frames, 10.0)  # noqa: E731
        reused = lambda frames: channel.call(told["endpoint"], frames, 10.0)  # noqa: E731
        out: dict[str, list[float]] = {"channel": [], "fresh": []}
        _pull(reused, head, keys)  # warm up: connect, first pages
        for _ in range(repeats):
            for name, ask in (("channel", reused), ("fresh", fresh)):
                out[name].append(_pull(ask, head, keys))
        return {name: Stat(tuple(v), "MB/s") for name, v in out.items()}
    finally:
        channel.close()
        context.term()
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _pull(ask, head: tuple, keys: list[bytes]) -> float:
    """MB/s of one pass over `keys`, `FETCH_BATCH` per get (`head`: the trust and the
    lease; the values' MACs checked)."""
    trust, lease = head
    nbytes, start = 0, time.perf_counter()
    for i in range(0, len(keys), FETCH_BATCH):
        batch = keys[i:i + FETCH_BATCH]
        answer = ask([b"get", trust.request_mac(b"get", lease, batch), lease, *batch])
        if answer is None or answer[0] != b"ok":
            raise RuntimeError(f"hand-off wire: get answered {answer and answer[0]!r}")
        if not all(trust.values_ok(answer[1], lease, batch, answer[2:])):
            raise RuntimeError("hand-off wire: a value's MAC does not verify")
        nbytes += sum(len(v) for v in answer[2:])
    return nbytes / (time.perf_counter() - start) / 1e6
