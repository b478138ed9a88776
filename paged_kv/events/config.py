"""`KVEventsConfig`: where a replica publishes its KV events, what they carry, and the
bounds of its buffers and of the replay it answers."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """Where and how a replica publishes its KV events.

    Parameters
    ----------
    endpoint : str
        ZMQ endpoint the PUB socket binds, e.g. ``tcp://*:5557`` (``tcp://127.0.0.1:*``
        picks a free port).
    replay_endpoint : str, optional
        Where the ROUTER socket that resends buffered batches binds; None: no replay.
    topic : str
        First frame of every message (llm-d reads ``kv@<replica>@<model>``).
    token_ids : bool
        Publish the stored blocks' token ids. They are the tenants' prompts: off unless
        the operator allows it (hashes alone let a router that tokenizes route).
    buffer_steps : int
        Batches kept for replay.
    max_queue : int
        Batches waiting for the publisher thread; past it a batch is dropped, which a
        subscriber sees as a gap in the sequence numbers.
    replay_max_batches : int
        Batches one replay request gets at most (the oldest from its start; a subscriber
        asks again from where the reply stopped).
    replay_rate, replay_burst : float, int
        Replay requests one client (ZMQ identity) may make per second over time, and at
        once; past them a request is answered with the end-of-replay marker alone.
    replay_total_rate : float
        Replay requests per second all clients together may make.
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    token_ids: bool = False
    buffer_steps: int = 10_000
    max_queue: int = 10_000
    replay_max_batches: int = 1000
    replay_rate: float = 1.0
    replay_burst: int = 10
    replay_total_rate: float = 20.0

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and "://" not in value:
                raise ValueError(f"{name}: expected a ZMQ endpoint like tcp://HOST:PORT, "
                                 f"got {value!r}")
        for name in ("buffer_steps", "max_queue", "replay_max_batches", "replay_burst"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected at least 1, got {getattr(self, name)}")
        for name in ("replay_rate", "replay_total_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a rate > 0 per second, "
                                 f"got {getattr(self, name)}")
