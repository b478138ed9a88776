"""``--workloads latent``: DeepSeek-style latent pages against the same model's per-head K/V,
each figure against its target of issue 41.

1. Bytes per token: the latent row (``kv_lora_rank + qk_rope_head_dim`` values a layer, as
   `HFCausalLM` pages it) against per-head K/V (``heads x (qk_head_dim + v_head_dim)``), at
   the bench's tiny 16-head shape, the test's 4-head one and DeepSeek V3's (71x).
2. Sequences a pool of the same bytes holds, from `CacheConfig.for_memory`.
3. Decode tokens/s at long context on a tiny random DeepSeek V3 checkpoint: the engine on
   latent pages against transformers' ``generate`` (its cache keeps per-head K/V) on the
   same checkpoint, and against the engine on per-head pages of a Llama twin (same hidden
   size, layers, heads and MLP; head_dim 20, so K + V per head are DeepSeek's 24 + 16).
4. The engine against ``generate`` end to end at a short context.

Every speed's tokens are checked equal to ``generate``'s before it counts (parts 3-4);
`latent_parts` measures, this module judges and writes the report's text.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure
from . import latent_parts as parts
from .hybrid_models import quiet_transformers


def targets(figures: list[Figure]) -> dict[str, str]:
    """Each target of the issue, met or missed, with its figure (by name's start)."""
    def find(start: str) -> Figure | None:
        return next((f for f in figures if f.name.startswith(start)), None)

    tiny = find("bytes per token, tiny DeepSeek V3, 16 heads")
    test = find("bytes per token, tiny DeepSeek V3, 4 heads")
    v3 = find("bytes per token, DeepSeek V3")
    checks = {"bytes per token >= 8x fewer than per-head K/V (tiny 16-head shape)":
              (tiny.ratio >= 8, f"{tiny.ratio:.1f}x (the test's 4 heads: {test.ratio:.2f}x; "
                                f"DeepSeek V3's arithmetic: {v3.ratio:.1f}x)")}
    for start, name in (("decode tokens/s at", "vs generate (per-head K/V, same checkpoint)"),
                        ("decode tokens/s at", "vs per-head pages (Llama twin, engine)")):
        found = find(start) if "generate" in name else next(
            (f for f in figures if f.name.endswith("per-head pages")), None)
        if found is not None:
            checks[f"decode tokens/s at long context >= 1x, {name}"] = (
                found.ratio >= 1, f"{found.ratio:.2f}x ({found.value.median:.0f} against "
                                  f"{found.baseline.median:.0f} tokens/s)")
    return {f"target {name}": ("met" if ok else "MISSED") + f": {value}"
            for name, (ok, value) in checks.items()}


def run(scale: Scale) -> WorkloadResult:
    """Parts 1-4 (see the module docstring); each target's verdict in the facts."""
    sizes = parts.sizes_for(scale)
    figures, info = parts.capacity_figures(sizes, None)
    notes = list(NOTES)
    if importlib.util.find_spec("transformers") is None:
        notes.append("transformers is not installed: no model ran (parts 3-4).")
    else:
        with quiet_transformers(), tempfile.TemporaryDirectory() as workdir:
            more, found = parts.speed_figures(sizes, Path(workdir))
        figures += more
        info.update(found)
    info = {**targets(figures), **info}
    ratios = Plot("latent pages against per-head K/V", "", "ratio (> 1: latent better)",
                  (Series("ratio", tuple(f.name[:48] for f in figures),
                          tuple(f.ratio for f in figures)),), kind="bar")
    description = DESCRIPTION.format(
        heads=parts.HEADS, rank=parts.RANK, rope=parts.ROPE, nope=parts.NOPE,
        value=parts.VALUE, layers=parts.LAYERS, hidden=parts.HIDDEN, pool=sizes["pool_mib"],
        prompts=parts.PROMPTS, context=sizes["context"], decode=sizes["decode"],
        short=sizes["short_prompt"], short_new=sizes["short_new"], repeats=sizes["repeats"])
    return WorkloadResult("latent", "Latent pages: DeepSeek V3 against per-head K/V",
                          description, figures, info, plots=[ratios], notes=notes)


DESCRIPTION = (
    "Latent pages keep a token's latent row per layer (kv_lora_rank + qk_rope_head_dim "
    "values; HFCausalLM pages it as one kv head of half that in the K and V planes) where "
    "per-head K/V keep heads x (qk_nope + qk_rope + v) values. Parts 1-2 are the caches' own "
    "accounting (CacheConfig.for_memory, block size 16): the bench's tiny DeepSeek V3 "
    "({heads} heads, rank {rank}, rope {rope}, nope {nope}, values {value}, {layers} layers, "
    "float32) and the test's 4-head one in a {pool} MiB pool at 1,024 tokens, DeepSeek V3 "
    "(61 layers, 128 heads, rank 512 + rope 64, keys 192, values 128, bfloat16) in 80 GiB "
    "at 4,096 tokens. Parts 3-4 run that tiny checkpoint (hidden {hidden}, dense MLPs, query "
    "LoRA 32, interleaved rope, random weights, float32) through HFCausalLM: decode "
    "tokens/s of {prompts} prompts of {context} tokens = {decode} tokens x {prompts} over "
    "(time of 1 + {decode} tokens - time of 1 token), against transformers' generate "
    "(eager attention; its DynamicCache holds per-head K and V) and against the engine on "
    "a Llama twin with per-head pages of the same bytes; then {prompts} prompts of {short} "
    "+ {short_new} tokens end to end. {repeats} timed repeats after a warm-up, fresh prompts "
    "each, greedy tokens checked equal to generate's before any time counts.")
NOTES = [
    "Bytes per token are exact: 24 values a layer against 16 x (24 + 16) = 640 (26.7x) at "
    "the bench's shape; the test's 4 heads give 160 / 24 = 6.7x, below the issue's 8x, "
    "because a 4-head model has little per-head K/V to save. DeepSeek V3's 40,960 / 576 "
    "= 71x is the arithmetic at its real shape; sequences per pool follow the bytes (the "
    "few blocks a pool reserves move them a little).",
    "Decode speed at this size is set by per-step work and by the K/V the torch path reads "
    "each step: the absorbed form attends one latent head of (R + P) values a token where "
    "per-head pages read every head's K and V, against extra matmuls (q_nope W_UK per "
    "head, W_UV after attention); the longer the context, the more the bytes weigh. The "
    "engine against generate at a short context measures the engine's per-step bookkeeping "
    "on a model of hidden 128, not a kernel race. A GPU, where K/V reads bound decode, was "
    "not measured here.",
]
