"""One decode step's bookkeeping against running sequences, and its growth per doubling.

    python benchmarks/step_growth.py [--seqs 256,512,1024] [--steps 40] [--repeats 3]

The ``step_cost`` workload's second part on its own (`paged_kv.bench.workloads.step_scale`):
1 layer group (full attention) and 3 (full, sliding window, recurrent state), each as the
cache's array step (`prepare_decode`) and as the engine's scheduler step, every size and
layout interleaved in each repeat. Prints ms per step (median of the repeats' medians, min
in brackets), the growth per doubling, and three groups against one. Issue 42's targets:
<= 0.6 ms at 1,024 sequences with three groups (scheduler included), <= 1.1x per doubling.
"""

from __future__ import annotations

import argparse
import gc

from paged_kv.bench.workloads.step_scale import KINDS, LAYOUTS, growth, label, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="256,512,1024", help="running sequences, doubling")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps a repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-gc", action="store_true",
                        help="disable the cyclic GC for the whole run: its passes over the "
                             "running sequences' objects are a cost of their own, and "
                             "land on whichever step allocates when they fall due")
    args = parser.parse_args()
    sizes = tuple(int(n) for n in args.seqs.split(","))
    if args.no_gc:
        gc.disable()
    stats = measure(sizes, args.steps, args.repeats)
    print(f"{'layout, step':52} " + " ".join(f"{n:>16}" for n in sizes)
          + "   growth per doubling")
    for groups in LAYOUTS:
        for kind in KINDS:
            times = [stats[(groups, kind, n)] for n in sizes]
            cells = " ".join(f"{1e3 * t.median:7.3f} ({1e3 * t.min:6.3f})" for t in times)
            rates = ", ".join(f"{ratio:.2f}x" for _, ratio in growth(stats, groups, kind))
            print(f"{label(groups, kind):52} {cells}   {rates}")
    for kind in KINDS:
        print(f"3 groups / 1 group, {kind}: " + ", ".join(
            f"{n}: {stats[(3, kind, n)].median / stats[(1, kind, n)].median:.2f}x"
            for n in sizes))


if __name__ == "__main__":
    main()
