"""The step plan on the wire: rank 0 packs one step (token ids, positions, logits rows, slot
mapping, block tables, sequence lengths, query starts, and the pool operations of the step:
copy-on-write copies, swap-outs and -ins) into one int64 tensor behind a fixed 8-entry
header; every rank unpacks it and replays the pool operations, in order, on its own pool.
A hybrid layout's step carries each further layer group's slots and block tables after the
operations (header entry 7 counts those groups).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from ...core.batch import StepBatch
from ...core.cache import PagedKVCache

HEADER = 8  # cmd, payload length, tokens, batch size, block-table width, logits rows, ops
CMD_STEP, CMD_STOP, CMD_INFO, CMD_POOL = 1, 2, 3, 4


def pack_step(token_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
              batch: StepBatch, ops: Sequence[tuple[int, np.ndarray, np.ndarray]],
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header [8], payload)`` int64 tensors of one step."""
    block_tables, num_blocks, _ = batch.host_arrays
    op_parts = []
    for kind, src, dst in ops:
        op_parts += [np.array([kind, src.size], dtype=np.int64), src.astype(np.int64),
                     dst.astype(np.int64)]
    parts = [token_ids.numpy(), positions.numpy(), logits_indices.numpy(),
             batch.slot_mapping.cpu().numpy(), block_tables.ravel(), num_blocks,
             batch.seq_lens.cpu().numpy(), batch.query_start_loc.cpu().numpy(), *op_parts]
    for group in batch.groups[1:]:  # a hybrid layout's other layer groups
        tables, blocks, _ = group.host_arrays
        parts += [np.array([tables.shape[1]]), group.slot_mapping.cpu().numpy(),
                  tables.ravel(), blocks]
    payload = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
    header = torch.tensor([CMD_STEP, payload.numel(), batch.num_tokens, batch.batch_size,
                           block_tables.shape[1], logits_indices.numel(), len(ops),
                           max(len(batch.groups) - 1, 0)])
    return header, payload


def unpack_step(header: torch.Tensor, payload: torch.Tensor, block_size: int,
                device: torch.device) -> tuple:
    """Inverse of `pack_step`: tokens, positions, logits rows, the batch, the pool ops."""
    _, _, num_tokens, size, width, num_logits, num_ops, num_groups = header.tolist()
    data = payload.numpy()
    cuts = np.cumsum([num_tokens, num_tokens, num_logits, num_tokens, size * width, size, size,
                      size + 1])
    tokens, positions, logits, slots, tables, num_blocks, seq_lens, starts, rest = \
        np.split(data, cuts)
    ops, at = [], 0
    for _ in range(num_ops):
        kind, count = int(rest[at]), int(rest[at + 1])
        ops.append((kind, rest[at + 2:at + 2 + count], rest[at + 2 + count:at + 2 + 2 * count]))
        at += 2 + 2 * count
    def group_batch(slots: np.ndarray, tables: np.ndarray, num_blocks: np.ndarray,
                    width: int) -> StepBatch:
        return StepBatch.from_host(
            tuple(range(size)), tables.reshape(size, width).astype(np.int32), num_blocks,
            seq_lens.astype(np.int32), starts.astype(np.int32), slots.copy(), num_tokens,
            int(np.diff(starts).max()), block_size, device)

    batches = [group_batch(slots, tables, num_blocks, width)]
    for _ in range(num_groups):
        width = int(rest[at])
        cuts = np.cumsum([at + 1, num_tokens, size * width, size])
        _, slots, tables, num_blocks, _ = np.split(rest, cuts)
        batches.append(group_batch(slots, tables, num_blocks, width))
        at = int(cuts[-1])
    batch = batches[0] if not num_groups else dataclasses.replace(batches[0],
                                                                    groups=tuple(batches))
    return (torch.from_numpy(tokens.copy()), torch.from_numpy(positions.copy()),
            torch.from_numpy(logits.copy()), batch, ops)


def apply_ops(cache: PagedKVCache, ops: Sequence[tuple[int, np.ndarray, np.ndarray]]) -> None:
    """Replay rank 0's pool operations on this rank's pool (same block ids)."""
    cache.pool.replay_ops(list(ops))
