"""What every tier store speaks (`Store`), and the tiers an engine is given (`TierConfig`)."""

from __future__ import annotations

import abc
import collections
import dataclasses
import os


class Store(abc.ABC):
    """One tier: a byte-capped map of string keys to encoded block values (`codec`).

    Every method is one round trip to the store (one pipeline on Redis), takes whole
    batches, and never raises for a store that is down or slow: a key it cannot reach is a
    miss, a value it cannot write is not written (the return value says how many were).
    Values are opaque here; the manager verifies them.
    """

    name: str  # "host", "disk" or "remote": the tier's label in stats and metrics
    # where a block lives as KV events name it ("CPU", "DISK"); None: the tier's changes
    # are not published (a shared Redis evicts by itself, for every replica)
    medium: str | None = None
    # keys evicted or deleted since the writer last reported them; None until the writer
    # watches a store with a medium (`TierWriter.watch`), so nothing piles up unwatched
    # (a writer that remembers evictions for the tiers' ghost drains it after each write)
    removed: collections.deque[str] | None = None
    # whether a block's key carries its tenant's prefix (`shares.tenant_prefix`) when the
    # tiers account per tenant: a shared store, where an operator reads usage by prefix
    tenant_keys: bool = False

    @property
    def available(self) -> bool:
        """Whether a call may reach the store now; a store that backs off after a failure
        says False meanwhile, and the manager starts no fetch that could only miss."""
        return True

    @abc.abstractmethod
    def contains(self, keys: list[str]) -> list[bool]:
        """Whether each key is held (a best guess: a later `get` may still miss)."""
        ...

    @abc.abstractmethod
    def get(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value, or None (absent, evicted, unreachable)."""
        ...

    @abc.abstractmethod
    def put(self, items: list[tuple[str, bytes]]) -> int:
        """Store values (LRU eviction keeps the cap); returns how many were written."""
        ...

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Forget keys (a value that failed verification)."""
        ...

    @abc.abstractmethod
    def usage(self) -> tuple[int, int]:
        """Blocks and bytes held now (values, as the cap counts them)."""
        ...

    @abc.abstractmethod
    def close(self) -> None:
        """Release files, sockets and threads."""
        ...


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """The tiers behind an engine's device pool; each is optional.

    Parameters
    ----------
    host_mib : float
        Host RAM for cached blocks, MiB (0: no host tier). Apart from the swap area
        (``CacheConfig.num_host_blocks``), which holds preempted sequences and is never
        evicted.
    disk_dir : str, optional
        A directory that keeps blocks across restarts.
    disk_mib : float
        The disk tier's cap, MiB (needed with `disk_dir`).
    remote_url : str, optional
        ``redis://HOST:PORT/DB`` of a Redis that every replica points at.
    model_id : str
        Names the model's weights in the fingerprint in place of a digest of all their bytes
        (`identity.weights_id`, read at start-up when this is empty); the model's config is
        in the fingerprint either way. Blocks of other weights or configs never match.
    fetch_deadline_s : float, optional
        Longest a request waits for a fetch before it recomputes; default: the engine's
        estimate of recomputing the fetched tokens.
    queue_blocks : int
        Blocks waiting to be written before further writes are dropped (and counted).
    """

    host_mib: float = 0.0
    disk_dir: str | None = None
    disk_mib: float = 0.0
    remote_url: str | None = None
    model_id: str = ""
    fetch_deadline_s: float | None = None
    queue_blocks: int = 4096

    def __post_init__(self) -> None:
        for name in ("host_mib", "disk_mib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name}: expected a size in MiB >= 0, got {value!r}")
        if self.disk_dir is not None:
            if not self.disk_mib:
                raise ValueError("disk_mib: give the disk tier's cap (MiB > 0) with disk_dir")
            _check_writable(self.disk_dir)
        elif self.disk_mib:
            raise ValueError("disk_mib: a cap without disk_dir")
        if self.remote_url is not None and not self.remote_url.startswith(("redis://",
                                                                            "rediss://")):
            raise ValueError(f"remote_url: expected redis://HOST:PORT/DB, got "
                             f"{self.remote_url!r}")
        if self.fetch_deadline_s is not None and not self.fetch_deadline_s > 0:
            raise ValueError(f"fetch_deadline_s: expected seconds > 0, got "
                             f"{self.fetch_deadline_s!r}")
        if not isinstance(self.queue_blocks, int) or self.queue_blocks < 1:
            raise ValueError(f"queue_blocks: expected an int >= 1, got {self.queue_blocks!r}")

    @classmethod
    def from_args(cls, args: object, host_mib_default: float = 0.0) -> TierConfig | None:
        """The tiers of the ``--kv-*`` flags of ``paged-kv demo`` / ``serve`` (None: no
        tier); ValueError naming a flag given without its partner."""
        disk, disk_mib = args.kv_disk, args.kv_disk_mib
        if (disk is None) != (disk_mib is None):
            given, missing = (("--kv-disk", "--kv-disk-mib") if disk is not None
                              else ("--kv-disk-mib", "--kv-disk"))
            raise ValueError(f"argument {given}: needs {missing}")
        host = host_mib_default if args.kv_host_mib is None else args.kv_host_mib
        config = cls(host_mib=host, disk_dir=disk, disk_mib=disk_mib or 0.0,
                     remote_url=args.kv_remote)
        return config if config.enabled else None

    @property
    def enabled(self) -> bool:
        """Whether any tier is configured."""
        return bool(self.host_mib or self.disk_dir or self.remote_url)


def _check_writable(path: str) -> None:
    """ValueError naming `path` unless it is (or can be made) a writable directory."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"disk_dir: cannot create {path!r}: {exc.strerror}") from None
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"disk_dir: {path!r} is not a writable directory")
