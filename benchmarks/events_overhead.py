"""What publishing KV events costs an engine: the same requests with and without.

    python benchmarks/events_overhead.py [--repeats 3]

48 prompts of 50-400 tokens, 32 generated tokens each, through the embedded TinyLlama
(one torch thread); runs alternate between an engine with ``kv_events`` (token ids on, the
costliest form) and one without, and the best and median of each are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from paged_kv.engine import Engine, SamplingParams, TinyLlama
from paged_kv.engine.config import EngineConfig
from paged_kv.events import KVEventsConfig


def _run(model: TinyLlama, prompts: list[list[int]], events: bool) -> tuple[float, int]:
    config = (KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", token_ids=True)
              if events else None)
    with Engine(model, EngineConfig(cache=model.cache_config(num_blocks=2048),
                                    kv_events=config)) as engine:
        engine.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
        seconds = time.perf_counter() - start
        return seconds, 0 if engine.events is None else engine.events.num_published


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = TinyLlama()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(50, 400, (48,), generator=generator).tolist()
    prompts = [torch.randint(0, 255, (n,), generator=generator).tolist() for n in lengths]
    times: dict[bool, list[float]] = {False: [], True: []}
    batches = 0
    for _ in range(args.repeats):
        for events in (False, True):
            seconds, published = _run(model, prompts, events)
            times[events].append(seconds)
            batches = max(batches, published)
    for events, label in ((False, "without events"), (True, "with events")):
        print(f"{label:>15}: best {min(times[events]):.3f} s, "
              f"median {statistics.median(times[events]):.3f} s")
    print(f"{batches} batches published a run; with / without (best): "
          f"{min(times[True]) / min(times[False]):.3f}")


if __name__ == "__main__":
    main()
