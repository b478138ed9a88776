"""`DiskStore` beyond the contract: restarts, torn and vanished files, failing writes,
concurrent writer and fetcher."""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import sys
import threading

import pytest

from paged_kv.tiers import disk
from paged_kv.tiers.disk import DiskStore

from .test_stores import held_bytes, key


def file_of(store: DiskStore, store_key: str) -> str:
    namespace, digest = store_key.split(":")
    return os.path.join(store.directory, namespace, digest[:2], digest[2:])


def test_restart_keeps_values_and_lru_order(tmp_path):
    store = DiskStore(str(tmp_path), cap_bytes=300)
    keys = [key(i) for i in range(4)]
    store.put([(k, bytes([i]) * 100) for i, k in enumerate(keys[:3])])
    store.get([keys[0]])  # order now 1, 2, 0
    store.close()

    again = DiskStore(str(tmp_path), cap_bytes=300)
    assert again.usage() == (3, 300)
    assert again.get(keys[:3]) == [bytes([i]) * 100 for i in range(3)]  # order 0, 1, 2
    again.get([keys[1], keys[0]])  # order 2, 1, 0
    again.put([(keys[3], b"3" * 100)])
    assert again.contains(keys) == [True, True, False, True]
    again.close()

    third = DiskStore(str(tmp_path), cap_bytes=300)  # order 1, 0, 3 read from the mtimes
    third.put([(key(9), b"9" * 100)])
    assert third.contains([keys[1], keys[0], keys[3]]) == [False, True, True]


def test_lowered_cap_evicts_oldest_at_start(tmp_path):
    store = DiskStore(str(tmp_path), cap_bytes=1000)
    keys = [key(i) for i in range(10)]
    for i, k in enumerate(keys):  # one at a time: oldest first
        store.put([(k, bytes([i]) * 100)])
    store.close()
    smaller = DiskStore(str(tmp_path), cap_bytes=450)
    assert smaller.usage() == (4, 400)
    assert held_bytes(smaller) == 400
    assert smaller.contains(keys) == [False] * 6 + [True] * 4


def test_leftover_temp_files_removed_stray_files_kept(tmp_path):
    store = DiskStore(str(tmp_path), cap_bytes=1000)
    store.put([(key(0), b"kept")])
    directory = os.path.dirname(file_of(store, key(0)))
    torn = os.path.join(directory, disk.TEMP_PREFIX + "killed-mid-write")
    stray = tmp_path / "notes.txt"
    with open(torn, "wb") as file:
        file.write(b"half a val")
    stray.write_text("not a block")
    store.close()  # the store died mid-write: the next start removes its temp file

    again = DiskStore(str(tmp_path), cap_bytes=1000)
    assert not os.path.exists(torn)
    assert stray.read_text() == "not a block"  # not the store's: neither indexed nor removed
    assert again.usage() == (1, 4)
    assert again.get([key(0)]) == [b"kept"]


def test_truncated_file_returned_as_is(tmp_path):
    store = DiskStore(str(tmp_path), cap_bytes=1000)
    store.put([(key(0), b"0123456789" * 10)])
    os.truncate(file_of(store, key(0)), 10)
    assert store.get([key(0)]) == [b"0123456789"]  # the manager's codec rejects it
    store.close()
    assert DiskStore(str(tmp_path), cap_bytes=1000).usage() == (1, 10)


def test_vanished_file_is_a_miss(tmp_path):
    store = DiskStore(str(tmp_path), cap_bytes=1000)
    store.put([(key(0), b"a" * 10), (key(1), b"b" * 20)])
    os.unlink(file_of(store, key(0)))
    assert store.get([key(0), key(1)]) == [None, b"b" * 20]
    assert store.contains([key(0), key(1)]) == [False, True]
    assert store.usage() == (1, 20)
    assert store.num_errors == 0  # gone is a miss, not an error


def test_unreadable_file_is_a_miss(tmp_path, monkeypatch):
    store = DiskStore(str(tmp_path), cap_bytes=1000)
    store.put([(key(0), b"a" * 10)])
    monkeypatch.setattr(disk, "open", _raise(errno.EIO), raising=False)
    assert store.get([key(0)]) == [None]
    monkeypatch.undo()
    assert store.usage() == (0, 0)
    assert held_bytes(store) == 0  # removed, so the cap still counts every file
    assert store.num_errors == 1


@pytest.mark.parametrize("failing", ["mkstemp", "replace"])
def test_failed_write_not_counted_never_raises(tmp_path, monkeypatch, caplog, failing):
    store = DiskStore(str(tmp_path), cap_bytes=1000)
    store.put([(key(0), b"old")])
    target = (disk.tempfile, "mkstemp") if failing == "mkstemp" else (disk.os, "replace")
    monkeypatch.setattr(*target, _raise(errno.ENOSPC))
    with caplog.at_level(logging.WARNING, logger=disk.__name__):
        assert store.put([(key(0), b"new"), (key(1), b"x" * 10), (key(2), b"y")]) == 0
    monkeypatch.undo()
    assert store.num_errors == 3
    assert len(caplog.records) == 1, "one warning, then the errors are only counted"
    assert store.get([key(0), key(1)]) == [b"old", None]
    assert store.usage() == (1, 3)
    assert held_bytes(store) == 3, "a failed write left a temp file"
    assert store.put([(key(1), b"x" * 10)]) == 1  # the room it had reserved is free again


def test_bad_key_rejected_before_any_write(tmp_path):
    store = DiskStore(str(tmp_path), cap_bytes=1000)
    with pytest.raises(ValueError, match=r"key: expected .*'\.\./etc:passwd'"):
        store.put([(key(0), b"a"), ("../etc:passwd", b"b")])
    assert store.usage() == (0, 0)
    assert store.get(["../etc:passwd"]) == [None]


def test_writer_and_fetcher_threads(tmp_path):
    cap = 20_000
    store = DiskStore(str(tmp_path), cap_bytes=cap)
    keys = [key(i) for i in range(64)]
    value = {k: k.encode() * (1 + i % 20) for i, k in enumerate(keys)}  # 98-1960 bytes
    wrong, stop = [], threading.Event()

    def fetch():
        while not stop.is_set():
            for k, got in zip(keys, store.get(keys), strict=True):
                if got is not None and got != value[k]:
                    wrong.append(k)

    fetcher = threading.Thread(target=fetch)
    fetcher.start()
    try:
        for round_ in range(5):
            store.put([(k, value[k]) for k in keys[round_ % 2::2]])
            store.delete(keys[round_::7])
    finally:
        stop.set()
        fetcher.join(timeout=10)
    assert not wrong, f"values served for the wrong key or torn: {wrong[:3]}"
    assert held_bytes(store) == store.usage()[1] <= cap


def test_drop_page_cache(tmp_path):
    store = DiskStore(str(tmp_path), cap_bytes=1000)
    store.put([(key(0), b"a" * 100), (key(1), b"b" * 100)])
    expected = 2 if hasattr(os, "posix_fadvise") else 0
    assert store.drop_page_cache() == expected
    assert store.drop_page_cache([key(0), key(5)]) == expected // 2
    assert store.get([key(0), key(1)]) == [b"a" * 100, b"b" * 100]


def test_a_second_store_on_a_directory_in_use_is_refused_and_touches_nothing(tmp_path):
    store = DiskStore(str(tmp_path), cap_bytes=1000)
    store.put([(key(0), b"a" * 10)])
    directory = os.path.dirname(file_of(store, key(0)))
    writing = os.path.join(directory, disk.TEMP_PREFIX + "being-written")  # the live store's
    with open(writing, "wb") as file:
        file.write(b"half")
    with pytest.raises(disk.DirectoryInUseError, match=re.escape(repr(str(tmp_path)))):
        DiskStore(str(tmp_path), cap_bytes=10)  # a lower cap would evict too: it must not
    assert os.path.exists(writing), "a refused store removed the live store's temp file"
    assert store.get([key(0)]) == [b"a" * 10] and store.usage() == (1, 10)
    assert store.put([(key(1), b"b" * 10)]) == 1  # the first store goes on as before

    store.close()  # released: the next store owns the directory (and cleans up)
    again = DiskStore(str(tmp_path), cap_bytes=1000)
    assert not os.path.exists(writing)
    assert again.get([key(0), key(1)]) == [b"a" * 10, b"b" * 10]
    again.close()


def test_the_lock_holds_across_processes_until_the_holder_exits(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from paged_kv.tiers.disk import DiskStore; "
         f"store = DiskStore({str(tmp_path)!r}, 100); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(disk.DirectoryInUseError, match="in use by another disk tier"):
            DiskStore(str(tmp_path), cap_bytes=100)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    DiskStore(str(tmp_path), cap_bytes=100).close()  # a killed holder's lock is gone


def test_directory_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="directory: cannot create"):
        DiskStore(str(tmp_path / "file" / "sub"), cap_bytes=1000)


def _raise(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail
