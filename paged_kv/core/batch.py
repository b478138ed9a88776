"""`StepBatch`: one step's page table in the forms kernels read, built once per step (and
`sequence_tables`, the same forms of sequences as they are now, for a gather).

Built by the cache's step commit from host arrays and shipped to the device once; every
layer's write, gather and attention reuse it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from .._checks import require_resident

SeqId = Hashable


class RowNames:
    """The sequence ids of a step's rows, looked up when first read: a decode step's batch
    carries them, but few consumers read them, and the tuple costs ~5 us at B = 256.

    Parameters
    ----------
    rows : np.ndarray
        ``[B]`` int64 rows.
    names : tuple
        Sequence id of every row when the step ran (a snapshot: rows are reused).
    """

    __slots__ = ("_names", "_rows")

    def __init__(self, rows: np.ndarray, names: tuple) -> None:
        self._rows, self._names = rows, names

    def __len__(self) -> int:
        return self._rows.size

    def resolve(self) -> tuple[SeqId, ...]:
        """The ids, in the order of the rows."""
        return tuple(map(self._names.__getitem__, self._rows.tolist()))


@dataclasses.dataclass(frozen=True, slots=True)
class StepBatch:
    """Everything kernels need for one step, built once by `prepare` and reused by every layer.

    Attributes
    ----------
    seq_ids : tuple
        ``B`` sequences, in the order of their rows and tokens (a decode step's are looked
        up on first read).
    slot_mapping : torch.Tensor
        ``[num_tokens]`` int64 slot of each new token (-1 = skip).
    block_tables : torch.Tensor
        ``[B, max_blocks]`` int32 block ids; padding entries are the null block 0. With
        `CacheConfig.reuse_block_tables` a decode step's is the cache's kept table, which
        the next step updates in place: valid until then (`paged_kv.core.step_table`).
    seq_lens : torch.Tensor
        ``[B]`` int32 tokens per sequence after this step.
    query_start_loc : torch.Tensor
        ``[B + 1]`` int32 offsets of each sequence's new tokens.
    num_tokens, max_seq_len, max_query_len : int
        Totals, kept as Python ints so no kernel launch needs a device sync.
    kv_indptr, kv_indices, kv_last_page_len : torch.Tensor
        FlashInfer's CSR page table: ``[B + 1]``, ``[sum of blocks]``, ``[B]`` int32; built
        on first access (most steps never need them, and they cost a pass over all blocks).
    """

    _seq_ids: tuple[SeqId, ...] | RowNames
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_tokens: int
    max_seq_len: int
    max_query_len: int
    block_size: int
    _host: tuple[np.ndarray, np.ndarray, np.ndarray]  # block tables, num blocks, seq lens
    _csr: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)
    # a hybrid layout's step: one batch per layer group (each its own block tables and
    # slots), this one being the first group's; empty on a uniform cache's fast path
    groups: tuple = dataclasses.field(default=(), repr=False)

    @property
    def host_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The host copies the batch was built from: ``[B, max_blocks]`` block tables and
        ``[B]`` block counts and lengths (numpy; no device sync to read them)."""
        return self._host

    @property
    def seq_ids(self) -> tuple[SeqId, ...]:
        """``B`` sequences, in the order of their rows and tokens."""
        seq_ids = self._seq_ids
        if type(seq_ids) is not tuple:
            seq_ids = seq_ids.resolve()
            object.__setattr__(self, "_seq_ids", seq_ids)  # looked up once
        return seq_ids

    @property
    def batch_size(self) -> int:
        """Sequences in the step."""
        return len(self._host[1])

    @property
    def kv_indptr(self) -> torch.Tensor:
        """``[B + 1]`` int32 offsets of each sequence's blocks in `kv_indices`."""
        return self._flashinfer_form()["kv_indptr"]

    @property
    def kv_indices(self) -> torch.Tensor:
        """``[sum of blocks]`` int32 block ids of all sequences, concatenated."""
        return self._flashinfer_form()["kv_indices"]

    @property
    def kv_last_page_len(self) -> torch.Tensor:
        """``[B]`` int32 tokens in each sequence's last block."""
        return self._flashinfer_form()["kv_last_page_len"]

    def _flashinfer_form(self) -> dict[str, torch.Tensor]:
        if not self._csr:
            block_tables, num_blocks, seq_lens = self._host
            kv_indptr = np.zeros(len(num_blocks) + 1, dtype=np.int32)
            np.cumsum(num_blocks, out=kv_indptr[1:])
            in_use = np.arange(block_tables.shape[1]) < num_blocks[:, None]
            last_page_len = (seq_lens - 1) % self.block_size + 1
            device = self.block_tables.device
            for name, array in (("kv_indptr", kv_indptr), ("kv_indices", block_tables[in_use]),
                                ("kv_last_page_len", last_page_len)):
                self._csr[name] = torch.from_numpy(array.astype(np.int32)).to(device)
        return self._csr

    @classmethod
    def from_arrays(cls, seq_ids: Sequence[SeqId] | RowNames, block_tables: np.ndarray,
                    num_blocks: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                    block_size: int, device: torch.device) -> StepBatch:
        """Build a batch from plain arrays (host side), then ship it to `device` once.

        Parameters
        ----------
        block_tables : np.ndarray
            ``[B, max_blocks]`` int32, zero past each row's `num_blocks`.
        num_blocks, seq_lens, query_lens : np.ndarray
            ``[B]`` blocks, tokens after the step, and new tokens of each sequence.
        """
        batch_size = len(seq_ids)
        num_tokens = int(query_lens.sum())
        if num_tokens == batch_size:  # pure decode: one token per sequence
            query_start_loc = np.arange(batch_size + 1)
            token_row, positions = query_start_loc[:-1], seq_lens - 1
        else:
            query_start_loc = np.zeros(batch_size + 1, dtype=np.int64)
            np.cumsum(query_lens, out=query_start_loc[1:])
            # position of a token: its sequence's old length plus its rank in the step
            token_row = np.repeat(np.arange(batch_size), query_lens)
            positions = (np.arange(num_tokens) - query_start_loc[token_row]
                         + (seq_lens - query_lens)[token_row])
        slot_mapping = block_tables[token_row, positions // block_size] * block_size
        slot_mapping += positions % block_size
        return cls.from_host(seq_ids, block_tables, num_blocks, seq_lens, query_start_loc,
                             slot_mapping, num_tokens, int(query_lens.max()), block_size,
                             device)

    @classmethod
    def from_host(cls, seq_ids: tuple[SeqId, ...] | RowNames, block_tables: np.ndarray,
                  num_blocks: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray,
                  slot_mapping: np.ndarray, num_tokens: int, max_query_len: int,
                  block_size: int, device: torch.device, max_seq_len: int | None = None,
                  ) -> StepBatch:
        """Wrap finished host arrays (no copy on the CPU) and ship them to `device` once
        (`max_seq_len`: ``seq_lens.max()`` when the caller knows it already)."""
        # inline and positional: every step and admission builds one, ~8 us before
        from_numpy = torch.from_numpy
        tensors = (from_numpy(slot_mapping.astype(np.int64, copy=False)),
                   from_numpy(block_tables.astype(np.int32, copy=False)),
                   from_numpy(seq_lens.astype(np.int32, copy=False)),
                   from_numpy(query_start_loc.astype(np.int32, copy=False)))
        if device.type != "cpu":
            tensors = tuple(t.to(device, non_blocking=True) for t in tensors)
        return cls(seq_ids if type(seq_ids) is RowNames else tuple(seq_ids), *tensors,
                   num_tokens, int(seq_lens.max()) if max_seq_len is None else max_seq_len,
                   max_query_len, block_size, (block_tables, num_blocks, seq_lens))


BatchOrSeqIds = StepBatch | Sequence[SeqId]


def sequence_tables(tables, what: str, batch_or_seq_ids: BatchOrSeqIds, device: torch.device,
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block tables ``[B, W]``, lengths ``[B]`` and the longest length of a step's batch, or
    of resident sequences as they are now (`tables`, a `PageTables`, read only); TypeError /
    KeyError / ValueError naming `what` for anything else."""
    if isinstance(batch_or_seq_ids, StepBatch):
        # the batch's tensors describe its sequences as prepare() left them
        batch = batch_or_seq_ids
        return batch.block_tables, batch.seq_lens, batch.max_seq_len
    if isinstance(batch_or_seq_ids, str | bytes) or not isinstance(batch_or_seq_ids,
                                                                     Sequence):
        raise TypeError(f"{what}: expected a StepBatch or a list of sequence ids, "
                        f"got {type(batch_or_seq_ids).__name__}")
    seq_ids = batch_or_seq_ids
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"{what}: duplicate sequence ids in {list(seq_ids)!r}")
    for seq_id in seq_ids:
        require_resident(tables, what, seq_id)
    rows = np.array([tables.row_of[s] for s in seq_ids], dtype=np.int64)
    lengths = tables.num_tokens[rows]
    width = max(int(tables.num_blocks[rows].max()) if rows.size else 0, 1)
    block_tables = torch.from_numpy(tables.block_ids[rows, :width].copy()).to(device)
    seq_lens = torch.from_numpy(lengths.astype(np.int32)).to(device)
    return block_tables, seq_lens, int(lengths.max()) if rows.size else 0
