"""The state workload's measurements, parts 1-5 (see `state`, which judges them against
their targets and writes the report): each part builds its requests, replays them on the
cache-side stand-in (`state_cache`) or runs the engine against transformers' ``generate``,
and returns its figures (each against its baseline) and the facts behind them.
"""

from __future__ import annotations

import importlib.util
import random
import tempfile
import time
from pathlib import Path

import torch

from ..results import Plot, Series
from ..scale import Scale
from ..timing import Figure, Stat
from . import state_cache as sc
from .hybrid import check_same_tokens

GIB = 2**30
VOCAB = 50_000  # ids of the cache replays (the cache never reads a vocabulary)
DEFAULT_SLOTS = 128  # HFCausalLM's DEFAULT_STATE_SLOTS: what a server gets unless told
CHECKPOINT_SHARE = 0.25  # part 3: checkpoint slots' share of the pool
CONCURRENCY, BUDGET = 8, 512  # part 3: running sequences, tokens a step
ANSWER = 16  # parts 1-2: tokens each prompt generates
# (parts 1-2 shapes: groups, prompts a group, shared prefix, unique suffix)
ISSUE = (8, 8, 300, 140)  # #45238's 1,500 / 700 tokens at block 528, divided by 5
SHARED_PREFIX, SHARED_SUFFIX = 480, 64
VLLM = {"#45238 hits": "0/64 (1,500 / 700 tokens), 52/64 (1,600 / 600) in the issue; "
                       "40/64, 48/64 with interval checkpoints (figures as briefed)",
        "480-token prefix": "0%: a hybrid's attention block is 528 tokens (#40696)"}


def sizes_for(scale: Scale) -> dict:
    """What `scale` changes: the shared-prefix prompts, the multi-turn turns, the pool of
    part 4 and part 5's prompts (the #45238 workload is always its 64 prompts)."""
    quick = scale.name == "quick"
    return dict(shared_prompts=64, turns=3 if quick else 6,
                pool_gib=40, gen_prompt=48 if quick else 256,
                gen_tokens=8 if quick else 32, repeats=1 if quick else 3)


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(count)]


def _pool_blocks(pool_bytes: int, num_slots: int) -> int:
    """Blocks of the real model beside `num_slots` state slots in `pool_bytes`."""
    config = sc.model_config(2, num_slots)
    return (pool_bytes - config.state_bytes) // config.bytes_per_block


def _grouped(groups: int, per_group: int, prefix: int, suffix: int, seed: int,
             ) -> list[sc.Request]:
    """`groups` x `per_group` prompts, each group's sharing a prefix, shuffled."""
    rng = random.Random(seed)
    heads = [_tokens(rng, prefix) for _ in range(groups)]
    requests = [sc.Request(head + _tokens(rng, suffix), _tokens(rng, ANSWER))
                for head in heads for _ in range(per_group)]
    rng.shuffle(requests)
    return requests


def _unlimited_slots(requests: list[sc.Request]) -> int:
    """Slots for a checkpoint at every boundary of every request, and the live ones."""
    return sum(len(r.cached_tokens) // sc.BLOCK_SIZE for r in requests) + CONCURRENCY + 1


def _serve(requests: list[sc.Request], slots: int, blocks: int, recency: bool = False,
           **kwargs) -> sc.ReplayStats:
    """Replay `requests` on a fresh stand-in (`recency`: under `RecencyPolicy`)."""
    for request in requests:
        request.hit = -1
    policy = sc.RecencyPolicy() if recency else None
    return sc.replay(sc.stand_in(blocks, slots, policy=policy), requests, **kwargs)


def prefix_parts(sizes: dict, pool: int) -> tuple[list[Figure], dict, list[Plot]]:
    """Parts 1 and 2: the default slots against the ideal, unlimited slots in the facts."""
    figures, info, series = [], {}, []
    groups, per_group, prefix, suffix = ISSUE
    ideal_prefix = prefix // sc.BLOCK_SIZE * sc.BLOCK_SIZE
    cases = {"#45238": (_grouped(groups, per_group, prefix, suffix, seed=1),
                        groups * (per_group - 1), ideal_prefix),
             "480-token prefix": (_grouped(1, sizes["shared_prompts"], SHARED_PREFIX,
                                           SHARED_SUFFIX, seed=2),
                                  sizes["shared_prompts"] - 1, SHARED_PREFIX)}
    blocks = _pool_blocks(pool, DEFAULT_SLOTS)
    for name, (requests, ideal_prompts, ideal_tokens) in cases.items():
        total = len(requests)
        limited = _serve(requests, DEFAULT_SLOTS, blocks)
        recency = _serve(requests, DEFAULT_SLOTS, blocks, recency=True)
        unlimited = _serve(requests, _unlimited_slots(requests), blocks)
        hit, ideal = sum(limited.hits), ideal_prompts * ideal_tokens
        prompts_hit = sum(h > 0 for h in limited.hits)
        if name == "#45238":
            figures.append(Figure(
                f"#45238 ({total} prompts, {groups} groups, {prefix} + {suffix} tokens): "
                f"prompts whose state hit", Stat((prompts_hit,), "prompts"),
                f"ideal: prompts after their group's first ({ideal_prompts}/{total})",
                Stat((ideal_prompts,), "prompts"), True))
        figures.append(Figure(
            f"{name} ({total} prompts): hit tokens", Stat((hit,), "tokens"),
            f"ideal ({ideal_prompts} x {ideal_tokens} tokens)", Stat((ideal,), "tokens"), True))
        info.update(_prefix_facts(name, ideal, limited, recency, unlimited))
        series += [Series(f"{name}, {DEFAULT_SLOTS} slots", tuple(range(total)),
                          tuple(limited.hits)),
                   Series(f"{name}, unlimited", tuple(range(total)), tuple(unlimited.hits))]
    plot = Plot("hit tokens per prompt, in replay order", "prompt", "hit tokens",
                tuple(series))
    return figures, info, [plot]


def _prefix_facts(name: str, ideal: int, limited: sc.ReplayStats, recency: sc.ReplayStats,
                  unlimited: sc.ReplayStats) -> dict:
    """A part 1-2 case's facts: each run's prompts hit and hit tokens against `ideal`."""
    total = len(limited.hits)
    prompts_hit = sum(h > 0 for h in limited.hits)
    return {
        f"{name}: prompts whose state hit / total, {DEFAULT_SLOTS} slots":
            f"{prompts_hit}/{total}",
        f"{name}: the same, every block checkpointed, unlimited slots":
            f"{sum(h > 0 for h in unlimited.hits)}/{total} "
            f"({sum(unlimited.hits) / ideal:.0%} of the ideal hit tokens, "
            f"{unlimited.peak_checkpoints} checkpoints)",
        f"{name}: counterfactual, least recently used first, {DEFAULT_SLOTS} slots":
            f"{sum(h > 0 for h in recency.hits)}/{total} "
            f"({sum(recency.hits) / ideal:.0%} of the ideal hit tokens)",
        f"{name}: checkpoints written / evicted, {DEFAULT_SLOTS} slots":
            f"{limited.checkpoints_written} / {limited.checkpoints_evicted}",
        f"{name}: last prompt served a hit, {DEFAULT_SLOTS} slots (replay order)":
            max((i for i, h in enumerate(limited.hits) if h), default=-1),
        f"{name}: vLLM": VLLM["#45238 hits" if name == "#45238" else name]}


def conversations(count: int, turns: int, seed: int,
                  ) -> tuple[list[sc.Request], dict[int, int]]:
    """`count` conversations of `turns` turns, turn-major (every first turn, then every
    second...); each turn waits for its conversation's previous one."""
    rng = random.Random(seed)
    prompts = [_tokens(rng, rng.randint(64, 512)) for _ in range(count)]
    requests, after, last = [], {}, {}
    for _ in range(turns):
        for conv in range(count):
            answer = _tokens(rng, rng.randint(32, 160))
            if conv in last:
                after[len(requests)] = last[conv]
            last[conv] = len(requests)
            requests.append(sc.Request(prompts[conv], answer))
            prompts[conv] = prompts[conv] + answer + _tokens(rng, rng.randint(16, 128))
    return requests, after


def multi_turn(sizes: dict, pool: int) -> tuple[list[Figure], dict]:
    """Part 3: checkpoint slots capped at `CHECKPOINT_SHARE` of the pool, against every
    block checkpointed with unlimited slots (the same blocks beside them)."""
    requests, after = conversations(50, sizes["turns"], seed=3)
    slot_bytes = sc.model_config(2, 1).state_bytes_per_slot
    # any slot not live may hold a checkpoint, and a checkpoint is only taken while a
    # sequence runs: all slots but one within the share
    capped = int(CHECKPOINT_SHARE * pool) // slot_bytes + 1
    blocks = _pool_blocks(pool, capped)
    unlimited_slots = _unlimited_slots(requests)
    runs = {slots: _serve(requests, slots, blocks, concurrency=CONCURRENCY, budget=BUDGET,
                          after=after) for slots in (capped, unlimited_slots)}
    limited, unlimited = runs[capped], runs[unlimited_slots]
    recency = _serve(requests, capped, blocks, recency=True, concurrency=CONCURRENCY,
                     budget=BUDGET, after=after)
    # each run's pool: the blocks, and the slots it used at most (the unlimited run's
    # untouched slots are not counted against it)
    pools = {slots: sc.model_config(blocks, min(slots, run.peak_checkpoints + CONCURRENCY))
             .total_bytes for slots, run in runs.items()}
    share = {slots: run.peak_checkpoints * slot_bytes / pools[slots]
             for slots, run in runs.items()}
    name = f"multi-turn (50 conversations x {sizes['turns']} turns)"
    unlimited_name = "every block checkpointed, unlimited slots"
    per_checkpoint = sc.model_config(2, 1).state_bytes_per_slot  # one slab slot
    figures = [
        Figure(f"{name}: hit tokens, checkpoints <= {CHECKPOINT_SHARE:.0%} of the pool",
               Stat((sum(limited.hits),), "tokens"), unlimited_name,
               Stat((sum(unlimited.hits),), "tokens"), True),
        Figure(f"{name}: peak checkpoint bytes / pool", Stat((share[capped],), "fraction"),
               unlimited_name, Stat((share[unlimited_slots],), "fraction"), False),
        Figure("bytes per checkpoint (one slab slot)", Stat((per_checkpoint / 2**20,), "MiB"),
               "the state's own size (its specs' shapes x dtypes)",
               Stat((sc.state_bytes() / 2**20,), "MiB"), False)]
    info = _multi_turn_facts(name, pool, blocks, runs, recency, requests, after,
                             pools[unlimited_slots])
    return figures, info


def _multi_turn_facts(name: str, pool: int, blocks: int, runs: dict[int, sc.ReplayStats],
                      recency: sc.ReplayStats, requests: list[sc.Request],
                      after: dict[int, int], unlimited_pool: int) -> dict:
    """Part 3's facts: `runs` by slot count (capped first, then unlimited), each against
    the ideal, and the pools they used (`unlimited_pool`: the unlimited run's)."""
    (capped, limited), (_, unlimited) = runs.items()
    per_checkpoint = sc.model_config(2, 1).state_bytes_per_slot  # one slab slot
    hit_length, miss_length = ([len(requests[before].cached_tokens)
                                for turn, before in after.items()
                                if (limited.hits[turn] > 0) == hit] for hit in (True, False))
    # the ideal: each later turn hits its previous turn's consumed tokens, block-aligned
    ideal = sum(len(requests[before].cached_tokens) // sc.BLOCK_SIZE * sc.BLOCK_SIZE
                for before in after.values())
    return {
        f"{name}: pool (capped)": f"{pool / GIB:.0f} GiB: {blocks:,} blocks + {capped} "
                                  f"state slots (up to {CONCURRENCY} of them live)",
        f"{name}: pool (unlimited)": f"{unlimited_pool / GIB:,.0f} GiB: the same "
                                     f"blocks + {unlimited.peak_checkpoints:,} checkpoints",
        f"{name}: mean tokens of the previous turn, turns that hit / missed (capped)":
            f"{_mean(hit_length):,.0f} / {_mean(miss_length):,.0f}",
        f"{name}: hit tokens / ideal (capped, unlimited)":
            f"{sum(limited.hits) / ideal:.1%}, {sum(unlimited.hits) / ideal:.1%} of {ideal:,}",
        f"{name}: counterfactual, least recently used first (capped)":
            f"{sum(recency.hits) / ideal:.1%} of the ideal hit tokens",
        f"{name}: turns served a hit (capped, unlimited) / later turns":
            f"{sum(h > 0 for h in limited.hits)}, {sum(h > 0 for h in unlimited.hits)} / "
            f"{len(after)}",
        f"{name}: checkpoints written / evicted (capped)":
            f"{limited.checkpoints_written:,} / {limited.checkpoints_evicted:,}",
        "one checkpoint against one block of K/V":
            f"{per_checkpoint / sc.model_config(2, 1).bytes_per_block:.0f}x"}


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else float("nan")


def capacity(sizes: dict) -> tuple[list[Figure], dict]:
    """Part 4: sequences of 1,000 tokens one pool holds, by arithmetic (each layout's best
    split of the bytes) and admitted into stand-ins of those counts."""
    pool = sizes["pool_gib"] * GIB
    info, fits = {}, {}
    for length in (1000, 8192, 32768):
        full = sc.model_config(2, 0, all_attention=True)
        per_seq = full.blocks_for_sequence(length)
        full_blocks = pool // full.bytes_per_block
        hybrid = sc.model_config(2, 1)
        blocks = hybrid.blocks_for_sequence(length)
        # N live slots and N sequences' blocks (and the null block) in the same bytes
        seqs = (pool - hybrid.bytes_per_block) // (blocks * hybrid.bytes_per_block
                                                   + hybrid.state_bytes_per_slot)
        fits[length] = (seqs, (full_blocks - 1) // per_seq, full_blocks,
                        seqs * blocks + 1)
        info[f"sequences per {sizes['pool_gib']} GiB pool at {length:,} tokens, 3:1 / "
             f"all attention"] = (f"{seqs} / {fits[length][1]} "
                                  f"({seqs / fits[length][1]:.2f}x)")
    seqs, full_seqs, full_blocks, hybrid_blocks = fits[1000]
    resident = sc.count_resident(hybrid_blocks, seqs, 1000)
    full_resident = sc.count_resident(full_blocks, 0, 1000, all_attention=True)
    # where 3x holds: 4 L a >= 3 (L a + S), a the attention layers' bytes a token, S the
    # state: L >= 3 S / a
    info["3:1 layout holds 3x the sequences from (tokens, arithmetic)"] = round(
        3 * sc.state_bytes() / sc.model_config(2, 1).bytes_per_token)
    figures = [
        Figure(f"1,000-token sequences per {sizes['pool_gib']} GiB pool (arithmetic)",
               Stat((seqs,), "seqs"), "all-attention layout, same bytes",
               Stat((full_seqs,), "seqs"), True),
        Figure("1,000-token sequences admitted into that pool (stand-in)",
               Stat((resident,), "seqs"), "all-attention layout, same bytes",
               Stat((full_resident,), "seqs"), True)]
    return figures, info


# -- part 5: the engine against transformers' generate -------------------------------------
ENGINE, GENERATE = "paged_kv Engine", "transformers generate (greedy, its own cache)"
GEN_PROMPTS = 4


def qwen3_next_config():
    """The tiny random Qwen3-Next of tests/engine/test_recurrent_models.py: three gated
    delta nets and one full-attention layer, 4 experts, vocab 128."""
    import transformers

    return transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3,
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        shared_expert_intermediate_size=32, bos_token_id=None, eos_token_id=None,
        pad_token_id=0)


def generate_figure(sizes: dict) -> tuple[Figure, dict] | None:
    """Generated tokens/s of the engine against ``generate`` on the same checkpoint, every
    repeat's tokens checked equal first (None without transformers)."""
    if importlib.util.find_spec("transformers") is None:
        return None
    from ...engine import Engine, SamplingParams

    length, new = sizes["gen_prompt"], sizes["gen_tokens"]
    speeds: dict[str, list[float]] = {ENGINE: [], GENERATE: []}
    with tempfile.TemporaryDirectory() as workdir:
        model, runner, config = _tiny_qwen3_next(workdir, length + new)
        with Engine(runner, config) as engine:
            for repeat in range(sizes["repeats"] + 1):  # the first is a warm-up
                # fresh prompts each repeat: no prefix hit makes the engine's work smaller
                generator = torch.Generator().manual_seed(100 + repeat)
                ids = torch.randint(1, 128, (GEN_PROMPTS, length), generator=generator)
                start = time.perf_counter()
                ours = [out.outputs[0].token_ids for out in engine.generate(
                    ids.tolist(), SamplingParams(max_tokens=new, ignore_eos=True))]
                engine_s = time.perf_counter() - start
                start = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                         do_sample=False, max_new_tokens=new, pad_token_id=0)
                generate_s = time.perf_counter() - start
                check_same_tokens(ours, out[:, length:].tolist(), f"qwen3-next: {GENERATE}")
                if repeat:
                    speeds[ENGINE].append(GEN_PROMPTS * new / engine_s)
                    speeds[GENERATE].append(GEN_PROMPTS * new / generate_s)
    figure = Figure(f"tiny Qwen3-Next: generated tokens/s, {GEN_PROMPTS} prompts of {length} "
                    f"tokens + {new}, tokens equal", Stat(tuple(speeds[ENGINE]), "tokens/s"),
                    GENERATE, Stat(tuple(speeds[GENERATE]), "tokens/s"), True)
    info = {"tiny Qwen3-Next: tokens checked equal to generate (repeats, warm-up included)":
            f"{sizes['repeats'] + 1} x {GEN_PROMPTS} prompts x {new} tokens"}
    return figure, info


def _tiny_qwen3_next(workdir: str, tokens: int):
    """The tiny Qwen3-Next saved in `workdir`, loaded by transformers and by HFCausalLM,
    and an engine config with blocks for `GEN_PROMPTS` sequences of `tokens`."""
    import transformers

    from ...engine.config import EngineConfig
    from ...engine.hf import HFCausalLM

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(qwen3_next_config()).save_pretrained(workdir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        workdir, dtype=torch.float32).eval()
    runner = HFCausalLM.from_pretrained(Path(workdir))
    blocks = GEN_PROMPTS * -(-tokens // sc.BLOCK_SIZE) + 1
    config = EngineConfig(cache=runner.cache_config(num_blocks=blocks, block_size=sc.BLOCK_SIZE,
                                                    num_state_slots=4 * GEN_PROMPTS),
                          max_num_seqs=GEN_PROMPTS, num_threads=torch.get_num_threads())
    return model, runner, config
