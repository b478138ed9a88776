"""`ReplayLimiter`: who may have a replay now, so that no client can busy the publisher.

The replay socket answers on the engine's process (its GIL): unbounded, one client asking
every millisecond for the whole buffer slowed every stream nearly four times. A subscriber
that follows in order asks once at start and once per gap, so each client (ZMQ identity)
gets a token bucket of a few requests, refilled slowly, and all clients together one more
(a client that reconnects gets a new identity, but not a new share of the total). A refused
request is answered with the end-of-replay marker alone: a vLLM subscriber then counts the
gap missed at once instead of waiting out its timeout.
"""

from __future__ import annotations

import collections

MAX_CLIENTS = 4096  # buckets kept; past it the least recently seen client's is forgotten


class TokenBucket:
    """`burst` tokens, refilled at `rate` per second; `take` spends one if there is one."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = float(burst), now

    def take(self, now: float) -> bool:
        """Spend a token at time `now` (seconds, monotonic); False: none left."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class ReplayLimiter:
    """Per client and in total, how many replay requests are answered.

    Parameters
    ----------
    rate : float
        Requests per second one client (ZMQ identity) may make, over time.
    burst : int
        Requests one client may make at once (a subscriber's start and a few gaps).
    total_rate : float
        Requests per second all clients together may make; its burst is one second's
        worth (at least `burst`).
    """

    def __init__(self, rate: float, burst: int, total_rate: float) -> None:
        self.rate, self.burst = rate, burst
        self._clients: collections.OrderedDict[bytes, TokenBucket] = \
            collections.OrderedDict()
        self._total: TokenBucket | None = None
        self._total_rate = total_rate
        self.num_refused = 0

    def allow(self, client: bytes, now: float) -> bool:
        """Whether `client`'s request at time `now` is answered (False: counted refused).
        A refused request spends the client's token only, never the total's."""
        bucket = self._clients.pop(client, None) or TokenBucket(self.rate, self.burst, now)
        self._clients[client] = bucket  # the most recently seen last
        while len(self._clients) > MAX_CLIENTS:
            self._clients.popitem(last=False)
        if self._total is None:
            self._total = TokenBucket(self._total_rate,
                                      max(self._total_rate, self.burst), now)
        if bucket.take(now) and self._total.take(now):
            return True
        self.num_refused += 1
        return False
