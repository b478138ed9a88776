"""Block keys and block events: what identifies a full block's K/V across processes.

A key is sha256 over its parent's key and the block's token ids (little-endian int32), the
first block chaining from a tenant's root, so equal prefixes give equal keys in any process
(no Python `hash`) and tenants never share one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class BlockEvent:
    """One allocator event: ``kind`` is allocated / freed / cached / evicted / hit, or
    stored / removed / cleared (the prefix index gained / lost blocks, or was emptied).

    The index's events carry what a subscriber in another process needs, taken when they
    happen (a block id is reused at once): ``keys`` of stored, evicted and removed blocks;
    for stored ones each block's parent key in ``parents`` and their tokens, in order, in
    ``token_ids`` (`encode_tokens` bytes).
    """

    kind: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...] = ()
    parents: tuple[bytes, ...] = ()
    token_ids: bytes = b""


# how keys are made, named for routers that recompute them (change it with the scheme)
HASH_SCHEME = ("paged_kv-sha256-v1: sha256(parent + int32-LE tokens), "
               "root sha256('paged_kv:' + tenant)")
TOKEN_BYTES = 4  # one token id in a key: little-endian int32
KEY_BYTES = 32  # a block key: sha256


def encode_tokens(token_ids: np.ndarray) -> bytes:
    """The canonical bytes of token ids that keys hash: little-endian int32."""
    return token_ids.astype("<i4", copy=False).tobytes()


def hash_block(parent_hash: bytes, token_ids: bytes) -> bytes:
    """Chained, process-independent key of a full block.

    Parameters
    ----------
    parent_hash : bytes
        Key of the previous block of the sequence (the salt's root key for the first one).
    token_ids : bytes
        The block's token ids, `encode_tokens` of them.
    """
    return hashlib.sha256(parent_hash + token_ids).digest()


def split_blocks(token_ids: bytes, num_blocks: int) -> list[bytes]:
    """`token_ids` (the encoding of `num_blocks` whole blocks) cut into one piece a block."""
    if not num_blocks:
        return []
    width = len(token_ids) // num_blocks
    return [token_ids[i:i + width] for i in range(0, len(token_ids), width)]


def root_hash(salt: str | None = None) -> bytes:
    """Key that the first block of a sequence chains from; a salt isolates tenants."""
    if salt is not None and not isinstance(salt, str):
        raise TypeError(f"salt: expected a str, got {type(salt).__name__}")
    return _root_hash(salt or "")


@functools.lru_cache(maxsize=4096)  # one per tenant, asked for at every admission
def _root_hash(salt: str) -> bytes:
    return hashlib.sha256(b"paged_kv:" + salt.encode()).digest()


def hash_chain(parent_hash: bytes, token_ids: bytes, num_blocks: int,
               ) -> tuple[list[bytes], list[bytes]]:
    """Keys of consecutive blocks of one sequence in one call, and the blocks' bytes:
    `token_ids` holds `num_blocks` blocks (`encode_tokens`, equal slices); the first
    chains from `parent_hash`, each next one from the key before it."""
    pieces = split_blocks(token_ids, num_blocks)
    return chain_pieces(parent_hash, pieces), pieces


def chain_pieces(parent_hash: bytes, pieces: list[bytes]) -> list[bytes]:
    """Keys of consecutive blocks whose bytes are `pieces`, the first chained from
    `parent_hash` (`hash_chain` of blocks already split)."""
    keys: list[bytes] = []
    append, sha256 = keys.append, hashlib.sha256
    for piece in pieces:  # serial: each key chains the last
        parent_hash = sha256(parent_hash + piece).digest()  # = hash_block, inlined
        append(parent_hash)
    return keys


def hash_pieces(parent_hashes: list[bytes], pieces: list[bytes]) -> list[bytes]:
    """Keys of blocks whose bytes are `pieces`, each chained from its own parent in
    `parent_hashes` (blocks of different sequences, as one decode step fills them)."""
    sha256 = hashlib.sha256  # hash_block inlined: a call per block costs as much
    return [sha256(parent + piece).digest()
            for parent, piece in zip(parent_hashes, pieces, strict=True)]


def block_keys(token_ids: np.ndarray, block_size: int, root: bytes,
               known: list[bytes] = ()) -> list[bytes]:
    """The chained keys of every full block of `token_ids`, the first chained from `root`
    (`root_hash` of the tenant's salt): a request's keys, computed once and carried with
    it. `known` are the keys of its first blocks, computed before (the request has grown
    since): only the blocks after them are hashed.

    Examples
    --------
    >>> keys = block_keys(np.arange(9), block_size=4, root=root_hash())
    >>> len(keys), block_keys(np.arange(9), 4, root_hash(), keys[:1]) == keys
    (2, True)
    """
    num_full = len(token_ids) // block_size
    if len(known) >= num_full:
        return list(known[:num_full])
    start = len(known) * block_size
    data = encode_tokens(np.asarray(token_ids[start: num_full * block_size], dtype=np.int64))
    return [*known, *chain_pieces(known[-1] if known else root,
                                  split_blocks(data, num_full - len(known)))]
