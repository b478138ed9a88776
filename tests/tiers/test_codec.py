"""`codec`: a value verifies only when every header field is the reader's and the checksum
is right; any other bytes (foreign, cut, empty) are a miss, and decoding never raises."""

from __future__ import annotations

import random
import zlib

import pytest

from paged_kv.tiers import codec

KEY, DIGEST = bytes(range(32)), bytes(range(100, 116))
PAYLOAD = random.Random(0).randbytes(1000)


def value_with(**fields) -> bytes:
    """An encoded block of `PAYLOAD` (checksum right) whose header has `fields` changed."""
    kind, checksum = codec.checksum(PAYLOAD)
    header = dict(magic=codec.MAGIC, version=codec.VERSION, kind=kind, key=KEY, digest=DIGEST,
                  length=len(PAYLOAD), checksum=checksum)
    header.update(fields)
    return codec.HEADER.pack(*header.values()) + PAYLOAD


def test_the_header_is_72_bytes_as_documented():
    assert codec.HEADER.size == 72
    assert "72 bytes" in codec.__doc__


def test_an_intact_value_decodes():
    value = codec.encode(KEY, DIGEST, PAYLOAD)
    assert value == value_with()
    assert bytes(codec.decode(value, KEY, DIGEST, len(PAYLOAD))) == PAYLOAD


@pytest.mark.parametrize("field", [
    {"magic": b"PKVC"},
    {"version": codec.VERSION + 1},
    {"kind": 7},  # a checksum kind this reader does not know
    {"key": bytes(32)},  # another block's value under this block's store key
    {"digest": bytes(16)},  # another model's value (another fingerprint) under our key
    {"length": len(PAYLOAD) - 1},
    {"checksum": 0},
])
def test_every_header_field_is_checked(field):
    assert codec.decode(value_with(**field), KEY, DIGEST, len(PAYLOAD)) is None


def test_a_crc32_value_verifies_too():
    value = value_with(kind=codec.CHECK_CRC32, checksum=zlib.crc32(PAYLOAD))
    assert bytes(codec.decode(value, KEY, DIGEST, len(PAYLOAD))) == PAYLOAD
    value = value_with(kind=codec.CHECK_CRC32, checksum=zlib.crc32(PAYLOAD) ^ 1)
    assert codec.decode(value, KEY, DIGEST, len(PAYLOAD)) is None


def test_values_of_every_length_are_misses_never_errors():
    intact = codec.encode(KEY, DIGEST, PAYLOAD)
    for length in [*range(0, codec.HEADER.size + 2), len(intact) - 1, len(intact) + 1]:
        cut = intact[:length] if length <= len(intact) else intact + b"\0"
        assert codec.decode(cut, KEY, DIGEST, len(PAYLOAD)) is None, length
        # a reader expecting a payload as short as the cut value is not fooled either
        for payload_len in (0, max(0, length - codec.HEADER.size)):
            assert codec.decode(cut, KEY, DIGEST, payload_len) is None, (length, payload_len)
    assert codec.decode(None, KEY, DIGEST, len(PAYLOAD)) is None
