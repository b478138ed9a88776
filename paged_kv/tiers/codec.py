"""Self-verifying block values: a fixed header, then the block's bytes.

Header (little-endian, 72 bytes: `HEADER`): magic ``PKVB`` (4), format version (2),
checksum kind (2), the full chained key (32; a hybrid layout's key of another layer group
than the first, the chained key and the group's number, by its sha256: `header_key`), the
fingerprint's digest (16), the payload length (8), the payload's checksum (8: xxh3-64 when
``xxhash`` is installed, else CRC-32; the kind says which). A value verifies only when
every field matches what the reader asked for and the payload's checksum is right: a
truncated (even empty, or shorter than the header), torn, foreign or colliding value is a
miss, and `decode` never raises for one.

The store key is the fingerprint's namespace and the chained key in hex (then a hybrid
layout's group number): the same in every process and on every machine (sha256, never
Python's ``hash``), and the tenant's salt is inside the chain, so two tenants' blocks never
share a key, nor two layer groups' blocks of the same tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import zlib

from ..config import CacheConfig

try:
    import xxhash
except ImportError:  # the tiers extra brings it; CRC-32 verifies as well, more slowly
    xxhash = None

MAGIC, VERSION = b"PKVB", 1
CHECK_CRC32, CHECK_XXH3 = 1, 2
HEADER = struct.Struct("<4sHH32s16sQQ")
KEY_HEX_CHARS = 64  # tests shorten it to force collisions (see `store_key`)


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """Everything a block's bytes depend on besides its tokens: blocks of other weights,
    another model config (RoPE, norms, attention, layer kinds), dtype, page format, block
    size, shape or tensor-parallel rank never match.

    `model_id` names the weights (`identity.weights_id`: a digest of all their bytes) and
    `model_config` the rest of the model (`identity.config_id`); build one from a model
    with `identity.model_fingerprint`.
    """

    model_id: str
    model_config: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def of(cls, config: CacheConfig, model_id: str, model_config: str, tp_rank: int = 0,
           tp_size: int = 1) -> Fingerprint:
        """The fingerprint of a cache's blocks (`config` as this rank holds it)."""
        # rotated keys are other bytes: a rotated cache's blocks never match an unrotated one's
        page_format = config.kv_cache_dtype + ("+rotated" if config.kv_rotation else "")
        return cls(model_id, model_config, str(config.dtype), page_format,
                   config.block_size, config.num_layers, config.num_kv_heads, config.head_dim,
                   tp_rank, tp_size)

    @property
    def digest(self) -> bytes:
        """16 bytes of sha256 over every field."""
        fields = dataclasses.astuple(self)
        return hashlib.sha256(repr(fields).encode()).digest()[:16]

    @property
    def namespace(self) -> str:
        """The key prefix of this fingerprint's blocks in every store."""
        return self.digest.hex()


CHAIN_BYTES = 32  # a chained key (sha256); a layer group's key appends its number


def store_key(namespace: str, key: bytes) -> str:
    """The store's key of the block chained to `key` (a sha256, or a layer group's key:
    `paged_kv.core.groups.rules.group_key`) under `namespace`. The group's number follows the
    chain's hex, so the groups' blocks of one prompt never share a store key.

    Examples
    --------
    >>> chain = bytes(range(32))
    >>> store_key("ns", chain + b"\\x02")[-6:], store_key("ns", chain)[-4:]
    ('1e1f02', '1e1f')
    """
    return f"{namespace}:{key[:CHAIN_BYTES].hex()[:KEY_HEX_CHARS]}{key[CHAIN_BYTES:].hex()}"


def header_key(key: bytes) -> bytes:
    """The 32 bytes the header carries for `key`: a chained key itself, a layer group's
    key (longer) by its sha256, so a value verifies only as the very group's block."""
    return key if len(key) == CHAIN_BYTES else hashlib.sha256(key).digest()


def checksum(payload: bytes | memoryview) -> tuple[int, int]:
    """``(kind, value)`` of `payload`: xxh3-64 when available, else CRC-32."""
    if xxhash is not None:
        return CHECK_XXH3, xxhash.xxh3_64_intdigest(payload)
    return CHECK_CRC32, zlib.crc32(payload)


def encode(key: bytes, digest: bytes, payload: bytes | memoryview) -> bytes:
    """The stored value of one block: header + payload.

    Parameters
    ----------
    key : bytes
        The block's full chained key (32 bytes), or a layer group's key (`header_key`).
    digest : bytes
        `Fingerprint.digest` of the writer.
    payload : bytes
        The block's bytes (`paged_kv.core.load_cached.read_blocks`: all layers, K and V, scales).
    """
    kind, value = checksum(payload)
    return b"".join((HEADER.pack(MAGIC, VERSION, kind, header_key(key), digest, len(payload),
                                 value),
                     payload))  # one copy of the payload


def decode(value: bytes | None, key: bytes, digest: bytes, payload_len: int,
           ) -> memoryview | None:
    """The payload of `value` when it is the block `key` of fingerprint `digest` with
    `payload_len` bytes and an intact checksum; None otherwise (a miss), whatever `value`
    holds: empty, shorter than the header, or any other bytes."""
    if value is None or len(value) < HEADER.size:  # empty (a power cut) or a cut header
        return None
    if len(value) != HEADER.size + payload_len:
        return None
    magic, version, kind, stored_key, stored_digest, length, value_sum = HEADER.unpack_from(
        value)
    if (magic, version, stored_key, stored_digest, length) != (MAGIC, VERSION, header_key(key),
                                                               digest, payload_len):
        return None
    payload = memoryview(value)[HEADER.size:]
    if kind == CHECK_XXH3:
        if xxhash is None:
            return None  # cannot verify: a miss, never served unchecked
        ok = xxhash.xxh3_64_intdigest(payload) == value_sum
    elif kind == CHECK_CRC32:
        ok = zlib.crc32(payload) == value_sum
    else:
        ok = False
    return payload if ok else None

