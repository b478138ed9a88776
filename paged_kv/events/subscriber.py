"""`EventSubscriber`: follows one publisher's batches in sequence order.

It catches up from the publisher's replay buffer when it starts (so a router started
after its replicas, or restarted, sees their history), and again whenever a sequence
number is skipped. A batch whose number goes back with a newer timestamp means the
publisher restarted (its cache is empty): ``on_reset`` runs before the batch applies. A
restarted publisher whose numbers passed ours before we reconnected shows no such batch:
on every reconnection the batch applied last is asked for again, and a publisher that has
another batch under its number restarted (``on_reset``, then its history from 0).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from .schema import decode_batch

logger = logging.getLogger(__name__)

MAX_REPLAY_REQUESTS = 32  # per gap (or start): replies are capped, history is not
OnBatch = Callable[[float, list[list]], None]


class EventSubscriber:
    """Hands each batch of one publisher, in order, to ``on_batch(timestamp, events)``.

    Parameters
    ----------
    endpoint : str
        The publisher's PUB endpoint (connected to).
    replay_endpoint : str, optional
        Its replay endpoint; None: gaps are counted, never filled.
    on_batch : callable
        Runs on the subscriber's thread for every batch, replayed ones included.
    on_reset : callable, optional
        Runs when the publisher restarted, before its first new batch.
    topic : bytes
        Prefix of the topics to receive.
    replay_timeout : float
        Seconds to wait for a replay's end before counting the rest as missed.
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None,
                 on_batch: OnBatch, on_reset: Callable[[], None] | None = None,
                 topic: bytes = b"", replay_timeout: float = 2.0) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._on_batch, self._on_reset = on_batch, on_reset or (lambda: None)
        self._timeout = replay_timeout
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        # before connecting, so that the first connection is seen too
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._sub.connect(endpoint)
        self.next_seq: int | None = None  # the number the next batch should carry
        self._last: tuple[int, bytes] | None = None  # the batch applied last
        self._connections = 0
        self._last_stamp = 0.0
        self.counts = collections.Counter()  # batches, gaps, replayed, missed, malformed, resets
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paged-kv-subscriber",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop following and close the sockets."""
        self._stop.set()
        self._thread.join(5.0)
        self._context.destroy(linger=0)

    # -- the subscriber thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._replay(0, None)  # the history buffered before this subscriber joined
            if self.next_seq is None:  # nothing yet: whatever comes first must be number 0
                self.next_seq = 0
            poller = zmq.Poller()
            poller.register(self._sub, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
            while not self._stop.is_set():
                ready = dict(poller.poll(50))
                if self._monitor in ready:  # first: it precedes the connection's batches
                    recv_monitor_message(self._monitor)
                    self._connected()
                if self._sub in ready:
                    self._receive(self._sub.recv_multipart())
        except zmq.ContextTerminated:
            return
        except Exception:
            logger.exception("paged_kv events: subscriber of %s stopped", self.endpoint)

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counts["malformed"] += 1
            logger.warning("paged_kv events: %s sent %d frames, expected 3; skipped",
                           self.endpoint, len(frames))
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < self.next_seq:  # (set before the first receive)
            stamp = _stamp(frames[2])
            if stamp is None or stamp <= self._last_stamp:
                return  # a batch the replay already applied
            self.counts["resets"] += 1  # numbers went back with a newer batch: a restart
            self._on_reset()
            self.next_seq = 0
        if seq > self.next_seq:
            self.counts["gaps"] += 1
            self._replay(self.next_seq, seq)
        self._apply(seq, frames[2])

    def _connected(self) -> None:
        """A connection to the publisher came up. Past the first, the publisher may have
        restarted while we were away: it still has the batch applied last under that
        number unless it did (a reply with nothing, refused or late, proves nothing)."""
        self._connections += 1
        if self._connections == 1 or self._last is None or self.replay_endpoint is None:
            return
        got = self._fetch_replay(self._last[0])
        if got and got[0][0] == self._last[0] and got[0][1] != self._last[1]:
            self.counts["resets"] += 1
            self._on_reset()
            self.next_seq = 0
            self._replay(0, None)
            return
        for seq, payload in got:  # sent while we were away
            if seq == self.next_seq:
                self._apply(seq, payload)
                self.counts["replayed"] += 1

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        self._last = (seq, payload)
        try:
            stamp, events = decode_batch(payload)
        except ValueError as exc:
            self.counts["malformed"] += 1
            logger.warning("paged_kv events: %s batch %d skipped: %s", self.endpoint, seq, exc)
            return
        self._on_batch(stamp, events)
        self._last_stamp = max(self._last_stamp, stamp)
        self.counts["batches"] += 1

    def _replay(self, start: int, stop: int | None) -> None:
        """Apply the buffered batches numbered ``start <= seq < stop`` (all from `start`
        when `stop` is None); those the publisher no longer has are counted missed."""
        got = self._fetch_replays(start, stop) if self.replay_endpoint is not None else []
        wanted = [(s, p) for s, p in got if s >= start and (stop is None or s < stop)]
        for seq, payload in wanted:
            if self.next_seq is None or seq >= self.next_seq:
                self._apply(seq, payload)
        self.counts["replayed"] += len(wanted)
        if stop is not None:
            self.counts["missed"] += max(stop - start - len(wanted), 0)
            self.next_seq = stop

    def _fetch_replays(self, start: int, stop: int | None) -> list[tuple[int, bytes]]:
        """What the publisher has from `start` (to `stop`): a reply holds a bounded number
        of batches, so ask again from where one stopped until a reply brings nothing new
        or `stop` is reached (a bounded number of times)."""
        got: list[tuple[int, bytes]] = []
        for _ in range(MAX_REPLAY_REQUESTS):
            new = [(seq, payload) for seq, payload in self._fetch_replay(start)
                   if seq >= start]
            got.extend(new)
            if not new:
                break
            start = max(seq for seq, _ in new) + 1
            if stop is not None and start >= stop:
                break
        return got

    def _fetch_replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        got: list[tuple[int, bytes]] = []
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
            deadline = time.monotonic() + self._timeout
            while (left := deadline - time.monotonic()) > 0 and dealer.poll(int(left * 1000)):
                frames = dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.counts["malformed"] += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < 0:
                    break
                got.append((seq, frames[2]))
        finally:
            dealer.close(0)
        return got


def _stamp(payload: bytes) -> float | None:
    try:
        return decode_batch(payload)[0]
    except ValueError:
        return None
