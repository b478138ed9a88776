"""Instructions per decode step, counted by callgrind: the step-cost figure the load does
not move.

    python benchmarks/step_instructions.py [--kind engine] [--groups 3] [--seqs 1024]
                                           [--steps 20]

Wall time on a shared machine moves by up to 2x between processes; an instruction count
does not. This runs `DecodeStepper(KIND, GROUPS, trace_prompts(SEQS))` (the ``step_cost``
workload's second part, `paged_kv.bench.workloads.step_scale`) under valgrind's callgrind
with collection switched on only inside one `functools.reduce` around STEPS steps, after
the stepper's setup and two untimed steps, with the cyclic GC off and ``PYTHONHASHSEED=0``,
and prints the count over STEPS. Before the counted run it builds a small stepper of the
same kind in a process of its own, so numba's compiled row loops are cached: compiling them
calls `functools.reduce` too, and those calls would be counted.

``--kind mixed`` counts a loaded server's usual step instead of the steady one: the
engine's step after one running request was aborted and one 128-token prompt arrived (off
the count; `benchmarks/step_churn.py`'s "in and gone" step), each step inside a
`functools.reduce` of its own. ``--kind turnover`` counts the engine's step in a loaded
server's steady state, requests finishing inside it (~1 in 120 a step, lengths
staggered) and as many new 128-token prompts prefilled in it
(`step_scale.TurnoverSteps`, after 170 warm-up steps: ~1 minute more at 1,024).

Runs of one tree agree to about +-0.5 M instructions at 1,024 sequences (object addresses
move dict and set probing): compare trees by more than that, or by several runs. Another
tree (a ``git worktree``): ``PYTHONPATH=TREE python TREE/benchmarks/step_instructions.py``.
Needs valgrind on the PATH (Debian: ``apt-get install valgrind``); ~4 minutes at 1,024
sequences.

``--inside MODULE:QUALNAME`` counts only the instructions inside one function's calls in
the same steps (e.g. ``paged_kv.core.groups.layout:GroupLayout.forecast``, or
``paged_kv.core.step.commit:index_filled_blocks``), a part's share of the step: each call
runs inside a one-item `functools.reduce` of its own and the steps outside one. A method
of a class counts that class's calls (a subclass's override is not it); a function is
replaced wherever a ``paged_kv`` module imported it by name. A function that calls itself,
or one under another counted function, is not counted twice: collection toggles off in the
inner call.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

KINDS = ("cache", "scheduler", "engine", "mixed", "turnover")


def _counted(step: Callable[[], object], inside: str | None, count: int = 1) -> None:
    """`count` calls of `step` inside the one-item `functools.reduce` that switches
    callgrind's collection on (or, with `inside`, plainly: `_count_inside` put the reduce
    around that function's calls instead)."""
    if inside:
        for _ in range(count):
            step()
    else:
        functools.reduce(lambda acc, _: step(), range(count), 0)


def _count_inside(target: str) -> None:
    """Run each call of `target` (``MODULE:QUALNAME``) inside a one-item `functools.reduce`:
    only those calls are counted."""
    module_name, _, qualname = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        found = []
        functools.reduce(lambda acc, _: found.append(original(*args, **kwargs)), range(1), 0)
        return found[0]

    setattr(owner, name, counted)
    if not path:  # a module's function: also where other modules imported it by name
        for module in list(sys.modules.values()):
            if (getattr(module, "__name__", "").startswith("paged_kv")
                    and getattr(module, name, None) is original):
                setattr(module, name, counted)


def _steps(kind: str, groups: int, seqs: int, steps: int, inside: str | None = None) -> None:
    """The counted run (inside callgrind): setup, two untimed steps, then `steps` steps
    inside the one `functools.reduce` that switches collection on (with `inside`: see
    `_count_inside`)."""
    from paged_kv.bench.workloads.step_scale import DecodeStepper, trace_prompts

    if kind == "mixed":
        _mixed_steps(groups, seqs, steps, inside)
        return
    if kind == "turnover":
        _turnover_steps(groups, seqs, steps, inside)
        return
    stepper = DecodeStepper(kind, groups, trace_prompts(seqs), steps + 4)
    stepper.step()
    stepper.step()
    if inside:
        _count_inside(inside)
    gc.collect()
    gc.disable()
    _counted(stepper.step, inside, steps)


def _mixed_steps(groups: int, seqs: int, steps: int, inside: str | None = None) -> None:
    """The ``mixed`` kind: the engine's step (as ``engine``) after one running request was
    aborted and one 128-token prompt of the trace arrived (`benchmarks/step_churn.py`'s
    "in and gone" step, a loaded server's usual one): the abort and the arrival off the
    count, each step inside a one-item `functools.reduce` of its own."""
    from paged_kv.bench.workloads.step_scale import MixedSteps

    mixed = MixedSteps(groups, seqs, steps)
    stepper = mixed.stepper
    for step in range(steps + 2):  # two untimed, then the counted ones
        if step == 2:
            if inside:
                _count_inside(inside)
            gc.collect()
            gc.disable()
        mixed.churn(step)
        if step < 2:
            stepper.step()
        else:
            _counted(stepper.step, inside)


def _turnover_steps(groups: int, seqs: int, steps: int, inside: str | None = None) -> None:
    """The ``turnover`` kind: the engine's step in a loaded server's steady state
    (`step_scale.TurnoverSteps`: ~1 in 120 requests finishing inside each step, as many
    new 128-token prompts prefilled in it), after its warm-up; the arrivals off the count,
    each step inside a one-item `functools.reduce` of its own."""
    from paged_kv.bench.workloads.step_scale import TurnoverSteps

    turnover = TurnoverSteps(groups, seqs)
    if inside:
        _count_inside(inside)
    gc.collect()
    gc.disable()
    for _ in range(steps):
        turnover.refill()
        _counted(turnover.step, inside)


def count(kind: str, groups: int, seqs: int, steps: int, inside: str | None = None) -> float:
    """Instructions per step of `steps` decode steps of `seqs` sequences (see the module
    docstring); `inside`: only those inside that function's calls."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("step_instructions: valgrind not found on the PATH")
    env = dict(os.environ, PYTHONHASHSEED="0")
    warm = [sys.executable, __file__, "--child", kind, str(groups), "16", "1"]
    subprocess.run(warm, check=True, env=env)  # numba's loops compiled and cached
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "callgrind.out"
        subprocess.run([valgrind, "--tool=callgrind", "--collect-atstart=no",
                        "--toggle-collect=functools_reduce", f"--callgrind-out-file={out}",
                        sys.executable, __file__, "--child", kind, str(groups), str(seqs),
                        str(steps), *([inside] if inside else [])], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        totals = re.search(r"^(?:totals|summary):\s+(\d+)", out.read_text(), re.MULTILINE)
    if totals is None:
        raise SystemExit("step_instructions: no totals line in callgrind's output")
    return int(totals.group(1)) / steps


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        kind, groups, seqs, steps = sys.argv[2], *map(int, sys.argv[3:6])
        _steps(kind, groups, seqs, steps, *sys.argv[6:7])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=KINDS, default="engine")
    parser.add_argument("--groups", type=int, choices=(1, 3), default=3)
    parser.add_argument("--seqs", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--inside", metavar="MODULE:QUALNAME",
                        help="count only inside this function's calls (see the docstring)")
    args = parser.parse_args()
    if args.inside is not None and ":" not in args.inside:
        parser.error(f"--inside: expected MODULE:QUALNAME, got {args.inside!r}")
    per_step = count(args.kind, args.groups, args.seqs, args.steps, args.inside)
    where = f" inside {args.inside}" if args.inside else ""
    print(f"{args.kind}, {args.groups} group{'s' if args.groups > 1 else ''}, "
          f"{args.seqs} sequences: {per_step / 1e6:.3f} M instructions a step{where} "
          f"(over {args.steps} steps)")


if __name__ == "__main__":
    main()
