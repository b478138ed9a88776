"""Parsing and validating token ids and a step's ``{seq_id: tokens or count}`` mapping."""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from itertools import chain
from typing import NamedTuple

import numpy as np
import torch

from ..._checks import read_only
from ..batch import RowNames, SeqId
from ..page_table import PageTables

MAX_TOKEN_ID = 2**31 - 1
_pack = struct.pack


def tokens_to_array(name: str, token_ids: object) -> np.ndarray:
    """Token ids as an int32 array; TypeError / ValueError naming `name` otherwise."""
    if type(token_ids) is np.ndarray and token_ids.dtype == np.int32 and token_ids.ndim == 1 \
            and token_ids.size and token_ids.min() >= 0:
        return token_ids  # a sampler's ids as they come: in range unless negative
    if type(token_ids) is list:
        array = _int_list(token_ids)
        if array is not None:
            return array
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, str | bytes) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(token_ids).__name__}")
    array = np.asarray(token_ids)
    if array.size == 0:
        return np.empty(0, dtype=np.int32)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected a flat sequence of ints, got dtype {array.dtype} "
                        f"and shape {array.shape}")
    if array.min() < 0 or array.max() > MAX_TOKEN_ID:
        raise ValueError(f"{name}: token ids must be in [0, {MAX_TOKEN_ID}], got "
                         f"min {array.min()} max {array.max()}")
    return array.astype(np.int32)


def _int_list(values: list) -> np.ndarray | None:
    """A non-empty list of ints in range as int32 (read-only), else None (the caller's
    general path then names the problem). `struct` converts and range-checks it in C at a
    third of `array`'s cost and under half numpy's (which infers a dtype, then casts); a
    leading bool is left to numpy, which rejects a list of bools."""
    if not values or type(values[0]) is bool:
        return None
    try:
        array = np.frombuffer(_pack(f"<{len(values)}i", *values), dtype=np.int32)
    except (struct.error, TypeError, OverflowError):
        return None
    return array if array.min() >= 0 else None


@functools.lru_cache(maxsize=1024)
def decode_columns(size: int, known: bool) -> tuple[np.ndarray, np.ndarray]:
    """A decode step's ``counts`` (ones) and ``has_ids`` for `size` rows, read-only and
    made once per batch size: a decode step should not allocate them every call."""
    return read_only(np.ones(size, dtype=np.int64)), read_only(np.full(size, known))


class Step(NamedTuple):
    """A validated `prepare` request: rows, counts, and the known token ids flattened (a
    tuple: a decode step builds one per call, and a tuple is the cheapest to build)."""

    seq_ids: tuple[SeqId, ...]
    rows: np.ndarray                # [B] int64
    counts: np.ndarray              # [B] int64 new tokens per sequence
    has_ids: np.ndarray             # [B] bool, token ids given (not just a count)
    token_ids: np.ndarray           # [sum(counts[has_ids])] int32

    @property
    def is_decode(self) -> bool:
        """One token per sequence, the ids of all known or of none."""
        if self.token_ids.size == self.rows.size:
            return bool(self.has_ids.all())
        return self.token_ids.size == 0 and bool((self.counts == 1).all())

    @property
    def token_rows(self) -> np.ndarray:
        return np.repeat(self.rows[self.has_ids], self.counts[self.has_ids])

    @property
    def rows_without_ids(self) -> np.ndarray:
        return self.rows[~self.has_ids]

    def token_positions(self, old_lens: np.ndarray) -> np.ndarray:
        """Position in its sequence of every known token."""
        counts = self.counts[self.has_ids]
        first = np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(old_lens[self.has_ids], counts) + np.arange(first.size) - first


def parse_step(new_tokens: Mapping[SeqId, object], tables: PageTables) -> Step:
    """Validate a `prepare` mapping against the page tables without changing anything."""
    if not isinstance(new_tokens, Mapping):
        raise TypeError(f"prepare(): expected a mapping of seq_id to tokens, "
                        f"got {type(new_tokens).__name__}")
    if not new_tokens:
        raise ValueError("prepare(): no sequences given; pass at least one")
    seq_ids = tuple(new_tokens)
    rows = _rows_of(seq_ids, tables)
    values = list(new_tokens.values())
    step = _parse_sequences(seq_ids, rows, values)
    return step if step is not None else _parse_mixed(seq_ids, rows, values)


def _rows_of(seq_ids: tuple, tables: PageTables) -> np.ndarray:
    try:
        rows = tables.rows_of(seq_ids)
    except KeyError as exc:
        raise KeyError(f"prepare(): unknown sequence {exc.args[0]!r}") from None
    swapped = tables.swapped[rows]
    if swapped.any():
        seq_id = seq_ids[int(swapped.argmax())]
        raise ValueError(f"prepare(): sequence {seq_id!r} is swapped out; swap_in() it first")
    return rows


def _parse_sequences(seq_ids: tuple, rows: np.ndarray, values: list) -> Step | None:
    """The common case, every sequence given as a sequence of int ids, in a few numpy calls;
    None sends anything else (counts, odd types, bad values) to the precise slow path."""
    if len(values) == 1 and type(values[0]) is list:  # a prompt: no flattening copy
        flat = values[0]
        lengths = [len(flat)]
    else:
        try:  # as many ids as sequences, none empty: one each (decode), no lengths list
            lengths = list(map(len, values)) if not all(map(len, values)) else None
            flat = list(chain.from_iterable(values))
        except TypeError:
            return None
        if lengths is None and len(flat) != len(values):
            lengths = list(map(len, values))
    if lengths is not None and (not lengths or min(lengths) < 1):
        return None
    token_ids = _int_list(flat)
    if token_ids is None:  # numpy's reading of odd values (a leading bool, ...)
        try:
            token_ids = np.array(flat)
        except ValueError:  # ragged nesting: let the slow path name the sequence
            return None
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu" or token_ids.size == 0:
            return None
        if token_ids.min() < 0 or token_ids.max() > MAX_TOKEN_ID:
            return None
        token_ids = token_ids.astype(np.int32)
    if lengths is None:  # a decode step: its columns made once per batch size
        return Step(seq_ids, rows, *decode_columns(len(values), True), token_ids)
    return Step(seq_ids, rows, np.array(lengths, dtype=np.int64), np.ones(len(rows), dtype=bool),
                token_ids)


def _parse_mixed(seq_ids: tuple, rows: np.ndarray, values: list) -> Step:
    counts = np.empty(len(values), dtype=np.int64)
    has_ids = np.empty(len(values), dtype=bool)
    arrays = []
    for i, (seq_id, value) in enumerate(zip(seq_ids, values, strict=True)):
        if isinstance(value, int | np.integer) and not isinstance(value, bool):
            counts[i], has_ids[i] = int(value), False
        else:
            array = tokens_to_array(f"prepare(): tokens of {seq_id!r}", value)
            counts[i], has_ids[i] = array.size, True
            arrays.append(array)
        if counts[i] < 1:
            got = f"{counts[i]} new tokens" if not has_ids[i] else "no new tokens"
            raise ValueError(f"prepare(): sequence {seq_id!r} has {got}; give at least one")
    token_ids = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int32)
    return Step(seq_ids, rows, counts, has_ids, token_ids)


def parse_rows(seq_ids: tuple | RowNames, rows: np.ndarray, counts: object,
               token_ids: object) -> Step:
    """Validate `prepare_decode`'s arrays with counts (the rows already resolved: `seq_ids`
    are theirs) without changing anything: ``[B]`` counts of at least one token each, and
    their ``[sum(counts)]`` token ids packed row after row."""
    counts = np.asarray(counts.numpy() if isinstance(counts, torch.Tensor) else counts)
    if counts.shape != rows.shape or counts.dtype.kind not in "iu":
        raise TypeError(f"prepare_decode(): counts: expected {rows.size} ints (one per row), "
                        f"got dtype {counts.dtype} and shape {counts.shape}")
    if counts.min() < 1:
        names = seq_ids if type(seq_ids) is tuple else seq_ids.resolve()  # `RowNames`
        seq_id = names[int(counts.argmin())]
        raise ValueError(f"prepare_decode(): sequence {seq_id!r} has {counts.min()} new tokens; "
                         f"give at least one")
    tokens = tokens_to_array("prepare_decode(): token_ids", token_ids)
    if tokens.size != counts.sum():
        raise ValueError(f"prepare_decode(): token_ids: expected {counts.sum()} (the counts' "
                         f"sum), got {tokens.size}")
    return Step(seq_ids, rows, counts.astype(np.int64), np.ones(rows.size, dtype=bool), tokens)
