"""`RedisStore`: the remote tier, blocks in a Redis that every replica points at.

Keys are ``pkv:`` + the store key, values the encoded blocks. Each method is one round
trip: `contains` one pipeline of EXISTS, `get` one MGET, `put` one pipeline of SET (neither
pipeline a transaction), `delete` one DEL. Eviction is the server's own (``maxmemory`` with
``maxmemory-policy allkeys-lru``): a key it evicted is a miss, like any other.

A store that is down costs nothing per request. A connection error or a timeout (each
bounded by ``timeout_s``, with no client-side retries) logs one warning and starts a
backoff, 0.5 s doubling to 10 s: until it ends every call is a miss or a dropped write
without touching the network; then one call tries again, and a success ends the outage.
No method raises for a store that is down, slow or refusing a write; `num_errors` counts
what failed.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import TypeVar

from .base import Store

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError:  # the tiers extra brings it (and hiredis, which redis uses when present)
    redis = None

logger = logging.getLogger(__name__)

PREFIX = "pkv:"
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 10.0
# a value longer than this is stored as parts of at most this many bytes: Redis allocates
# a string in jemalloc size classes (64 KiB, then 80 KiB), so a 64 KiB block plus its header
# in one string would take 80 KiB; in parts it takes 64 KiB and a small tail
PART_BYTES = (1 << 16) - 64
MAX_TRACKED_KEYS = 1 << 18  # bounds `usage`'s bookkeeping: ~270 B a key, ~70 MB at most

T = TypeVar("T")


class RedisStore(Store):
    """Blocks in a Redis server, evicted by the server's own LRU.

    Parameters
    ----------
    url : str
        ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]`` (or ``rediss://`` for TLS).
    timeout_s : float
        Longest a connect or a reply may take before the call is a miss and the backoff
        starts.
    value_bytes : int, optional
        The length of every value (the encoded block): values this long and over
        `PART_BYTES` are stored in parts under ``KEY``, ``KEY|1``, ... and read back in the
        same one MGET; a missing part makes the value a miss.

    Raises
    ------
    ValueError
        When `url` is not a redis URL or `timeout_s` is not > 0 (a server that cannot be
        reached is no error: its calls are misses).
    ImportError
        When the ``redis`` client is not installed (``pip install 'paged_kv[tiers]'``).

    Notes
    -----
    `usage` is what this instance wrote and has not seen vanish (a `get` or `contains`
    miss, a `delete`): other replicas' blocks are not in it, and a block the server evicted
    stays in it until this instance asks for it. It tracks at most `MAX_TRACKED_KEYS` keys,
    forgetting the oldest writes first. It never asks the server.

    Examples
    --------
    >>> store = RedisStore("redis://127.0.0.1:1/0", timeout_s=0.2)  # nothing listens there
    >>> store.get(["0f:ab"]), store.put([("0f:ab", b"123")]), store.num_errors
    ([None], 0, 1)
    >>> store.close()
    >>> RedisStore("http://127.0.0.1:6379")
    Traceback (most recent call last):
    ...
    ValueError: url: expected redis://HOST:PORT/DB, got 'http://127.0.0.1:6379'
    """

    name = "remote"
    medium = None  # shared by every replica and evicted by Redis itself: not published
    tenant_keys = True  # with a tenant policy: ``pkv:<tenant>/<key>``, usage by prefix

    def __init__(self, url: str, timeout_s: float = 1.0, value_bytes: int | None = None,
                 ) -> None:
        self._where = _check_url(url)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected seconds > 0, got {timeout_s!r}")
        if redis is None:
            raise ImportError("RedisStore needs the redis client: pip install 'paged_kv[tiers]'")
        self.timeout_s = float(timeout_s)
        self.value_bytes = value_bytes
        self._parts = 1 if value_bytes is None else max(1, -(-value_bytes // PART_BYTES))
        self.num_errors = 0  # failed calls and refused writes; none of them raised
        self._lock = threading.Lock()  # the counters and the backoff: several threads call
        self._backoff_s = 0.0  # 0 while the store answers
        self._retry_at = 0.0  # time.monotonic() before which calls do not touch the network
        self._written: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._written_bytes = 0
        try:
            # no retries: a call costs at most one connect and one reply, each timeout_s
            self._pool = redis.ConnectionPool.from_url(
                url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                retry=Retry(NoBackoff(), 0))
        except ValueError as exc:
            raise ValueError(f"url: {_redact(url)!r}: {exc}") from None
        self._client = redis.Redis(connection_pool=self._pool)
        self._call(self._client.ping)  # unreachable: one warning, misses until it answers

    def contains(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []

        def exists() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:  # the first and the last part: a half-evicted value is absent
                names = self._names(key)
                pipe.exists(*{names[0], names[-1]})
            return [count == min(2, self._parts) for count in pipe.execute()]

        found = self._call(exists)
        if found is None:
            return [False] * len(keys)
        self._observe(keys, found)
        return found

    def get(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        parts = self._parts
        values = self._call(lambda: self._client.mget([n for k in keys for n in self._names(k)]))
        if values is None:
            return [None] * len(keys)
        if parts > 1:
            values = [None if None in values[i:i + parts] else b"".join(values[i:i + parts])
                      for i in range(0, len(values), parts)]
        self._observe(keys, [value is not None for value in values])
        return values

    def put(self, items: list[tuple[str, bytes]]) -> int:
        if not items:
            return 0

        def set_all() -> list:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                if len(value) == self.value_bytes and self._parts > 1:
                    pipe.mset({name: value[i * PART_BYTES:(i + 1) * PART_BYTES]
                               for i, name in enumerate(self._names(key))})
                else:
                    pipe.set(PREFIX + key, value)
            return pipe.execute(raise_on_error=False)  # a refused SET (OOM) is one error

        results = self._call(set_all)
        if results is None:
            return 0
        written = 0
        with self._lock:
            for (key, value), result in zip(items, results, strict=True):
                if result is True:
                    written += 1
                    self._track(key, len(value))
                else:
                    self.num_errors += 1
        return written

    def delete(self, keys: list[str]) -> None:
        if not keys:
            return
        self._call(lambda: self._client.delete(*[n for k in keys for n in self._names(k)]))
        self._observe(keys, [False] * len(keys))

    def usage(self) -> tuple[int, int]:
        """Blocks and bytes this instance wrote and has not seen vanish (see Notes)."""
        with self._lock:
            return len(self._written), self._written_bytes

    def close(self) -> None:
        with self._lock:
            self._retry_at = math.inf  # every later call is a miss, with no network
        self._pool.disconnect()

    @property
    def available(self) -> bool:
        """False while backing off after a failure (calls are misses without the network),
        so the manager starts no fetch that could only miss."""
        return time.monotonic() >= self._retry_at

    def _names(self, key: str) -> list[str]:
        """The Redis keys of `key`'s parts (one unless values are split)."""
        first = PREFIX + key
        return [first] + [f"{first}|{i}" for i in range(1, self._parts)]

    def _call(self, request: Callable[[], T]) -> T | None:
        """`request()`'s answer, or None: in backoff (no network), failed or refused."""
        if time.monotonic() < self._retry_at:
            return None
        try:
            answer = request()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._down(exc)
            return None
        except redis.RedisError as exc:  # the server answered, with an error: it is up
            with self._lock:
                self.num_errors += 1
            logger.debug("remote tier %s: %s", self._where, exc)
            return None
        if self._backoff_s:
            self._up()
        return answer

    def _down(self, exc: Exception) -> None:
        """Count a failure and push the next try back (0.5 s, doubling to 10 s)."""
        with self._lock:
            self.num_errors += 1
            was_up = not self._backoff_s
            self._backoff_s = min(self._backoff_s * 2 or BACKOFF_FIRST_S, BACKOFF_MAX_S)
            self._retry_at = max(self._retry_at, time.monotonic() + self._backoff_s)
        if was_up:
            logger.warning("remote tier %s unreachable (%s): its blocks are misses until it "
                           "answers (retried after %.1f s, backing off to %.0f s)",
                           self._where, exc, BACKOFF_FIRST_S, BACKOFF_MAX_S)
        else:
            logger.debug("remote tier %s still unreachable (%s)", self._where, exc)

    def _up(self) -> None:
        with self._lock:
            was_down, self._backoff_s = bool(self._backoff_s), 0.0
        if was_down:
            logger.info("remote tier %s answers again", self._where)

    def _observe(self, keys: list[str], held: list[bool]) -> None:
        """What a call saw: a key not held has vanished; a held one was just used."""
        with self._lock:
            for key, is_held in zip(keys, held, strict=True):
                if key not in self._written:
                    continue
                if is_held:
                    self._written.move_to_end(key)
                else:
                    self._written_bytes -= self._written.pop(key)

    def _track(self, key: str, size: int) -> None:
        """Count a written value in `usage`. Called under the lock."""
        self._written_bytes += size - self._written.pop(key, 0)
        self._written[key] = size
        if len(self._written) > MAX_TRACKED_KEYS:
            self._written_bytes -= self._written.popitem(last=False)[1]


def _check_url(url: str) -> str:
    """``HOST:PORT/DB`` of a redis URL (for logs: no password), or ValueError naming it."""
    expected = f"url: expected redis://HOST:PORT/DB, got {_redact(url)!r}"
    if not isinstance(url, str):
        raise ValueError(expected)
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(expected) from None
    db = parts.path.strip("/") or "0"
    if parts.scheme not in ("redis", "rediss") or not parts.hostname or not db.isdigit():
        raise ValueError(expected)
    return f"{parts.hostname}:{port}/{db}"


def _redact(url: object) -> str:
    """`url` with its password, if any, replaced by ``***`` (error messages reach logs)."""
    text = str(url)
    try:
        parts = urllib.parse.urlsplit(text)
        if parts.password is None:
            return text
    except ValueError:
        return text
    user = parts.netloc.rpartition("@")[0].partition(":")[0]
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
