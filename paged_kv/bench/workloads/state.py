"""``--workloads state``: prefix caching and pool capacity of models with recurrent layers
(the state group's checkpoints), each figure against its target.

1. vLLM issue #45238's workload at this scale: 64 prompts in 8 groups, each group
   sharing a prefix, unique suffixes; prompts whose state hit, and hit tokens, against
   the ideal (every prompt after its group's first hits the block-aligned prefix).
2. A shared 480-token prefix and unique suffixes: hit tokens against the ideal.
3. A multi-turn replay (each turn's prompt = the previous prompt + answer + new user
   tokens): hits with checkpoint slots capped at 25% of the pool, against every block
   checkpointed with unlimited slots; checkpoint bytes against the state's own size.
4. Sequences one pool holds: the 3:1 recurrent:attention layout against the same layers
   all attention, same bytes.
5. The engine on a tiny random Qwen3-Next checkpoint against transformers' ``generate``
   on it, tokens checked equal first.

Parts 1-4 run the cache alone (`state_cache`: a stand-in with the real model's counts,
fake states written as the engine writes them, every served state checked); each part's
measurement is in `state_parts`, and this module judges the figures against their
targets and writes the report's text.
"""

from __future__ import annotations

from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure
from . import state_cache as sc
from . import state_parts as parts
from .hybrid_models import quiet_transformers


# -- the targets and the run -----------------------------------------------------------------
def targets(figures: list[Figure]) -> dict[str, str]:
    """Each target of the brief, met or missed, with its figure (by name's start)."""
    def find(start: str) -> Figure:
        return next(f for f in figures if f.name.startswith(start) or start in f.name)

    hits = find("#45238 (")
    issue_tokens = find("#45238 (64 prompts): hit tokens")
    shared = find("480-token prefix")
    turns = find("hit tokens, checkpoints <=")
    share = find("peak checkpoint bytes")
    per_checkpoint = find("bytes per checkpoint")
    seqs = find("1,000-token sequences per")
    state_tokens = round(sc.state_bytes() / sc.model_config(2, 1).bytes_per_token)
    checks = {
        # the brief asks 60/64, but a cold cache gives at most 56: each group's first
        # prompt has nothing cached to hit, so the row is judged against that ideal
        "1. #45238: prompts whose state hit >= 56/64, the most a cold cache gives (the "
        "brief's 60/64 counts the 8 group-first prompts, which have nothing to hit)":
            (hits.value.median >= hits.baseline.median,
             f"{hits.value.median:.0f}/64 (ideal {hits.baseline.median:.0f}/64; hit tokens "
             f"{issue_tokens.ratio:.0%} of the ideal)"),
        "2. 480-token shared prefix: hit tokens >= 90% of the ideal":
            (shared.ratio >= 0.9, f"{shared.ratio:.1%}"),
        "3a. multi-turn: checkpoints <= 25% of the pool with >= 95% of the hits":
            (share.value.median <= 0.25 and turns.ratio >= 0.95,
             f"{share.value.median:.1%} of the pool, {turns.ratio:.1%} of the hits"),
        "3b. bytes per checkpoint <= 1.05x the state's own size":
            (1 / per_checkpoint.ratio <= 1.05, f"{1 / per_checkpoint.ratio:.3f}x"),
        "4. 3:1 layout holds >= 3x the sequences at 1,000 tokens":
            (seqs.ratio >= 3, f"{seqs.ratio:.2f}x (a sequence's states are the K/V of "
                              f"{state_tokens:,} tokens: 3x from {3 * state_tokens:,})"),
    }
    return {f"target {name}": ("met" if ok else "MISSED") + f": {value}"
            for name, (ok, value) in checks.items()}


def run(scale: Scale) -> WorkloadResult:
    """Parts 1-5 (see the module docstring); each target's verdict in the facts."""
    sizes = parts.sizes_for(scale)
    pool = sizes["pool_gib"] * parts.GIB
    figures, info, plots = parts.prefix_parts(sizes, pool)
    more, found = parts.multi_turn(sizes, pool)
    figures += more
    info.update(found)
    more, found = parts.capacity(sizes)
    figures += more
    info.update(found)
    info = {**targets(figures), **info}
    with quiet_transformers():
        compared = parts.generate_figure(sizes)
    if compared is not None:
        figures.append(compared[0])
        info.update(compared[1])
    ratios = Plot("state checkpoints and capacity against their baselines", "",
                  "ratio (> 1: better)", (Series("ratio", tuple(f.name[:48] for f in figures),
                                                 tuple(f.ratio for f in figures)),),
                  kind="bar")
    description = DESCRIPTION.format(
        pool=sizes["pool_gib"], slots=parts.DEFAULT_SLOTS, slot_mib=sc.state_bytes() / 2**20,
        block_kib=sc.model_config(2, 1).bytes_per_block / 2**10, answer=parts.ANSWER,
        concurrency=parts.CONCURRENCY, budget=parts.BUDGET, share=parts.CHECKPOINT_SHARE,
        shared_prompts=sizes["shared_prompts"], turns=sizes["turns"])
    notes = list(NOTES)
    if compared is None:
        notes.append("transformers is not installed: no engine comparison (part 5).")
    return WorkloadResult("state", "Recurrent state: checkpoints, prefix hits and capacity",
                          description, figures, info, plots=[ratios, *plots], notes=notes)


DESCRIPTION = (
    "A Qwen3-Next-80B-shaped cache (48 layers: 36 gated delta nets, each state conv "
    "[8192, 4] bf16 + recurrent [32, 128, 128] float32, {slot_mib:.2f} MiB a sequence; 12 "
    "full-attention layers, 2 KV heads x 256 bf16, {block_kib:.0f} KiB a block of 16 "
    "tokens), a {pool} GiB pool. Parts 1-4 replay on a stand-in cache with exactly those "
    "block and state-slot counts (tiny tensors: the checkpoint policy counts slots, never "
    "bytes), writing after every step each row's state and the states after the batch's "
    "emit_tokens, as the engine's forward does; every admission checks it was served the "
    "state of exactly the prefix it hit. Parts 1-2: one prompt at a time, {answer} tokens "
    "generated each, {slots} state slots (HFCausalLM's default), the rest of the pool "
    "blocks; part 2 has {shared_prompts} prompts. Part 3: 50 conversations x {turns} turns "
    "(first prompt 64-512 tokens, answers 32-160, new user tokens 16-128), turn-major "
    "order, {concurrency} running at once, {budget} tokens a step; checkpoint slots capped "
    "at {share:.0%} of the pool against a slot for every block boundary. Part 4: each "
    "layout's best split of the pool (blocks, and one live slot a sequence), and the same "
    "counts admitted into stand-ins. Part 5: a tiny random Qwen3-Next (4 layers, hidden "
    "64) through HFCausalLM against transformers' generate on the same checkpoint, float32, "
    "greedy, fresh prompts each repeat, tokens checked equal before any time counts.")
NOTES = [
    "The checkpoint policy ranks by tier, then least recently used: DENSE < INTERVAL < "
    "LATEST < SHARED. A row's newest boundary is LATEST; when it takes the next, the one "
    "before drops to INTERVAL if it sits on the 8-block interval (128 tokens), else to "
    "DENSE; a junction, where a prompt's attention blocks hit past its state, is SHARED; a "
    "DENSE checkpoint served to a hit rises to LATEST. Under pressure a unique suffix's "
    "interior boundaries go first, so the slots the parts need stay held.",
    "Target 1 is judged against 56/64, not the brief's 60/64: 56/64 is the most a cold "
    "cache can give for 8 groups of 8, since each group's first prompt has nothing cached "
    "to hit. The default 128 slots reach it (56/64), as does a slot for every boundary "
    "(the unlimited row). Hit tokens are 0.99x of the ideal (16,000 of 16,128) because 4 "
    "groups' second prompts hit at 256 tokens, not 288: the group's first prompt left its "
    "288-token boundary as an interior DENSE one, which later suffixes evicted, while the "
    "256-token one on the interval outlived them. The second prompt recomputes 256-288, and "
    "its attention hit reaching past its state makes 288 a SHARED junction, so every later "
    "prompt of the group hits all 288 tokens (see 'last prompt served a hit').",
    "The 480-token prefix is served in full (63/64 prompts, 1.00x of the hit tokens): its "
    "junction is SHARED from the second prompt on, and each prompt's 64-token suffix "
    "boundaries are DENSE, evicted before it.",
    "Multi-turn: a conversation's next turn needs one checkpoint, at the last block "
    "boundary its previous turn consumed, and that one is LATEST, kept while the other "
    "conversations' interior DENSE boundaries go. With checkpoint slots capped at 25% of "
    "the pool the cache serves every hit the unlimited run serves (1.00x), holding at most "
    "0.248 of the pool in checkpoints against about 0.9 for a slot at every boundary.",
    "Least recently used first (the counterfactual rows: a RecencyPolicy swapped into the "
    "stand-in) serves the one shared prefix too, but not eight groups (33/64), and far "
    "fewer multi-turn hits: a turn's tens of dense checkpoints, 49 other turns between a "
    "conversation's two, push its last boundary out. The tiers, not the slot count, make "
    "the difference.",
    "Bytes per checkpoint are 1.00x the state's own size: a checkpoint is one slab slot, "
    "exactly the specs' shapes x dtypes (74.25 MiB, about 198 blocks of K/V).",
    "Target 4 is missed by the state's size, not by the policy: one sequence's states "
    "(36 x 2.06 MiB) are the K/V of 3,168 tokens in the 12 attention layers, so at 1,000 "
    "tokens a 3:1 sequence holds 23 + 74 MiB against all-attention's 94 MiB: 0.97x the "
    "sequences (418 against 433 in 40 GiB). The issue's 3x needs prompts past the "
    "crossover at 9,504 tokens (3 x 3,168): 2.89x at 8K, 3.69x at 32K.",
    "Part 5 runs a model of hidden size 64: per-step overhead, not the mixers' arithmetic, "
    "sets both speeds, so the engine's ratio against generate (below 1) measures the "
    "engine's per-step bookkeeping; it shows the engine's tokens equal generate's, not a "
    "kernel race.",
]
