"""The engine's time outside the model's forward on `paged-kv demo`'s workload.

    python benchmarks/engine_overhead.py [--repeats 4]

Times every `Engine.step`, every model forward of `run_demo` (one torch thread, so the
split is not muddied by thread scheduling) and the step's parts outside the forward
(schedule, the cache's prepare, sampling, the rest), and prints the best of the repeats.
"""

from __future__ import annotations

import argparse
import time

import torch

from paged_kv.demo.run import run_demo
from paged_kv.engine import engine as engine_module
from paged_kv.engine.engine import Engine
from paged_kv.engine.model import TinyLlama
from paged_kv.engine.scheduler import Scheduler

PARTS = ("schedule", "prepare", "sample")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spent = dict.fromkeys(("step", "forward", *PARTS), 0.0)

    def timed(owner, name, key):
        function = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start
        setattr(owner, name, wrapper)

    timed(TinyLlama, "forward", "forward")
    timed(Engine, "step", "step")
    timed(Scheduler, "schedule", "schedule")
    timed(Scheduler, "prepare", "prepare")
    timed(engine_module, "draw_rows", "sample")
    best = None
    for _ in range(args.repeats):
        spent.update(dict.fromkeys(spent, 0.0))
        run_demo(progress=False)
        outside = spent["step"] - spent["forward"]
        parts = {key: spent[key] for key in PARTS}
        parts["rest"] = outside - sum(parts.values())
        print(f"steps {spent['step']:.2f} s, forward {spent['forward']:.2f} s, outside the "
              f"forward {1e3 * outside:.0f} ms ({100 * outside / spent['step']:.1f}% of the "
              f"steps): " + ", ".join(f"{k} {1e3 * v:.0f}" for k, v in parts.items()))
        if best is None or outside < best[0]:
            best = outside, spent["step"]
    print(f"best: {1e3 * best[0]:.0f} ms outside the forward, "
          f"{100 * best[0] / best[1]:.1f}% of the steps' time")


if __name__ == "__main__":
    main()
