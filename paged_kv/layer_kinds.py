"""The kinds of layers a cache holds (`LayerKind`, with `StateSpec` for a recurrent
layer's state) and how a model's layers group by kind (`group_layers`): the vocabulary
`paged_kv.config.CacheConfig` describes a model's layers in, re-exported there."""

from __future__ import annotations

import dataclasses
import math

import torch

ATTENTION_KINDS = ("full", "sliding", "chunked", "recurrent")
NO_RECURRENT_ONLY = ("a model of recurrent layers only is not supported yet: an attention "
                     "group leads the prefix cache")


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One state a recurrent layer keeps per sequence (`LayerKind.recurrent`).

    Attributes
    ----------
    name : str
        ``"conv"`` (the convolution window, transformers' ``conv_states``), ``"ssm"`` (a
        Mamba selective-scan state) or ``"recurrent"`` (a gated delta rule's key-value
        memory); both of the latter are transformers' ``recurrent_states``
        (`paged_kv.integrations.recurrent.CACHE_ATTRIBUTES`).
    shape : tuple of int
        Per sequence, without the batch dim: ``(channels, kernel)`` for ``"conv"``,
        ``(heads, head_dim, state)`` for Mamba-2, ``(intermediate, state)`` for Mamba-1,
        ``(value_heads, key_head_dim, value_head_dim)`` for a gated delta rule.
    dtype : torch.dtype
        What the state is kept in (transformers' choice: the conv window in the model's
        dtype, the SSM / delta-rule state in float32).

    Examples
    --------
    >>> StateSpec("ssm", (4, 16, 6), torch.float32).nbytes  # 4 * 16 * 6 * 4 bytes
    1536
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"StateSpec.name: expected a non-empty str, got {self.name!r}")
        shape = self.shape
        if not isinstance(shape, tuple | list) or not shape or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
            raise ValueError(f"StateSpec.shape: expected a tuple of ints >= 1, got {shape!r}")
        object.__setattr__(self, "shape", tuple(shape))
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"StateSpec.dtype: expected a torch.dtype, got {self.dtype!r}")

    @property
    def numel(self) -> int:
        """Elements per sequence."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes per sequence."""
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What one layer reads of the past, which decides what the cache keeps.

    Parameters
    ----------
    attention : str
        ``"full"``: every earlier token. ``"sliding"``: the last `span` tokens, itself
        included (a query at position ``i`` sees keys ``j`` with ``i - span < j <= i``;
        Mistral, Gemma's local layers, gpt-oss). ``"chunked"``: the earlier tokens of its
        own chunk of `span` (``j // span == i // span``; Llama 4's local layers).
        ``"recurrent"``: no attention; the layer carries a fixed-size state per sequence
        from token to token (Mamba, a gated delta net, a short convolution), described by
        `states`.
    span : int
        The window or chunk length in tokens (>= 1); 0 for full attention and recurrent
        layers.
    states : tuple of StateSpec
        A recurrent layer's states (at least one); empty for every attention kind.

    Examples
    --------
    >>> LayerKind.sliding(512).window, LayerKind.chunked(8192).chunk, LayerKind().is_full
    (512, 8192, True)
    >>> mamba = LayerKind.recurrent((StateSpec("conv", (96, 4), torch.bfloat16),
    ...                              StateSpec("ssm", (4, 16, 8), torch.float32)))
    >>> str(mamba), mamba.is_recurrent, mamba.state_bytes  # 96 * 4 * 2 + 4 * 16 * 8 * 4
    ('recurrent', True, 2816)
    """

    attention: str = "full"
    span: int = 0
    states: tuple[StateSpec, ...] = ()

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"LayerKind.attention: expected one of {ATTENTION_KINDS}, "
                             f"got {self.attention!r}")
        if isinstance(self.span, bool) or not isinstance(self.span, int):
            raise ValueError(f"LayerKind.span: expected an int, got {self.span!r}")
        if self.attention == "full" and self.span:
            raise ValueError(f"LayerKind.span: full attention has no span, got {self.span}")
        if self.attention == "recurrent":
            self._check_states()
        elif self.attention != "full" and self.span < 1:
            raise ValueError(f"LayerKind.span: a {self.attention} layer needs a span >= 1, "
                             f"got {self.span}")
        if self.attention != "recurrent" and self.states:
            raise ValueError(f"LayerKind.states: a {self.attention} attention layer keeps "
                             f"no recurrent state, got {self.states!r}")

    def _check_states(self) -> None:
        if self.span:
            raise ValueError(f"LayerKind.span: a recurrent layer has no span, got {self.span}")
        states = self.states
        if not isinstance(states, tuple | list) or not states or not all(
                isinstance(spec, StateSpec) for spec in states):
            raise ValueError(f"LayerKind.states: a recurrent layer needs a tuple of at least "
                             f"one StateSpec, got {states!r}")
        object.__setattr__(self, "states", tuple(states))

    @classmethod
    def full(cls) -> LayerKind:
        """Attention to every earlier token."""
        return cls()

    @classmethod
    def sliding(cls, window: int) -> LayerKind:
        """A sliding window of `window` tokens (the query's own included)."""
        return cls("sliding", window)

    @classmethod
    def chunked(cls, chunk: int) -> LayerKind:
        """Local attention inside aligned chunks of `chunk` tokens."""
        return cls("chunked", chunk)

    @classmethod
    def recurrent(cls, states: tuple[StateSpec, ...]) -> LayerKind:
        """A recurrent layer keeping `states` per sequence (a slot of the state slab)."""
        return cls("recurrent", 0, tuple(states))

    @property
    def is_recurrent(self) -> bool:
        """Whether the layer keeps a recurrent state instead of K/V per token."""
        return self.attention == "recurrent"

    @property
    def state_bytes(self) -> int:
        """Bytes of the layer's states per sequence (0 for an attention layer)."""
        return sum(spec.nbytes for spec in self.states)

    @property
    def is_full(self) -> bool:
        """Whether the layer reads the whole past."""
        return self.attention == "full"

    @property
    def window(self) -> int:
        """The sliding window in tokens (0 unless sliding)."""
        return self.span if self.attention == "sliding" else 0

    @property
    def chunk(self) -> int:
        """The chunk in tokens (0 unless chunked)."""
        return self.span if self.attention == "chunked" else 0

    def __str__(self) -> str:
        if self.is_full or self.is_recurrent:
            return self.attention
        return f"{self.attention}:{self.span}"


def group_layers(kinds: tuple[LayerKind, ...]) -> tuple[tuple[LayerKind, tuple[int, ...]], ...]:
    """Split layers into groups of one kind and one size, full-attention groups first, and
    the recurrent layers, if any, in one last group.

    Every attention group has as many layers as the rarest attention kind (vLLM's rule):
    then one block of any group has the same bytes, one pool serves them all, and each
    group gets its own block table (a window group's table gives back the blocks its window
    has left). A kind whose count is not a multiple of that size gets a last group with
    fewer real layers; its missing layers' planes are padding (``group_size`` per block
    still). Recurrent layers hold no blocks (their states are slots of the state slab), so
    they neither count towards that size nor split: one state group of all of them, its
    kind the first recurrent layer's. An attention group leads (it hashes the prompts and
    leads the prefix cache), so a layout of recurrent layers alone is refused.

    Examples
    --------
    >>> w, f = LayerKind.sliding(512), LayerKind.full()
    >>> [(str(kind), layers) for kind, layers in group_layers((w, w, f, w, w, f))]
    [('full', (2, 5)), ('sliding:512', (0, 1)), ('sliding:512', (3, 4))]
    >>> r = LayerKind.recurrent((StateSpec("ssm", (2, 4), torch.float32),))
    >>> [(str(kind), layers) for kind, layers in group_layers((r, r, r, f, r, r, r, f))]
    [('full', (3, 7)), ('recurrent', (0, 1, 2, 4, 5, 6))]
    """
    by_kind: dict[LayerKind, list[int]] = {}
    recurrent = tuple(layer for layer, kind in enumerate(kinds) if kind.is_recurrent)
    for layer, kind in enumerate(kinds):
        if not kind.is_recurrent:
            by_kind.setdefault(kind, []).append(layer)
    if not by_kind:
        raise ValueError(NO_RECURRENT_ONLY)
    size = min(map(len, by_kind.values()))
    order = sorted(by_kind, key=lambda kind: not kind.is_full)  # stable: first seen first
    groups = tuple((kind, tuple(by_kind[kind][start:start + size])) for kind in order
                   for start in range(0, len(by_kind[kind]), size))
    return groups + (((kinds[recurrent[0]], recurrent),) if recurrent else ())
