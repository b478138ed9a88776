"""The engine's time outside the model's forward on `paged-kv demo`'s workload.

    python benchmarks/engine_overhead.py [--repeats 4]

Times every `Engine.step` and every model forward of `run_demo` (one torch thread, so
the split is not muddied by thread scheduling) and prints the best of the repeats.
"""

from __future__ import annotations

import argparse
import time

import torch

from paged_kv.serving.demo import run_demo
from paged_kv.serving.engine import Engine
from paged_kv.serving.model import TinyLlama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spent = {"step": 0.0, "forward": 0.0}

    def timed(function, key):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start
        return wrapper

    TinyLlama.forward = timed(TinyLlama.forward, "forward")
    Engine.step = timed(Engine.step, "step")
    best = None
    for _ in range(args.repeats):
        spent.update(step=0.0, forward=0.0)
        run_demo(progress=False)
        outside = spent["step"] - spent["forward"]
        best = outside if best is None else min(best, outside)
        print(f"steps {spent['step']:.2f} s, forward {spent['forward']:.2f} s, "
              f"outside the forward {1e3 * outside:.0f} ms")
    print(f"best: {1e3 * best:.0f} ms outside the forward")


if __name__ == "__main__":
    main()
