"""The engine's step when its running set changes every step, against the steady decode step.

    python benchmarks/step_churn.py [--seqs 256,512,1024] [--groups 1,3] [--steps 20]
                                    [--repeats 3] [--prompt 128] [--turnover 1]

The ``step_cost`` workload's engine line (`paged_kv.bench.workloads.step_scale`: `Engine.step`
over a model that does no work, less the model's own time) measures the steady decode step:
the same sequences every step, none finishing, none joining, so every step is carried from
the one before (`paged_kv.engine.steady`). A server at 1,024 running sequences whose
outputs average ~175 tokens finishes about six requests a step and admits as many, so its
steps are rarely steady. This times three steps per size and layout, from one engine:

- ``steady``: the decode step of every running sequence (the ``step_cost`` engine line);
- ``gone``: the same after `--turnover` running requests were aborted before it (the
  running set changed: nothing is carried, every per-batch setup is made again);
- ``in and gone``: the same and as many new requests queued before it, whose prompts
  (`--prompt` tokens of the trace's next prompts) are prefilled within the step: a mixed
  step, through the cache's and the model inputs' general paths.

The aborts run before the step, off the clock (a request finishing inside the step would
add its free). Prints ms per step (medians of each repeat's median, min in brackets) and
each changed step over the steady one.
"""

from __future__ import annotations

import argparse
import gc
import statistics

from paged_kv.bench.workloads.step_scale import MixedSteps

MODES = ("steady", "gone", "in and gone")


def time_modes(num_groups: int, num_seqs: int, num_steps: int, prompt: int,
               turnover: int = 1) -> dict[str, float]:
    """Median seconds of `num_steps` engine steps of each mode (`MODES`) over `num_seqs`
    running sequences of a `num_groups`-group cache, one engine, the modes in turn;
    `turnover` requests go (and as many come) before each changed step."""
    mixed = MixedSteps(num_groups, num_seqs, num_steps, prompt, turnover)
    stepper = mixed.stepper
    stepper.step()
    times: dict[str, float] = {}
    for mode in MODES:
        seconds = []
        for step in range(num_steps):
            if mode != "steady":
                mixed.churn(step, arrivals=mode == MODES[2])
            seconds.append(stepper.step())
        times[mode] = statistics.median(seconds)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="256,512,1024", help="running sequences")
    parser.add_argument("--groups", default="1,3", help="layer groups: 1, 3 or both")
    parser.add_argument("--steps", type=int, default=20, help="timed steps a mode")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128, help="new prompts' tokens")
    parser.add_argument("--turnover", type=int, default=1,
                        help="requests that go (and come) before each changed step")
    args = parser.parse_args()
    sizes = tuple(int(n) for n in args.seqs.split(","))
    layouts = tuple(int(g) for g in args.groups.split(","))
    runs: dict[tuple[int, int], list[dict[str, float]]] = {}
    for _ in range(args.repeats):  # every size and layout in each repeat
        for groups in layouts:
            for n in sizes:
                gc.collect()
                runs.setdefault((groups, n), []).append(
                    time_modes(groups, n, args.steps, args.prompt, args.turnover))
    print(f"{'engine step, ms':28}" + "".join(f"{mode:>24}" for mode in MODES))
    for (groups, n), found in runs.items():
        cells = []
        for mode in MODES:
            values = [run[mode] for run in found]
            median = statistics.median(values)
            steady = statistics.median(run["steady"] for run in found)
            ratio = "" if mode == "steady" else f" {median / steady:4.2f}x"
            cells.append(f"{1e3 * median:.3f} [{1e3 * min(values):.3f}]{ratio}")
        name = f"{groups} group{'s' if groups > 1 else ''}, {n} sequences"
        print(f"{name:28}" + "".join(f"{cell:>24}" for cell in cells))


if __name__ == "__main__":
    main()
