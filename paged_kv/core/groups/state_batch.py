"""`StateBatch`: a step's recurrent-state entry in its `StepBatch`: which slot each row
reads and writes its states in, and where the step saves checkpoints (`StateSlots`, in
`paged_kv.core.groups.state`, chooses both)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class StateBatch:
    """A step's recurrent-state entry in ``StepBatch.groups`` (at the state group's index).

    Attributes
    ----------
    slots : torch.Tensor
        ``[B]`` int64 live slot of each row, in the step's row order: a layer reads its
        initial states there and writes its final states back.
    emit_tokens : torch.Tensor
        ``[E]`` int64 index, in the step's packed token order, of each token after which a
        checkpoint is saved (the last token of a block that filled in the step).
    emit_slots : torch.Tensor
        ``[E]`` int64 the checkpoint slot each of those states goes to.
    """

    slots: torch.Tensor
    emit_tokens: torch.Tensor
    emit_slots: torch.Tensor

    @property
    def batch_size(self) -> int:
        """Rows of the step."""
        return self.slots.shape[0]

    @property
    def num_emitted(self) -> int:
        """States the step saves as checkpoints (``E``)."""
        return self.emit_slots.shape[0]
