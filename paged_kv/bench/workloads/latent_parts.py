"""The latent workload's measurements (see `latent`, which judges them against their targets
and writes the report): bytes per token and sequences per pool from the cache's own
accounting, and the engine's speed on a tiny random DeepSeek V3 checkpoint against
transformers' ``generate`` on it and against a per-head twin, tokens checked equal first.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from ... import CacheConfig
from ..scale import Scale
from ..timing import Figure, Stat
from .hybrid import check_same_tokens

BLOCK = 16
# the tiny checkpoint: the test's latent dims (rank 16, rope 8, nope 16, values 16) with
# 16 heads, so the per-head K/V a head count like a real model's costs is in the ratio
RANK, ROPE, NOPE, VALUE, HEADS, LAYERS, HIDDEN = 16, 8, 16, 16, 16, 2, 128
TEST_HEADS = 4  # tests/engine/test_latent_models.py's
# DeepSeek V3: 61 layers, 128 heads, rank 512 + rope 64, keys 192 (128 + 64), values 128
V3 = dict(layers=61, heads=128, rank=512, rope=64, nope=128, value=128)
PROMPTS = 4  # sequences of the speed runs
ENGINE, GENERATE, TWIN = ("engine, latent pages", "transformers generate (per-head K/V)",
                          "engine, per-head pages (Llama twin)")


def sizes_for(scale: Scale) -> dict:
    """Context of the decode runs, decoded tokens, the short comparison's lengths, repeats."""
    quick = scale.name == "quick"
    return dict(context=256 if quick else 1024, decode=24 if quick else 64,
                short_prompt=48, short_new=8, repeats=1 if quick else 3, pool_mib=64)


def per_token_values(heads: int, rope: int, nope: int, value: int, rank: int) -> tuple[int, int]:
    """Values a token keeps per layer: per-head K/V (``heads x (nope + rope + value)``) and
    the latent (``rank + rope``)."""
    return heads * (nope + rope + value), rank + rope


def _configs(heads: int, layers: int, dtype: torch.dtype, pool: int, **dims: int,
             ) -> tuple[CacheConfig, CacheConfig]:
    """The latent layout (one kv head of (R + P) / 2 values, as `HFCausalLM` pages it) and
    per-head K/V of the same model as a cache of ``heads`` kv heads of (qk + v) / 2 values
    (the same bytes as K of qk and V of v), each sized by `CacheConfig.for_memory`."""
    per_head, latent = per_token_values(heads, **dims)
    common = dict(num_layers=layers, dtype=dtype, block_size=BLOCK)
    return (CacheConfig.for_memory(pool, num_kv_heads=1, head_dim=latent // 2, **common),
            CacheConfig.for_memory(pool, num_kv_heads=heads, head_dim=per_head // heads // 2,
                                   **common))


def capacity_figures(sizes: dict, runner_bytes: int | None) -> tuple[list[Figure], dict]:
    """Bytes per token (the bench's 16-head shape, the test's 4-head one, DeepSeek V3's) and
    sequences a pool holds, latent against per-head K/V."""
    tiny = dict(rope=ROPE, nope=NOPE, value=VALUE, rank=RANK)
    v3 = {k: V3[k] for k in ("rope", "nope", "value", "rank")}
    cases = (("tiny DeepSeek V3, 16 heads, float32", HEADS, LAYERS, torch.float32,
              sizes["pool_mib"] << 20, tiny, 1024),
             ("tiny DeepSeek V3, 4 heads (the test's), float32", TEST_HEADS, LAYERS,
              torch.float32, sizes["pool_mib"] << 20, tiny, 1024),
             ("DeepSeek V3 (61 layers, 128 heads), bfloat16", V3["heads"], V3["layers"],
              torch.bfloat16, 80 << 30, v3, 4096))
    figures, info = [], {}
    for label, heads, layers, dtype, pool, dims, context in cases:
        latent, per_head = _configs(heads, layers, dtype, pool, **dims)
        values = per_token_values(heads, **dims)
        figures.append(Figure(f"bytes per token, {label}", Stat((latent.bytes_per_token,), "B"),
                              "per-head K/V", Stat((per_head.bytes_per_token,), "B"), False))
        seqs = [c.num_usable_blocks // -(-context // BLOCK) for c in (latent, per_head)]
        where = f"{pool >> 30} GiB" if pool >= 1 << 30 else f"{pool >> 20} MiB"
        figures.append(Figure(f"{context}-token sequences per {where} pool, "
                              f"{label}", Stat((seqs[0],), "seqs"), "per-head K/V",
                              Stat((seqs[1],), "seqs"), True))
        info[f"values per token and layer, {label}"] = f"{values[1]} latent, {values[0]} " \
                                                       f"per-head"
    if runner_bytes is not None:  # the engine's own pool, not the arithmetic
        info["bytes per token of HFCausalLM's pool, tiny DeepSeek V3 (16 heads)"] = runner_bytes
    return figures, info


def deepseek_config():
    """The tiny DeepSeek V3 (`HEADS` heads, the test's latent dims, dense layers, a query
    LoRA and interleaved rope as V3's defaults); no EOS, wide random logits."""
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        kv_lora_rank=RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VALUE,
        q_lora_rank=32, max_position_embeddings=4096, initializer_range=0.3,
        first_k_dense_replace=LAYERS, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_group=1, topk_group=1, bos_token_id=None,
        eos_token_id=None, pad_token_id=0)


def twin_config():
    """A Llama of the same hidden size, layers, heads and MLP whose per-head K/V (head_dim
    20: K 20 + V 20) are the bytes DeepSeek's per-head K (24) + V (16) take."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=512, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        head_dim=(NOPE + ROPE + VALUE) // 2, max_position_embeddings=4096,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=0)


def save(workdir: Path) -> dict[str, Path]:
    """Both checkpoints (seed 0) under `workdir`."""
    import transformers

    paths = {}
    for name, config in (("deepseek_v3", deepseek_config()), ("llama", twin_config())):
        torch.manual_seed(0)
        paths[name] = workdir / name
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(paths[name])
    return paths


def engine_for(path: Path, tokens: int):
    """An `Engine` on `HFCausalLM` with blocks for `PROMPTS` sequences of `tokens`."""
    from ...engine import Engine
    from ...engine.config import EngineConfig
    from ...engine.hf import HFCausalLM

    runner = HFCausalLM.from_pretrained(path)
    blocks = PROMPTS * -(-tokens // BLOCK) + 1
    return Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=blocks,
                                                                 block_size=BLOCK),
                                       max_num_seqs=PROMPTS, max_num_batched_tokens=4096,
                                       num_threads=torch.get_num_threads()))


def run_engine(engine, ids: torch.Tensor, new: int) -> tuple[float, list[list[int]]]:
    """Seconds and tokens of `new` greedy tokens after each row of `ids` on `engine`."""
    from ...engine import SamplingParams

    start = time.perf_counter()
    outputs = engine.generate(ids.tolist(), SamplingParams(max_tokens=new, ignore_eos=True))
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def run_generate(model, ids: torch.Tensor, new: int) -> tuple[float, list[list[int]]]:
    """Seconds and tokens of transformers' greedy ``generate`` of `new` tokens after `ids`."""
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()


def decode_rate(run, ids: tuple[torch.Tensor, torch.Tensor], new: int,
                ) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of `run` (`run_engine` or `run_generate` with its model bound): (time
    of 1 + `new` tokens - time of 1 token, prompts of the same length) over `new` x batch,
    and the tokens of the long run. Two prompt sets: the same prompts twice would hit the
    engine's prefix cache."""
    first, _ = run(ids[0], 1)
    full, tokens = run(ids[1], 1 + new)
    return new * ids[1].shape[0] / max(full - first, 1e-9), tokens


def speed_figures(sizes: dict, workdir: Path) -> tuple[list[Figure], dict]:
    """Decode tokens/s at long context (latent pages against ``generate``'s per-head K/V on
    the same checkpoint, and against the per-head Llama twin in the engine) and end-to-end
    tokens/s against ``generate`` at a short context; fresh prompts each repeat."""
    import transformers

    paths = save(workdir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        paths["deepseek_v3"], dtype=torch.float32, attn_implementation="eager").eval()
    tokens = sizes["context"] + sizes["decode"] + 1
    speeds: dict[str, list[float]] = {ENGINE: [], GENERATE: [], TWIN: [], "short engine": [],
                                      "short generate": []}
    with engine_for(paths["deepseek_v3"], tokens) as latent, \
            engine_for(paths["llama"], tokens) as twin:
        runner_bytes = latent.cache.config.bytes_per_token
        for repeat in range(sizes["repeats"] + 1):  # the first is a warm-up
            generator = torch.Generator().manual_seed(100 + repeat)
            ids = [torch.randint(1, 512, (PROMPTS, sizes["context"]), generator=generator)
                   for _ in range(3)]
            rates, ours = decode_rate(functools.partial(run_engine, latent), ids[:2],
                                      sizes["decode"])
            rates = {"engine": rates, "twin": decode_rate(functools.partial(run_engine, twin),
                                                          ids[1:], sizes["decode"])[0]}
            # generate keeps no prefix cache: its 1-token run takes the long run's prompts
            rates["generate"], theirs = decode_rate(functools.partial(run_generate, model),
                                                    (ids[1], ids[1]), sizes["decode"])
            check_same_tokens(ours, theirs, "deepseek_v3: generate, long context")
            short = torch.randint(1, 512, (PROMPTS, sizes["short_prompt"]), generator=generator)
            runs = {"engine": run_engine(latent, short, sizes["short_new"]),
                    "generate": run_generate(model, short, sizes["short_new"])}
            check_same_tokens(runs["engine"][1], runs["generate"][1], "deepseek_v3: generate")
            if repeat:
                for name, key in ((ENGINE, "engine"), (GENERATE, "generate"), (TWIN, "twin")):
                    speeds[name].append(rates[key])
                for key in ("engine", "generate"):
                    speeds[f"short {key}"].append(PROMPTS * sizes["short_new"] / runs[key][0])
    return _speed_figures(sizes, speeds), {
        "bytes per token of HFCausalLM's pool, tiny DeepSeek V3 (16 heads)": runner_bytes,
        "tiny DeepSeek V3: tokens checked equal to generate (repeats, warm-up included)":
            f"{sizes['repeats'] + 1} x {PROMPTS} prompts x ({sizes['decode'] + 1} + "
            f"{sizes['short_new']}) tokens"}


def _speed_figures(sizes: dict, speeds: dict[str, list[float]]) -> list[Figure]:
    """The three speed figures of `speed_figures`' repeats."""
    def stat(name: str) -> Stat:
        return Stat(tuple(speeds[name]), "tokens/s")

    label = f"decode tokens/s at {sizes['context']} tokens, {PROMPTS} seqs"
    return [Figure(f"{label}, latent pages vs generate, tokens equal", stat(ENGINE), GENERATE,
                   stat(GENERATE), True),
            Figure(f"{label}, latent pages vs per-head pages", stat(ENGINE), TWIN, stat(TWIN),
                   True),
            Figure(f"engine vs generate, {PROMPTS} prompts of {sizes['short_prompt']} + "
                   f"{sizes['short_new']} tokens, tokens equal", stat("short engine"),
                   "transformers generate", stat("short generate"), True)]
