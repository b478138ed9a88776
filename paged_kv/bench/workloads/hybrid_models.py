"""The hybrid workload's models: a Gemma-3-shaped and a gpt-oss-shaped decoder with random
weights, each as a pair — its hybrid layer kinds, and the same weights with every layer
full attention (the all-full layout's model).

With transformers installed each pair is two local checkpoints built here (never
downloaded): ``Gemma3ForCausalLM`` / ``GptOssForCausalLM`` with ``layer_types`` set, served
through `HFCausalLM`, so transformers' own ``generate`` can run the same checkpoint.
Without it, `TinyLlama` with the same layer kinds (and sinks) stands in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import torch

from ..scale import Scale

VOCAB = 1024
HIDDEN = 128
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 1, 32  # Gemma-3-270m's 4:1 grouping, a small head
INIT_RANGE = 0.3  # wide random logits: greedy choices are not decided by rounding


@dataclasses.dataclass(frozen=True)
class Shape:
    """A hybrid model shape: runs of ``full_every - 1`` sliding-window layers, each closed by
    one full-attention layer.

    Attributes
    ----------
    batch : int
        Sequences of the decode run (as many as the all-full pool holds).
    resident : bool
        Whether the short run that counts resident sequences is measured (else only the
        arithmetic of `CacheConfig.blocks_for_sequence` is reported).
    """

    name: str
    key: str
    num_layers: int
    window: int
    full_every: int
    sinks: bool
    batch: int
    resident: bool

    def is_full(self, layer: int) -> bool:
        """Whether `layer` is a full-attention layer."""
        return (layer + 1) % self.full_every == 0

    def window_at(self, scale: Scale) -> int:
        """The window at `scale`: divided with the context, so the ratios keep their size."""
        return self.window // scale.hybrid_window_divisor

    def kinds(self, scale: Scale) -> tuple[str, ...]:
        """`TinyLlamaConfig.layer_kinds` of the hybrid model."""
        return tuple("full" if self.is_full(layer) else f"sliding:{self.window_at(scale)}"
                     for layer in range(self.num_layers))


GEMMA3 = Shape("Gemma-3 shape (15 sliding + 3 full)", "gemma3", num_layers=18, window=512,
               full_every=6, sinks=False, batch=4, resident=True)
GPT_OSS = Shape("gpt-oss shape (sliding / full alternating, sinks)", "gpt-oss", num_layers=4,
                window=128, full_every=2, sinks=True, batch=2, resident=False)
SHAPES = (GEMMA3, GPT_OSS)


@dataclasses.dataclass
class ModelPair:
    """A shape's hybrid model and its all-full twin (same weights), ready for `Engine`;
    ``checkpoint`` is the hybrid model's directory (None for the TinyLlama stand-in)."""

    hybrid: torch.nn.Module
    all_full: torch.nn.Module
    checkpoint: Path | None
    description: str


def has_transformers() -> bool:
    """Whether the ``hf`` extra is installed (else TinyLlama stands in)."""
    return importlib.util.find_spec("transformers") is not None


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bar per checkpoint saved or loaded while the workload runs."""
    if not has_transformers():
        yield
        return
    from transformers.utils import logging

    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.enable_progress_bar()


def build_pair(shape: Shape, scale: Scale, workdir: Path) -> ModelPair:
    """`shape`'s pair at `scale`: two transformers checkpoints under `workdir` served
    through `HFCausalLM`, or two TinyLlamas without transformers."""
    if not has_transformers():
        return _tiny_pair(shape, scale)
    from ...engine.hf import HFCausalLM

    hybrid_dir, full_dir = save_checkpoints(shape, scale, workdir / shape.key)
    family = "GptOssForCausalLM (4 experts, 2 per token)" if shape.sinks else "Gemma3ForCausalLM"
    return ModelPair(HFCausalLM.from_pretrained(hybrid_dir), HFCausalLM.from_pretrained(full_dir),
                     hybrid_dir, f"transformers {family}, {_dims(shape)}")


def _dims(shape: Shape) -> str:
    return (f"{shape.num_layers} layers, hidden {HIDDEN}, {NUM_HEADS} query heads, "
            f"{NUM_KV_HEADS} KV head x {HEAD_DIM}, vocab {VOCAB}, float32, random weights")


def _tiny_pair(shape: Shape, scale: Scale) -> ModelPair:
    from ...engine import TinyLlama, TinyLlamaConfig

    common = dict(num_layers=shape.num_layers, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                  head_dim=HEAD_DIM, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                  vocab_size=VOCAB, max_position=2 * scale.hybrid_context, sinks=shape.sinks)
    # the layer kinds draw no weights: both models hold the same ones
    hybrid = TinyLlama(TinyLlamaConfig(layer_kinds=shape.kinds(scale), **common), seed=0)
    return ModelPair(hybrid, TinyLlama(TinyLlamaConfig(**common), seed=0), None,
                     f"TinyLlama (transformers is not installed), {_dims(shape)}")


def hf_config(shape: Shape, window: int, *, all_full: bool):
    """The transformers config of `shape`'s hybrid model, or of its all-full twin."""
    import transformers

    types = ["full_attention" if all_full or shape.is_full(layer) else "sliding_attention"
             for layer in range(shape.num_layers)]
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=shape.num_layers,
                  num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
                  head_dim=HEAD_DIM, sliding_window=window, layer_types=types,
                  initializer_range=INIT_RANGE, bos_token_id=None, eos_token_id=None,
                  pad_token_id=0)
    if shape.sinks:
        return transformers.GptOssConfig(intermediate_size=HIDDEN, num_local_experts=4,
                                         num_experts_per_tok=2, **common)
    return transformers.Gemma3TextConfig(intermediate_size=2 * HIDDEN,
                                         query_pre_attn_scalar=HEAD_DIM,
                                         tie_word_embeddings=False, **common)


def save_checkpoints(shape: Shape, scale: Scale, directory: Path) -> tuple[Path, Path]:
    """Save `shape`'s hybrid model (seed 0) and its all-full twin with the same weights;
    returns their directories. gpt-oss's sinks are drawn in [1, 4], large enough to take a
    real share of each softmax. No EOS: every request generates all its tokens."""
    import transformers

    torch.manual_seed(0)
    hybrid = transformers.AutoModelForCausalLM.from_config(
        hf_config(shape, shape.window_at(scale), all_full=False))
    for name, parameter in hybrid.named_parameters():
        if name.endswith(".sinks"):
            torch.nn.init.uniform_(parameter, 1.0, 4.0)
    full = transformers.AutoModelForCausalLM.from_config(
        hf_config(shape, shape.window_at(scale), all_full=True))
    full.load_state_dict(hybrid.state_dict())  # strict: every weight, the same values
    paths = directory / "hybrid", directory / "all-full"
    for model, path in zip((hybrid, full), paths, strict=True):
        model.generation_config = transformers.GenerationConfig(pad_token_id=0)
        model.save_pretrained(path)
    return paths
