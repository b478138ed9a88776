"""`EventPublisher`: one batch of index events per step, over ZMQ PUB, with replay.

The step thread only numbers a batch and queues it (never blocks: a full queue drops the
batch, and subscribers see the gap); a thread of its own encodes and sends. Frames are
vLLM's: ``(topic, sequence number as 8 bytes big-endian, msgpack payload)``. The replay
socket (ROUTER) answers a DEALER's ``(b"", start)`` with the buffered ``(b"", seq,
payload)`` from `start` on (at most ``replay_max_batches``), then ``(b"", -1, b"")``; a
client past its share of requests (`ReplayLimiter`) gets the end marker alone.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence

import zmq

from ..core.groups.state_values import checkpoint_key, chunk_of
from ..keys import KEY_BYTES, BlockEvent
from ..parts import EnginePart
from .config import KVEventsConfig
from .replay import ReplayLimiter
from .schema import MEDIUM_DEVICE, encode_batch, to_wire

logger = logging.getLogger(__name__)

INDEX_KINDS = frozenset({"stored", "evicted", "removed", "cleared", "state_stored",
                         "state_removed"})
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REQUESTS_PER_PASS = 32  # replay requests read between two batches: a flood waits its turn


class EventPublisher(EnginePart):
    """Publishes a cache's index events (see `paged_kv.events.schema` for the schema); as an
    engine's part, each step's (`after_step`).

    Parameters
    ----------
    config : KVEventsConfig
    block_size : int
        Tokens per block, in every ``BlockStored``.
    medium : str
        The tier the blocks live in (``"GPU"``: the engine's own pool).
    state_groups : sequence of int
        The layer groups of the model's recurrent layers (`PagedKVCache.state_group`; none:
        attention only): every batch declares them, so that a router counts this replica's
        prefix hits only up to a state checkpoint (`paged_kv.events.schema`).

    Raises
    ------
    ValueError
        An endpoint that cannot be bound (in use, malformed), before any thread starts.
    """

    wants_events = True

    def __init__(self, config: KVEventsConfig, *, block_size: int,
                 medium: str = MEDIUM_DEVICE, state_groups: Sequence[int] = ()) -> None:
        self.config, self.block_size, self.medium = config, block_size, medium
        self.state_groups = tuple(state_groups)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._context.destroy(linger=0)
            raise ValueError(f"--kv-events: cannot bind {config.endpoint} "
                             f"/ {config.replay_endpoint}: {exc}") from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (None if self._replay is None
                                else self._replay.getsockopt_string(zmq.LAST_ENDPOINT))
        self._topic = config.topic.encode()
        self._seq = itertools.count()
        self._queue: queue.Queue[tuple[int, float, list[BlockEvent], str]] = \
            queue.Queue(config.max_queue)
        self._numbering = threading.Lock()  # the step thread and the tiers' writer publish
        self._sent: collections.deque[tuple[int, bytes]] = \
            collections.deque(maxlen=config.buffer_steps)
        # batches numbered (sent, queued or dropped): a subscriber that applied this many
        # is up to date
        self.num_batches = 0
        self.num_published = self.num_dropped = self.num_replays = 0
        self.replay_limiter = ReplayLimiter(config.replay_rate, config.replay_burst,
                                            config.replay_total_rate)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paged-kv-events", daemon=True)
        self._thread.start()

    def info(self) -> dict:
        """Where and what it publishes (a router's discovery, ``GET /kv_events``)."""
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "topic": self.config.topic, "block_size": self.block_size,
                "medium": self.medium, "token_ids": self.config.token_ids,
                "state_groups": list(self.state_groups)}

    def publish(self, events: list[BlockEvent], medium: str | None = None) -> None:
        """Queue one step's events (those that change the index; none: nothing sent), of
        blocks in `medium` (default: the engine's pool)."""
        if not any(event.kind in INDEX_KINDS for event in events):
            return
        with self._numbering:  # numbers in queue order
            seq = next(self._seq)
            self.num_batches += 1
            try:
                self._queue.put_nowait((seq, time.time(), events, medium or self.medium))
            except queue.Full:  # the sequence number is spent: subscribers see the gap
                self.num_dropped += 1

    def after_step(self, events: list[BlockEvent]) -> None:
        """The engine's step's events: the index's changes, for routers."""
        self.publish(events)

    def publish_tier(self, medium: str, stored: list[bytes], removed: list[bytes]) -> None:
        """A tier's change (`TierManager.watch`): blocks written to it, blocks it dropped.
        Their parents and tokens are not known there: each is its own chain. A state
        checkpoint's chunks (`paged_kv.core.groups.state_values`) are published as the
        checkpoint of its state group, by its first chunk (the one a fetch looks up);
        the other chunks not at all."""
        stored, stored_states = self._split_chunks(stored)
        removed, removed_states = self._split_chunks(removed)
        events = []
        if stored:
            events.append(BlockEvent("stored", (), tuple(stored), (b"",) * len(stored)))
        if removed:
            events.append(BlockEvent("removed", (), tuple(removed)))
        if stored_states:
            events.append(BlockEvent("state_stored", (), tuple(stored_states),
                                     tuple(key[:KEY_BYTES] for key in stored_states)))
        if removed_states:
            events.append(BlockEvent("state_removed", (), tuple(removed_states)))
        self.publish(events, medium)

    def _split_chunks(self, keys: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """`keys` as blocks, and the checkpoints whose first chunk is among them."""
        if not self.state_groups:
            return keys, []
        blocks, checkpoints = [], []
        for key in keys:
            chunk = chunk_of(key, self.state_groups)
            if chunk is None:
                blocks.append(key)
            elif chunk == 0:
                checkpoints.append(checkpoint_key(key))
        return blocks, checkpoints

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        self._stop.set()
        self._thread.join(5.0)
        self._context.destroy(linger=0)

    # -- the publisher thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                seq, stamp, events, medium = self._queue.get(timeout=0.02)
            except queue.Empty:
                if self._stop.is_set():
                    return
            else:
                self._send(seq, stamp, events, medium)
            self._answer_replays()

    def _send(self, seq: int, stamp: float, events: list[BlockEvent], medium: str) -> None:
        try:
            payload = encode_batch(stamp, to_wire(events, block_size=self.block_size,
                                                  medium=medium,
                                                  token_ids=self.config.token_ids,
                                                  state_groups=self.state_groups))
            number = seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, number, payload), copy=False)
            self._sent.append((seq, payload))
            self.num_published += 1
        except Exception:  # a bad batch must not end the thread (its seq becomes a gap)
            logger.exception("paged_kv events: batch %d not sent", seq)

    def _answer_replays(self) -> None:
        for _ in range(REQUESTS_PER_PASS if self._replay is not None else 0):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            allowed = self.replay_limiter.allow(frames[0], time.monotonic())
            if len(frames) != 3 or len(frames[2]) != 8:
                if allowed:  # a flood of them is not logged line by line
                    logger.warning("paged_kv events: malformed replay request ignored")
                continue
            if allowed:
                self._replay_from(frames[0], int.from_bytes(frames[2], "big", signed=True))
            self._replay.send_multipart((frames[0], b"", END_OF_REPLAY, b""))

    def _replay_from(self, client: bytes, start: int) -> None:
        """Send `client` the buffered batches numbered `start` on, the oldest first, at most
        ``replay_max_batches`` of them (the end marker is the caller's)."""
        self.num_replays += 1
        budget = self.config.replay_max_batches
        for seq, payload in list(self._sent):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                budget -= 1
                if budget == 0:
                    return
