"""Where a mixed step's time goes: the engine's step after one running request left and one
new prompt arrived (a loaded server's usual step), part by part.

    python benchmarks/mixed_parts.py [--seqs 1024] [--groups 3] [--steps 80] [--prompt 128]

`benchmarks/step_churn.py` times the mixed step whole ("in and gone"); this wraps its parts
with `perf_counter` (the scheduler's phases and per-sequence passes, the cache's step and
its groups' commits, the stream) in one engine over a model that does no work
(`step_scale.MixedSteps`), and prints each part's median ms per step over
``--steps`` steps (the first four left out), largest first, beside the step's own median.
Before each step one running request is aborted and one prompt of ``--prompt`` tokens is
added, off the clock. Parts nest (a commit is inside the cache's step), so they do not sum
to the step; the wrappers add a little to every call they wrap.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import time

from paged_kv.bench.workloads.step_scale import MixedSteps
from paged_kv.core.cache import PagedKVCache
from paged_kv.core.groups.groups import LayerGroup
from paged_kv.core.groups.layout import GroupLayout
from paged_kv.core.groups.state import StateSlots
from paged_kv.core.page_table import PageTables
from paged_kv.core.step.commit import StepCommitter
from paged_kv.engine import engine as engine_module
from paged_kv.engine import steady
from paged_kv.engine.scheduler import Scheduler

# (owner, attribute, label): what is wrapped
PARTS = (
    [(Scheduler, name, name) for name in ("schedule", "prepare", "advance",
                                          "update_from_output", "_all_decode", "_rows_of")]
    + [(steady, name, name) for name in ("_next_tokens", "_computed")]
    + [(engine_module, "emit_samples", "emit_samples"),
       (PagedKVCache, "prepare_decode", "cache: prepare_decode"),
       (PagedKVCache, "rows_of", "cache: rows_of"),
       (GroupLayout, "forecast", "layout: plans and give-backs"),
       (LayerGroup, "commit_leading", "leading group: commit"),
       (LayerGroup, "commit_step", "other groups: commit"),
       (LayerGroup, "mirror", "other groups: mirror"),
       (LayerGroup, "release", "groups: give-back"),
       (StepCommitter, "_rows_batch", "the batch of all rows"),
       (PageTables, "batch_tables", "block tables"),
       (StateSlots, "offer_all", "state: checkpoint offers")])


def _wrap(spent: dict[str, float]) -> None:
    """Wrap every part of `PARTS`, adding its seconds to ``spent[label]``."""
    clock = time.perf_counter

    for owner, name, label in PARTS:
        inner = getattr(owner, name)

        def wrapped(*args, _inner=inner, _label=label, **kwargs):
            start = clock()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_label] += clock() - start

        setattr(owner, name, wrapped)


def measure(num_groups: int, num_seqs: int, num_steps: int, prompt: int,
            ) -> tuple[float, dict[str, float]]:
    """The mixed step's median seconds, and each part's."""
    mixed = MixedSteps(num_groups, num_seqs, num_steps, prompt)
    spent: dict[str, float] = collections.defaultdict(float)
    _wrap(spent)
    steps, parts = [], collections.defaultdict(list)
    gc.collect()
    gc.disable()
    try:
        for step in range(num_steps):
            mixed.churn(step)
            spent.clear()
            seconds = mixed.stepper.step()
            if step >= 4:
                steps.append(seconds)
                for label, value in spent.items():
                    parts[label].append(value)
    finally:
        gc.enable()
    return statistics.median(steps), {label: statistics.median(values)
                                      for label, values in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=1024, help="running sequences")
    parser.add_argument("--groups", type=int, default=3, choices=(1, 3), help="layer groups")
    parser.add_argument("--steps", type=int, default=80, help="mixed steps")
    parser.add_argument("--prompt", type=int, default=128, help="new prompts' tokens")
    args = parser.parse_args()
    step, parts = measure(args.groups, args.seqs, args.steps, args.prompt)
    print(f"mixed step, {args.seqs} sequences, {args.groups} group(s): {1e3 * step:.3f} ms")
    for label, seconds in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"  {label:<32} {1e3 * seconds:7.3f} ms")


if __name__ == "__main__":
    main()
