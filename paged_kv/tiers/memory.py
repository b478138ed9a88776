"""`HostStore`: the host-RAM tier, an LRU map of encoded blocks under a byte cap."""

from __future__ import annotations

import collections
import threading

from .base import Store


class HostStore(Store):
    """Blocks in this process's memory, least recently used evicted first.

    Parameters
    ----------
    cap_bytes : int
        Bytes of values held at most (a value larger than the cap is not stored).

    Examples
    --------
    >>> store = HostStore(cap_bytes=10)
    >>> store.put([("a", b"12345"), ("b", b"12345"), ("c", b"123")])
    3
    >>> store.contains(["a", "b", "c"]), store.usage()
    ([False, True, True], (2, 8))
    """

    name = "host"
    medium = "CPU"  # as KV events name where a block lives

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = int(cap_bytes)
        self._values: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the writer and the fetcher are different threads

    def contains(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def get(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            out = []
            for key in keys:
                value = self._values.get(key)
                if value is not None:
                    self._values.move_to_end(key)
                out.append(value)
            return out

    def put(self, items: list[tuple[str, bytes]]) -> int:
        written = 0
        with self._lock:
            for key, value in items:
                if len(value) > self.cap_bytes:
                    continue
                old = self._values.pop(key, None)
                if old is not None:
                    self._bytes -= len(old)
                while self._bytes + len(value) > self.cap_bytes:
                    gone, old = self._values.popitem(last=False)
                    self._bytes -= len(old)
                    if self.removed is not None:
                        self.removed.append(gone)
                self._values[key] = value
                self._bytes += len(value)
                written += 1
        return written

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                value = self._values.pop(key, None)
                if value is not None:
                    self._bytes -= len(value)
                    if self.removed is not None:
                        self.removed.append(key)

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._values), self._bytes

    def close(self) -> None:
        with self._lock:
            self._values.clear()
            self._bytes = 0
