"""The decode engine's side: a request's hand-off parameters checked at admission (their
prefill engine's signature first: nothing is contacted for parameters the secret did not
sign) into a `PeerSource`, which the tiers' fetcher pulls from
(`TierManager.start_peer_fetch`: the one path by which blocks from elsewhere reach the
pool, verified value by value: its MAC, then its header and checksum), then settled:
counted, and the lease released. Heartbeats keep a waiting request's lease alive.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import zmq

from ..core.cache import PagedKVCache
from ..keys import block_keys, root_hash
from ..parts import EnginePart
from ..tiers import codec
from ..tiers.base import Store
from . import config as P
from .metrics import HandoffMetrics
from .params import HandoffParams
from .server import Channel, drain, send
from .trust import HandoffTrust

CALL_TIMEOUT_S = 2.0  # a prefill engine that answers nothing this long is gone
_FAILURES = {b"expired": P.LEASE_EXPIRED, b"unknown": P.LEASE_EXPIRED}


class PeerSource(Store):
    """One request's leased blocks on a prefill engine, as a tier the fetcher reads (on its
    thread): ``contains`` from the listed keys (no round trip), ``get`` one message.

    Parameters
    ----------
    handoff : HandoffParams
    role : DecodeRole
        Its engine's: the secret's MACs, the fingerprint's namespace (the fetcher names
        blocks by `codec.store_key`), the ZMQ context.
    """

    name = "peer"

    def __init__(self, handoff: HandoffParams, role: DecodeRole) -> None:
        self.params, self.role = handoff, role  # the role settles its fetches
        # the role's channel: a socket per prefill engine kept open across gets
        self._trust, self._channel = role.trust, role.channel
        self._lease = (handoff.lease or "").encode()
        namespace, lease_s = role.namespace, role.config.lease_s
        leased, states = handoff.leased_keys(), role.cache.state_group
        if handoff.block_keys and states is not None:  # the checkpoint after the last block
            leased += states.tier_keys(handoff.key_bytes()[-1])
        self.keys = {codec.store_key(namespace, key): key for key in leased}
        self.lease_s = handoff.lease_seconds or lease_s
        self.deadline = time.monotonic() + self.lease_s  # heartbeats move it
        self.beat = time.monotonic()
        self.failure: str | None = None
        self.nbytes, self.seconds, self.settled = 0, 0.0, False

    def frames(self, verb: bytes, keys: list[bytes] = ()) -> list[bytes]:
        """A message to the prefill engine about this lease (its MAC, not the secret)."""
        return [verb, self._trust.request_mac(verb, self._lease, keys), self._lease, *keys]

    def contains(self, keys: list[str]) -> list[bool]:
        return [key in self.keys for key in keys]

    def get(self, keys: list[str]) -> list[bytes | memoryview | None]:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.failure = P.LEASE_EXPIRED
            return [None] * len(keys)
        start, raw = time.monotonic(), [self.keys[k] for k in keys]
        answer = self._channel.call(self.params.remote_engine, self.frames(b"get", raw),
                                    min(left, CALL_TIMEOUT_S))
        self.seconds += time.monotonic() - start
        if answer is None:
            self.failure = P.ENGINE_GONE if left > CALL_TIMEOUT_S else P.LEASE_EXPIRED
        elif answer[0] == b"ok" and len(answer) == len(keys) + 2:
            good = self._trust.values_ok(answer[1], self._lease, raw, answer[2:])
            if not all(good):  # a value not of this lease, or not from a holder of the secret
                self.failure = P.VERIFY_FAILED
            values = [v if ok else None for v, ok in zip(answer[2:], good, strict=True)]
            self.nbytes += sum(len(v) for v in values if v is not None)
            return values
        else:
            self.failure = _FAILURES.get(answer[0], P.TRANSFER_FAILED)
        return [None] * len(keys)

    def put(self, items: list[tuple[str, bytes]]) -> int:
        return 0  # a peer is read only

    def delete(self, keys: list[str]) -> None:
        pass  # a value that failed verification is the prefill engine's to drop (release)

    def usage(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        pass


class DecodeRole(EnginePart):
    """Checks each request's parameters, heartbeats waiting ones' leases, settles fetches.

    Parameters
    ----------
    config : HandoffConfig
    cache : PagedKVCache
    fingerprint : codec.Fingerprint
    """

    role = "decode"

    def __init__(self, config: P.HandoffConfig, cache: PagedKVCache,
                 fingerprint: codec.Fingerprint) -> None:
        self.config, self.cache, self.namespace = config, cache, fingerprint.namespace
        self.trust = HandoffTrust(config.secret)
        self.metrics = HandoffMetrics(self.role)
        self.context = zmq.Context()
        self.channel = Channel(self.context)  # the gets (the fetcher's thread)
        self._sockets: dict[str, zmq.Socket] = {}  # prefill engine -> a DEALER (this thread)
        self._waiting: dict[int, Any] = {}  # request id -> its unsettled request

    def admit(self, request: Any, handoff: HandoffParams | None) -> str | None:
        """Give `request` its `PeerSource`, or fall back: the error message when the
        policy fails it (the engine fails the request), else None."""
        lacks = handoff.lacks(len(self.cache.groups)) if handoff else []
        if handoff is None or not handoff.do_remote_prefill or lacks:
            detail = ("no kv_transfer_params" if handoff is None or not handoff.do_remote_prefill
                      else f"kv_transfer_params lacks {', '.join(lacks)}")
            return self._fall_back(request, P.MISSING_PARAMS, detail)
        if not self.trust.params_signed(handoff):  # before anything is contacted
            return self._fall_back(request, P.UNSIGNED, "kv_transfer_params.signature is "
                                   "not this engine's hand-off secret's: not pulled")
        # the request's own keys (made once as it arrived), hashed here only without them
        mine = request.block_keys or block_keys(
            np.asarray(request.prompt_token_ids, dtype=np.int64),
            self.cache.config.block_size, root_hash(request.salt))
        if handoff.key_bytes() != mine[:len(handoff.block_keys)]:
            self._release(PeerSource(handoff, self))
            return self._fall_back(request, P.TENANT_MISMATCH, "the prefill's block keys are "
                                   "not this prompt's under this tenant")
        request.peer = PeerSource(handoff, self)
        self._waiting[request.request_id] = request
        return None

    def settle(self, request: Any, fetch: Any, loaded: int) -> bool:
        """A fetch for `request` is over (`loaded` blocks landed; `fetch` None: nothing
        was missing): count it, release the lease; False when the policy fails the request
        (its ``error`` says why)."""
        source = request.peer
        if source is None or source.settled:
            return True
        self._release(source)
        failure = getattr(fetch, "failure", None)
        reason = source.failure or (P.VERIFY_FAILED if failure and failure[0] == "verify_failed"
                                    else P.LEASE_EXPIRED if failure else None)
        if fetch is not None and reason is None and loaded < len(fetch.keys):
            reason = P.TRANSFER_FAILED
        if loaded:
            self.metrics.handoff(source.nbytes, source.seconds)
        if reason is None:
            return True
        return self._fall_back(request, reason, f"{loaded} of {len(fetch.keys)} blocks "
                               f"loaded from {source.params.remote_engine}") is None

    def _fall_back(self, request: Any, reason: str, detail: str) -> str | None:
        self.metrics.fallback(reason, detail)
        if self.config.failure != "fail":
            return None
        request.error = f"{P.ERROR_PREFIX}: {reason} ({detail})"
        return request.error

    def tick(self, scheduler: Any) -> list[tuple[int, str]]:
        """After scheduling: heartbeat the leases of requests still waiting (every third
        of a lease), drain the answers; returns ``(request id, error)`` of the requests the
        ``fail`` policy fails (taken from ``scheduler.failed``), for the engine to fail."""
        failed = [(seq.request.request_id, seq.request.error) for seq in scheduler.failed]
        scheduler.failed.clear()
        now = time.monotonic()
        for request in self._waiting.values():
            source = request.peer
            if now - source.beat >= source.lease_s / 3:
                source.beat, source.deadline = now, now + source.lease_s
                send(self._socket(source), source.frames(b"heartbeat"))
        for socket in self._sockets.values():
            drain(socket)
        return failed

    def forget(self, request: Any) -> None:
        """`request` finished or was aborted: release what it still holds."""
        self._waiting.pop(request.request_id, None)
        if request.peer is not None and not request.peer.settled:
            self._release(request.peer)

    def finished(self, request: Any) -> None:
        """Same as `forget`."""
        self.forget(request)

    def _release(self, source: PeerSource) -> None:
        source.settled = True
        for request_id in [i for i, r in self._waiting.items() if r.peer is source]:
            del self._waiting[request_id]
        send(self._socket(source), source.frames(b"release"))

    def _socket(self, source: PeerSource) -> zmq.Socket | None:
        """The DEALER to `source`'s prefill engine (None: ZMQ refused its endpoint, which
        then gets no heartbeat or release: its lease runs out)."""
        endpoint = source.params.remote_engine
        socket = self._sockets.get(endpoint)
        if socket is None:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 1000)  # a release still leaves on close
            socket.setsockopt(zmq.SNDHWM, 1000)
            try:
                socket.connect(endpoint)
            except zmq.ZMQError:  # this request's problem alone, never the engine's step
                socket.close(linger=0)
                return None
            self._sockets[endpoint] = socket
        return socket

    def text(self) -> str:
        """The hand-off metrics."""
        return self.metrics.text()

    def close(self) -> None:
        """Close the sockets (pending releases get a second)."""
        self.channel.close()
        for socket in self._sockets.values():
            socket.close()
        self.context.term()
