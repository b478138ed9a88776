"""``--workloads hybrid``: models with sliding-window layers (and sinks) on the hybrid
layout against the same weights on the all-full layout: KV bytes per long sequence, how
many long sequences one pool holds, decode and prefill speed, and against transformers'
own ``generate`` on the same checkpoint (equal tokens first).

The baseline is the all-full twin of each model (`hybrid_models`): the same weights with
every layer full attention, on the engine's uniform layout. There is no "window masks,
every block kept" layout to compare with instead: ``PagedKVCache(config)`` with window
layers always builds the hybrid layout (window rows give their blocks back), and a model
refuses a cache whose layer kinds are not its own. So the twin is what a server that
ignores the windows pays (the engine before the layer kinds): every layer's blocks, and
attention over the whole past; its tokens differ from the hybrid model's, their count does
not (EOS is ignored).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat
from .hybrid_models import SHAPES, VOCAB, ModelPair, Shape, build_pair, quiet_transformers

BLOCK_SIZE = 16
BATCH_TOKENS = 2048  # max_num_batched_tokens of the full run: prefill chunks of this size
FULL_SEQS = 2  # the resident run's pool: this many all-full sequences
FIT_SEQS = 16  # the pool counted by arithmetic: large enough to resolve the ratio
GROWTH = 64  # tokens a sequence may generate in the resident run
GENERATE_PROMPTS, GENERATE_TOKENS = 4, 16
HYBRID = "hybrid layout"
ALL_FULL = "all-full layout (same weights, every layer full attention)"
ENGINE, GENERATE = "paged_kv Engine", "transformers generate (eager, greedy)"
NOTE_CHUNK = (
    "Resident sequences stay below the arithmetic because a window group holds the blocks of "
    "a whole prefill chunk during its step (blocks_for_sequence(n, chunk): the window plus "
    "the chunk), given back only before the next step: the last sequence admitted needs "
    "that much room, the decoding ones only their window.")
DESCRIPTION = (
    "Two random-weight models with hybrid layers, each against its all-full twin (the same "
    "weights, every layer full attention: see the note). Block size {block_size}, "
    "max_num_batched_tokens {batch_tokens}, float32, greedy, EOS ignored. KV bytes per "
    "sequence: the engine's live blocks x bytes per block over the sequences of the decode "
    "run, one decode step after their {context}-token prompts were prefilled. Sequences "
    "that fit: a pool of {fit_seqs} all-full sequences of {context} + {growth} tokens, the "
    "same bytes for both layouts, divided by CacheConfig.blocks_for_sequence at one token a "
    "step; resident (measured): a pool of {full_seqs} such sequences, more prompts queued "
    "than fit, the most sequences holding their whole prompt at once before the first "
    "preemption (or until no more are admitted). Decode: the decode run's sequences in a "
    "pool that holds them all-full, {steps} decode steps a repeat, the two layouts' engines "
    "alternating; prefill: the same prompts, once. Against transformers: {gen_prompts} prompts of "
    "{gen_prompt} tokens, {gen_tokens} new tokens each, the engine (HFCausalLM on the "
    "checkpoint) against generate on the same checkpoint (eager attention, one batch), "
    "fresh prompts each repeat, every repeat's tokens checked equal before any time counts.")


def batch_tokens(scale: Scale) -> int:
    """The engine's max_num_batched_tokens at `scale`: scaled with the windows, so that a
    window group holds as many chunk blocks, in windows, as in the full run."""
    return BATCH_TOKENS // scale.hybrid_window_divisor


def _engine(runner: torch.nn.Module, num_blocks: int, scale: Scale):
    from ...engine import Engine  # the serve extra: imported when used
    from ...engine.config import EngineConfig

    config = runner.cache_config(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    return Engine(runner, EngineConfig(cache=config, max_num_seqs=256,
                                       max_num_batched_tokens=batch_tokens(scale),
                                       num_threads=torch.get_num_threads()))


def _greedy(max_tokens: int):
    from ...engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """`count` seeded random prompts of `length` ids in ``[1, VOCAB)`` (distinct, so no
    prefix is shared)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (count, length), generator=generator).tolist()


def pool_blocks(pair: ModelPair, num_seqs: int, num_tokens: int) -> dict[str, int]:
    """Blocks of each layout in one byte budget: `num_seqs` all-full sequences of
    `num_tokens` tokens (and the null block)."""
    full = pair.all_full.cache_config(num_blocks=2, block_size=BLOCK_SIZE)
    hybrid = pair.hybrid.cache_config(num_blocks=2, block_size=BLOCK_SIZE)
    budget = (num_seqs * full.blocks_for_sequence(num_tokens) + 1) * full.bytes_per_block
    return {ALL_FULL: budget // full.bytes_per_block, HYBRID: budget // hybrid.bytes_per_block}


@dataclasses.dataclass
class LayoutRun:
    """One layout's decode run: prefill seconds, KV bytes a sequence holds, and decode
    tokens/s per timed repeat."""

    prefill_s: float
    bytes_per_seq: float
    decode: list[float] = dataclasses.field(default_factory=list)


def _start(engine, prompts: list[list[int]], max_tokens: int) -> LayoutRun:
    """Queue `prompts` and step until each has its first token, then once more (window rows
    give back their prefill's blocks before a step): the prefill's seconds and the bytes
    each sequence holds then."""
    engine.generate(_prompts(1, 64, seed=0), _greedy(2))  # warm-up, untimed, shares nothing
    started: set[int] = set()
    for prompt in prompts:
        engine.add_request(prompt, _greedy(max_tokens),
                           on_output=lambda out: started.add(out.request_id))
    start = time.perf_counter()
    while len(started) < len(prompts):
        engine.step()
    elapsed = time.perf_counter() - start
    engine.step()
    held = engine.stats().num_live_blocks * engine.cache.config.bytes_per_block
    return LayoutRun(elapsed, held / len(prompts))


def decode_runs(pair: ModelPair, shape: Shape, scale: Scale) -> dict[str, LayoutRun]:
    """Both layouts' engines on the same `shape.batch` long prompts; decode timed in
    alternating repeats of ``scale.hybrid_decode_steps`` steps."""
    context, steps = scale.hybrid_context, scale.hybrid_decode_steps
    # no request finishes while timed: a prompt's first tokens come while others prefill
    max_tokens = scale.repeats * steps + shape.batch * -(-context // batch_tokens(scale)) + 8
    blocks = pool_blocks(pair, shape.batch, context + max_tokens)
    prompts = _prompts(shape.batch, context, seed=1)
    runs: dict[str, LayoutRun] = {}
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(_engine(runner, blocks[name], scale))
                   for name, runner in ((HYBRID, pair.hybrid), (ALL_FULL, pair.all_full))}
        for name, engine in engines.items():
            runs[name] = _start(engine, prompts, max_tokens)
        for _ in range(scale.repeats):
            for name, engine in engines.items():
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                runs[name].decode.append(shape.batch * steps / (time.perf_counter() - start))
    return runs


def _resident(engine) -> int:
    """Running sequences whose whole prompt is in the cache."""
    return sum(seq.num_computed >= len(seq.request.prompt_token_ids)
               for seq in engine.scheduler.running)


def count_resident(engine, prompts: list[list[int]], patience: int) -> tuple[int, ...]:
    """Queue `prompts` and step until the first preemption or finished request, until all
    are resident, or until `patience` steps admit no more; resident sequences per step."""
    for prompt in prompts:
        engine.add_request(prompt, _greedy(GROWTH))
    counts: list[int] = []
    idle = 0
    while engine.has_unfinished_requests and idle < patience:
        if engine.step() or engine.stats().num_preemptions:
            break
        counts.append(_resident(engine))
        idle = 0 if counts[-1] > max(counts[:-1], default=0) else idle + 1
        if counts[-1] == len(prompts):
            break
    return tuple(counts)


@dataclasses.dataclass
class Capacity:
    """Sequences of ``hybrid_context + GROWTH`` tokens per layout: ``fits`` in a pool of
    `FIT_SEQS` all-full ones by `blocks_for_sequence`; ``small_fits`` the same in the
    resident run's pool of `FULL_SEQS`, and ``resident`` measured there per engine step."""

    fits: dict[str, int]
    small_fits: dict[str, int]
    resident: dict[str, tuple[int, ...]]


def _fits(runner: torch.nn.Module, num_blocks: int, num_tokens: int) -> int:
    config = runner.cache_config(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    return config.num_usable_blocks // config.blocks_for_sequence(num_tokens, 1)


def capacity(pair: ModelPair, shape: Shape, scale: Scale) -> Capacity:
    """How many long sequences one pool holds per layout, by arithmetic and (when
    `shape.resident`) resident at once in the engine."""
    num_tokens = scale.hybrid_context + GROWTH
    layouts = ((HYBRID, pair.hybrid), (ALL_FULL, pair.all_full))
    big, small = (pool_blocks(pair, seqs, num_tokens) for seqs in (FIT_SEQS, FULL_SEQS))
    result = Capacity({name: _fits(runner, big[name], num_tokens) for name, runner in layouts},
                      {name: _fits(runner, small[name], num_tokens) for name, runner in layouts},
                      {})
    if shape.resident:
        prompts = _prompts(result.small_fits[HYBRID] + 1, scale.hybrid_context, seed=2)
        patience = 2 * -(-scale.hybrid_context // batch_tokens(scale)) + 4
        for name, runner in layouts:
            with _engine(runner, small[name], scale) as engine:
                result.resident[name] = count_resident(engine, prompts, patience)
    return result


def check_same_tokens(ours: list[list[int]], theirs: list[list[int]], what: str) -> None:
    """RuntimeError naming the first prompt and position where the two differ: a faster
    wrong answer is no result."""
    for index, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
        if list(mine) != list(other):
            position = next((i for i, (a, b) in enumerate(zip(mine, other, strict=False))
                             if a != b), min(len(mine), len(other)))
            raise RuntimeError(f"{what}: prompt {index} differs from the engine's tokens at "
                               f"token {position} ({list(mine)} != {list(other)})")


def generate_figure(pair: ModelPair, shape: Shape, scale: Scale) -> Figure | None:
    """Generated tokens/s of the engine against transformers' ``generate`` on the hybrid
    checkpoint, every repeat's tokens checked equal first (None without a checkpoint)."""
    if pair.checkpoint is None:
        return None
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        pair.checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    length, new = scale.hybrid_generate_prompt, GENERATE_TOKENS
    config = pair.hybrid.cache_config(num_blocks=2, block_size=BLOCK_SIZE)
    speeds: dict[str, list[float]] = {ENGINE: [], GENERATE: []}
    with _engine(pair.hybrid, GENERATE_PROMPTS * config.blocks_for_sequence(length + new)
                 + 1, scale) as engine:
        for repeat in range(max(2, min(3, scale.repeats)) + 1):  # the first is a warm-up
            prompts = _prompts(GENERATE_PROMPTS, length, seed=100 + repeat)
            start = time.perf_counter()
            ours = [out.outputs[0].token_ids for out in engine.generate(prompts, _greedy(new))]
            engine_s = time.perf_counter() - start
            ids = torch.tensor(prompts)
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=new, pad_token_id=0)
            generate_s = time.perf_counter() - start
            check_same_tokens(ours, out[:, length:].tolist(), f"{shape.name}: {GENERATE}")
            if repeat:
                speeds[ENGINE].append(GENERATE_PROMPTS * new / engine_s)
                speeds[GENERATE].append(GENERATE_PROMPTS * new / generate_s)
    return Figure(f"{shape.key}: generated tokens/s, {GENERATE_PROMPTS} prompts of {length} "
                  f"tokens + {new}, tokens equal", Stat(tuple(speeds[ENGINE]), "tokens/s"),
                  GENERATE, Stat(tuple(speeds[GENERATE]), "tokens/s"), higher_is_better=True)


def measure(shape: Shape, pair: ModelPair, scale: Scale,
            ) -> tuple[list[Figure], dict, dict[str, tuple[int, ...]]]:
    """Every figure of one shape, its facts, and the resident run's counts per step."""
    context, name = scale.hybrid_context, shape.key
    runs = decode_runs(pair, shape, scale)
    held = capacity(pair, shape, scale)
    hybrid, full = runs[HYBRID], runs[ALL_FULL]
    figures = [
        Figure(f"{name}: KV MiB per sequence at {context:,} tokens",
               Stat((hybrid.bytes_per_seq / 2**20,), "MiB"), ALL_FULL,
               Stat((full.bytes_per_seq / 2**20,), "MiB"), higher_is_better=False),
        Figure(f"{name}: {context:,}-token sequences that fit in one pool",
               Stat((held.fits[HYBRID],), "seqs"), ALL_FULL,
               Stat((held.fits[ALL_FULL],), "seqs"), True)]
    if held.resident:
        figures.append(Figure(
            f"{name}: {context:,}-token sequences resident at once (engine)",
            Stat((max(held.resident[HYBRID]),), "seqs"), ALL_FULL,
            Stat((max(held.resident[ALL_FULL]),), "seqs"), True))
    figures += [
        Figure(f"{name}: decode, {shape.batch} sequences at {context:,} tokens",
               Stat(tuple(hybrid.decode), "tokens/s"), ALL_FULL,
               Stat(tuple(full.decode), "tokens/s"), True),
        Figure(f"{name}: prefill of {shape.batch} x {context:,} tokens",
               Stat((hybrid.prefill_s,), "s"), ALL_FULL, Stat((full.prefill_s,), "s"), False)]
    compared = generate_figure(pair, shape, scale)
    if compared is not None:
        figures.append(compared)
    return figures, facts(shape, pair, scale, runs, held), held.resident


def facts(shape: Shape, pair: ModelPair, scale: Scale, runs: dict[str, LayoutRun],
          held: Capacity) -> dict:
    """What the figures rest on: the model, its groups, block bytes, the measured and the
    arithmetic fractions, and the resident run's pool."""
    config = pair.hybrid.cache_config(num_blocks=2, block_size=BLOCK_SIZE)
    full = pair.all_full.cache_config(num_blocks=2, block_size=BLOCK_SIZE)
    context, name, chunk = scale.hybrid_context, shape.key, batch_tokens(scale)
    kinds = ", ".join(f"{kind} x {len(layers)}" for kind, layers in config.layer_groups)
    found = {
        f"{name}: model": pair.description,
        f"{name}: layer groups (kind x layers)": kinds,
        f"{name}: bytes per block, hybrid / all-full":
            f"{config.bytes_per_block:,} / {full.bytes_per_block:,}",
        f"{name}: KV bytes per sequence, hybrid / all-full (measured)":
            round(runs[HYBRID].bytes_per_seq / runs[ALL_FULL].bytes_per_seq, 4),
        f"{name}: the same by blocks_for_sequence({context}, 1)":
            round(config.blocks_for_sequence(context, 1) * config.bytes_per_block
                  / (full.blocks_for_sequence(context, 1) * full.bytes_per_block), 4),
        f"{name}: sequences that fit, hybrid / all-full (pool of {FIT_SEQS} all-full)":
            f"{held.fits[HYBRID]} / {held.fits[ALL_FULL]}"}
    if held.resident:
        found[f"{name}: resident run's pool ({FULL_SEQS} all-full sequences): fit by "
              f"arithmetic, hybrid / all-full"] = (f"{held.small_fits[HYBRID]} / "
                                                   f"{held.small_fits[ALL_FULL]}")
        found[f"{name}: hybrid blocks a sequence holds decoding / prefilling a "
              f"{chunk}-token chunk"] = (f"{config.blocks_for_sequence(context + GROWTH, 1)} / "
                                         f"{config.blocks_for_sequence(context + GROWTH, chunk)}")
    return found


def _plots(figures: list[Figure], resident: dict[str, tuple[int, ...]]) -> list[Plot]:
    ratios = Plot("hybrid layout against its baseline", "", "ratio (> 1: hybrid better)",
                  (Series("ratio", tuple(f.name for f in figures),
                          tuple(f.ratio for f in figures)),), kind="bar")
    steps = Plot(f"{SHAPES[0].key}: sequences holding their whole prompt, resident run",
                 "engine step", "sequences",
                 tuple(Series(name, tuple(range(len(counts))), counts)
                       for name, counts in resident.items()))
    return [ratios, steps] if resident else [ratios]


def run(scale: Scale) -> WorkloadResult:
    """Every shape's figures against its all-full twin (and transformers' generate)."""
    figures, info, resident = [], {}, {}
    with tempfile.TemporaryDirectory() as workdir, quiet_transformers():
        for shape in SHAPES:
            pair = build_pair(shape, scale, Path(workdir))
            shape_figures, found, counts = measure(shape, pair, scale)
            figures += shape_figures
            info.update(found)
            resident = resident or counts
    notes = [" ".join(__doc__.split("\n\n")[1].split()), NOTE_CHUNK]
    if not any(f.baseline_name == GENERATE for f in figures):
        notes.append("transformers is not installed: TinyLlama with the same layer kinds "
                     "stands in, and there is no comparison with generate.")
    description = DESCRIPTION.format(
        block_size=BLOCK_SIZE, batch_tokens=batch_tokens(scale), context=scale.hybrid_context,
        full_seqs=FULL_SEQS, fit_seqs=FIT_SEQS, growth=GROWTH,
        steps=scale.hybrid_decode_steps, gen_prompts=GENERATE_PROMPTS,
        gen_prompt=scale.hybrid_generate_prompt, gen_tokens=GENERATE_TOKENS)
    return WorkloadResult("hybrid", "Hybrid layers: sliding windows and sinks against the "
                          "all-full layout", description, figures, info,
                          plots=_plots(figures, resident), notes=notes)
