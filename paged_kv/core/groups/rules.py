"""The key a layer group's block is indexed under (what a window or chunked layer reads
is each kind's class's rule: `paged_kv.core.groups.kinds`)."""

from __future__ import annotations


def group_key(key: bytes, group: int) -> bytes:
    """The key a block of layer group `group` is indexed under: the chained block key,
    then the group's number (group 0's is the key itself), so each group's blocks are
    found, evicted and stored in the tiers apart, under keys that name their group."""
    return key if group == 0 else key + group.to_bytes(1, "little")


def group_suffix(group: int) -> bytes:
    """What `group_key` appends to a key for layer group `group` (``key + suffix`` is its
    group key): for code that keys many blocks of one group at once."""
    return group_key(b"", group)
