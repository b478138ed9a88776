"""`DiskStore`: the local-disk tier, one file per block under a byte cap, kept across restarts.

The key ``<namespace>:<hash hex>`` names the file ``directory/<namespace>/<first 2 hash
hex>/<the rest>`` (256 subdirectories a namespace: no directory grows huge). A value is
written to a temp file beside it and renamed over it (`os.replace`, atomic): a writer killed
mid-value leaves only a temp file, removed at the next start. Nothing is fsynced: a value
torn by a power cut fails the codec's checksum and is a miss, like any other.

The index (key -> bytes, least recently used first) is in memory, rebuilt at start from the
files' mtimes, which every write and hit stamps from a strictly increasing clock: the LRU
order survives restarts. One directory belongs to one store at a time: the store holds an
exclusive ``flock`` on ``directory/.lock`` from its start until `DiskStore.close` (or its
process ends, however it ends), and a second store on the directory, in this process or
another, is refused before it touches a file (two would each keep their own cap, and the
second's start would remove the first's temp files as a dead writer's). Files are read and
written outside the lock (a fetch never waits behind a batch of writes); the index, the
cap's accounting, renames and removals are under it, so the index names the files on disk.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import re
import tempfile
import threading
import time

from .base import Store

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"  # a value being written; never a final name (those are hex)
LOCK_NAME = ".lock"  # empty; its flock says a store has the directory (see the docstring)
_KEY = re.compile(r"([0-9a-f]+):([0-9a-f]{3,})")


class DiskStore(Store):
    """Blocks in files under `directory`, least recently used evicted first.

    Parameters
    ----------
    directory : str
        Where the files live (created when missing); an earlier run's files are kept.
    cap_bytes : int
        Bytes of values on disk at most, temp files included (a value larger than the cap is
        not stored).

    Raises
    ------
    DirectoryInUseError
        A ValueError: another open store (another server) holds `directory`.
    ValueError
        When `directory` cannot be created; from `put`, for a key that is not
        ``<hex namespace>:<hex hash>`` (at least 3 hash digits).

    Examples
    --------
    >>> import tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> store = DiskStore(tmp.name, cap_bytes=10)
    >>> a, b, c = (f"0f:{i:064x}" for i in (1, 2, 3))
    >>> store.put([(a, b"12345"), (b, b"12345"), (c, b"123")])  # 13 bytes > 10: a evicted
    3
    >>> store.contains([a, b, c]), store.usage()
    ([False, True, True], (2, 8))
    >>> DiskStore(tmp.name, cap_bytes=10)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    paged_kv.tiers.disk.DirectoryInUseError: directory '...' is in use by another disk tier ...
    >>> store.close()
    >>> DiskStore(tmp.name, cap_bytes=10).get([b, c])  # the next run sees the same files
    [b'12345', b'123']
    >>> tmp.cleanup()
    """

    name = "disk"
    medium = "DISK"  # as KV events name where a block lives

    def __init__(self, directory: str, cap_bytes: int) -> None:
        self.directory = os.path.abspath(directory)
        self.cap_bytes = int(cap_bytes)
        self.num_errors = 0  # OSErrors met (write, read, remove); none of them raised
        self._warned = False  # the first failed write logs a warning, later ones debug
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"directory: cannot create {directory!r}: {exc.strerror}") from None
        self._owner = _lock(self.directory)  # before any file is read or removed
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._bytes = 0  # of the files in the index
        self._reserved = 0  # of values being written (their temp files count against the cap)
        self._clock = 0  # the last mtime stamped, ns
        self._lock = threading.Lock()  # the writer and the fetcher are different threads
        self._load()
        with self._lock:
            self._evict_to(self.cap_bytes)  # the cap may have been lowered since the last run
        logger.info("disk tier: %d blocks, %.1f of %.1f MiB in %s", len(self._index),
                    self._bytes / 2**20, self.cap_bytes / 2**20, self.directory)

    def contains(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    def get(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            paths = [self._touch(key) for key in keys]
        values, failed = [], []
        for key, path in zip(keys, paths, strict=True):
            value = None if path is None else _read(path)
            values.append(value)
            if path is not None and value is None:
                failed.append(key)
        if failed:
            with self._lock:
                for key in failed:
                    if key in self._index:  # vanished or unreadable: a miss from now on
                        self.num_errors += self._remove(key)  # unreadable, yet there
        return values

    def put(self, items: list[tuple[str, bytes]]) -> int:
        paths = [self._path(key) for key, _ in items]  # a bad key raises before any write
        return sum(self._put_one(key, value, path)
                   for (key, value), path in zip(items, paths, strict=True))

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                if key in self._index:
                    self._remove(key)

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._index), self._bytes

    def close(self) -> None:
        """Release the directory for the next store; the files stay for it. Nothing else is
        held open between calls."""
        self._owner.close()

    def drop_page_cache(self, keys: list[str] | None = None) -> int:
        """Drop files from the OS page cache, so a benchmark reads them from the disk.

        Best effort: dirty pages are written out first (dropping skips them); nothing
        happens without ``os.posix_fadvise``.

        Parameters
        ----------
        keys : list of str, optional
            The blocks whose files to drop; default every block held.

        Returns
        -------
        int
            How many files were dropped (keys not held are skipped).
        """
        if not hasattr(os, "posix_fadvise"):
            return 0
        with self._lock:
            wanted = list(self._index) if keys is None else keys
            paths = [self._path(key) for key in wanted if key in self._index]
        dropped = 0
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += 1
            except OSError:
                pass
            finally:
                os.close(fd)
        return dropped

    def _put_one(self, key: str, value: bytes, path: str) -> bool:
        """Write one value (evicting least recently used files first); False when not
        written: larger than the cap, no room left by concurrent writes, or an OSError."""
        size = len(value)
        if size > self.cap_bytes:
            return False  # would evict everything, and still not fit
        with self._lock:
            self._evict_to(self.cap_bytes - size)
            if self._bytes + self._reserved + size > self.cap_bytes:
                return False
            self._reserved += size
        try:
            temp = _write_temp(path, value)
        except OSError as exc:
            with self._lock:
                self._failed(size, exc)
            return False
        with self._lock:
            try:
                os.utime(temp, ns=(self._stamp(),) * 2)
                os.replace(temp, path)
            except OSError as exc:
                _unlink(temp)
                self._failed(size, exc)
                return False
            self._reserved -= size
            self._bytes += size - self._index.pop(key, 0)  # the old file was replaced
            self._index[key] = size
        return True

    def _failed(self, size: int, exc: OSError) -> None:
        """A failed write: free its room, count it, warn once. Called under the lock."""
        self._reserved -= size
        self.num_errors += 1
        log = logger.debug if self._warned else logger.warning
        self._warned = True
        log("disk tier: a value was not written (%s); further errors are counted in "
            "num_errors", exc)

    def _touch(self, key: str) -> str | None:
        """The file of `key` made most recently used (on disk too), or None when not held.
        Called under the lock."""
        if key not in self._index:
            return None
        self._index.move_to_end(key)
        path = self._path(key)
        try:
            os.utime(path, ns=(self._stamp(),) * 2)
        except FileNotFoundError:
            self._remove(key)
            return None
        except OSError:
            pass  # unstamped: the order after a restart is a little off, the value is fine
        return path

    def _remove(self, key: str) -> bool:
        """Forget `key`, remove its file; whether there was one. Called under the lock."""
        self._bytes -= self._index.pop(key)
        if self.removed is not None:
            self.removed.append(key)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            return False
        except OSError:
            self.num_errors += 1  # left on disk, out of the cap: a disk that refuses unlink
        return True

    def _evict_to(self, target: int) -> None:
        """Remove least recently used files until the bytes held and being written are at
        most `target`. Called under the lock."""
        while self._bytes + self._reserved > target and self._index:
            self._remove(next(iter(self._index)))

    def _stamp(self) -> int:
        """A modification time after every earlier one (ties would lose the LRU order)."""
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _path(self, key: str) -> str:
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"key: expected '<hex namespace>:<hex hash>' with 3+ hash "
                             f"digits, got {key!r}")
        namespace, digest = match.groups()
        return os.path.join(self.directory, namespace, digest[:2], digest[2:])

    def _load(self) -> None:
        """Index the files under the directory, oldest mtime first; remove temp files."""
        found = []
        for namespace in _entries(self.directory, dirs=True):
            for prefix in _entries(namespace.path, dirs=True):
                for entry in _entries(prefix.path, dirs=False):
                    key = f"{namespace.name}:{prefix.name}{entry.name}"
                    if entry.name.startswith(TEMP_PREFIX):
                        _unlink(entry.path)  # left by a writer that died mid-value
                    elif len(prefix.name) == 2 and _KEY.fullmatch(key):
                        with contextlib.suppress(OSError):  # vanished since it was listed
                            stat = entry.stat(follow_symlinks=False)
                            found.append((stat.st_mtime_ns, key, stat.st_size))
        for mtime, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
            self._clock = mtime


class DirectoryInUseError(ValueError):
    """Another open `DiskStore` (in this process or another) holds the directory."""


def _lock(directory: str):
    """An open file holding an exclusive flock on `directory`'s lock file (released when
    the file is closed, or the process ends); DirectoryInUseError when another holds it."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        owner = open(path, "ab")  # noqa: SIM115 - held open for the store's lifetime
    except OSError as exc:
        raise ValueError(f"directory: cannot open {path!r}: {exc.strerror}") from None
    try:
        fcntl.flock(owner.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner.close()
        raise DirectoryInUseError(
            f"directory {directory!r} is in use by another disk tier (another paged-kv "
            f"server holds {LOCK_NAME} in it): give each server its own --kv-disk "
            "directory") from None
    return owner


def _entries(path: str, dirs: bool) -> list[os.DirEntry]:
    """The subdirectories (or plain files) of `path`; none when it cannot be listed."""
    try:
        with os.scandir(path) as listing:
            return [entry for entry in listing if (entry.is_dir(follow_symlinks=False) if dirs
                                                    else entry.is_file(follow_symlinks=False))]
    except OSError:
        return []


def _write_temp(path: str, value: bytes) -> str:
    """Write `value` to a new temp file in `path`'s directory; returns the temp path."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(value)
    except BaseException:
        _unlink(temp)
        raise
    return temp


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError:
        return None


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
