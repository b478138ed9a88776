"""`StateSlab`: the recurrent layers' state tensors, beside the block pool.

Per recurrent layer and per `StateSpec` one tensor ``[num_slots, *spec.shape]``, so slot
``s`` of every one of them is one sequence's states; which slot holds what is
`StateSlots`' bookkeeping (`paged_kv.core.groups.state`), which never touches a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..._checks import check_tensor
from ...config import StateSpec


class StateSlab:
    """The states' tensors: per recurrent layer and per `StateSpec` one tensor
    ``[num_slots, *spec.shape]`` of ``spec.dtype`` on `device`, zeros, allocated once.

    Parameters
    ----------
    specs : dict of int to tuple of StateSpec
        Each recurrent layer's states.
    num_slots : int
    device : torch.device
    """

    def __init__(self, specs: dict[int, tuple[StateSpec, ...]], num_slots: int,
                 device: torch.device) -> None:
        self.specs, self.device = specs, device
        self._tensors = {layer: tuple(torch.zeros((num_slots, *spec.shape), dtype=spec.dtype,
                                                  device=device) for spec in layer_specs)
                         for layer, layer_specs in specs.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor of the slab."""
        return sum(t.nbytes for tensors in self._tensors.values() for t in tensors)

    def tensors(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer `layer`'s tensors, ``[num_slots, *spec.shape]`` each, in its specs' order."""
        return self._tensors[layer]

    def copy(self, source: int, target: int) -> None:
        """Slot `target` of every tensor becomes a copy of slot `source`."""
        for tensors in self._tensors.values():
            for tensor in tensors:
                tensor[target].copy_(tensor[source])

    def zero(self, slot: int) -> None:
        """Slot `slot` of every tensor becomes the zero state (a sequence's start)."""
        for tensors in self._tensors.values():
            for tensor in tensors:
                tensor[slot].zero_()

    def save(self, slot: int) -> list[torch.Tensor]:
        """A host copy of slot `slot` of every tensor (a swapped-out sequence's state)."""
        return [tensor[slot].to("cpu", copy=True) for tensors in self._tensors.values()
                for tensor in tensors]

    def load(self, slot: int, saved: list[torch.Tensor]) -> None:
        """Slot `slot` of every tensor becomes `save`'s copy again."""
        every = [tensor for tensors in self._tensors.values() for tensor in tensors]
        for tensor, copy in zip(every, saved, strict=True):
            tensor[slot].copy_(copy)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot's states (every layer's, every spec's)."""
        return sum(t[0].nbytes for tensors in self._tensors.values() for t in tensors)

    def read_bytes(self, slot: int) -> torch.Tensor:
        """``[slot_nbytes]`` uint8 on the host: slot `slot`'s states, layer by layer and
        spec by spec (what `write_bytes` takes back)."""
        return torch.cat([tensor[slot].detach().reshape(-1).view(torch.uint8).cpu()
                          for tensors in self._tensors.values() for tensor in tensors])

    def write_bytes(self, slot: int, payload: torch.Tensor) -> None:
        """Slot `slot` of every tensor from `read_bytes`' ``[slot_nbytes]`` uint8."""
        start = 0
        for tensors in self._tensors.values():
            for tensor in tensors:
                view = tensor[slot].view(-1).view(torch.uint8)
                view.copy_(payload[start:start + view.numel()].to(tensor.device))
                start += view.numel()

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies of `layer`'s states at `slots` (``[B]`` int64): ``[B, *spec.shape]`` each."""
        return tuple(tensor.index_select(0, slots) for tensor in self._tensors[layer])

    def check_states(self, what: str, layer: int, states: object, count: int) -> None:
        """TypeError / ValueError naming `what` unless `states` is one tensor per spec of
        `layer`, ``[count, *spec.shape]`` of its dtype on the slab's device."""
        specs = self.specs[layer]
        if not isinstance(states, tuple | list) or len(states) != len(specs):
            got = (f"{len(states)} tensors" if isinstance(states, tuple | list)
                   else type(states).__name__)
            raise TypeError(f"{what}: expected a tuple of {len(specs)} tensors (layer "
                            f"{layer}'s states: {', '.join(s.name for s in specs)}), "
                            f"got {got}")
        for spec, tensor in zip(specs, states, strict=True):
            check_tensor(f"{what}[{spec.name!r}]", tensor, (count, *spec.shape),
                         dtype=spec.dtype, device=self.device)

    def write(self, layer: int, slots: torch.Tensor, states: Sequence[torch.Tensor]) -> None:
        """Scatter checked `states` (``[len(slots), *spec.shape]`` each) into `slots`."""
        for tensor, state in zip(self._tensors[layer], states, strict=True):
            tensor.index_copy_(0, slots, state)

    def snapshot(self) -> tuple[bytes, ...]:
        """Comparable bytes of every tensor (for tests of rejected calls)."""
        return tuple(bytes(t.detach().cpu().contiguous().view(torch.uint8).numpy())
                     for tensors in self._tensors.values() for t in tensors)
