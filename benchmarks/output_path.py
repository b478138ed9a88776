"""What one step's outputs cost on their way to the API server, per part, at N streams.

    python benchmarks/output_path.py [--streams 256,1024] [--repeats 200]

The ``step_cost`` lines time the engine's step (its bookkeeping, and the engine line its
outputs too); a served step then goes on through the engine-core process and the API
server. This times, for one step of N running requests with a token each (plain outputs:
no finish, no log-probabilities), each part a served step pays per output:

- ``emit, carried``: `emit_samples` as a steady step hands the outputs over (made and
  given to each request's listener in C);
- ``emit, changed``: the same as a step whose running set changed hands them over (a
  pass in Python; a loaded server's usual step, as requests finish and arrive);
- ``core collect``: the engine core's listener (`EngineCoreProc._collect`), called once
  per output, queueing it for its API server;
- ``encode`` / ``decode``: the step's `messages.Outputs` as msgpack, in the core and in the
  API server.

Prints µs per step (median of `--repeats`) and per output. The listeners are cheap stand-ins
(`list.append`) except the core's, which is its own method on a bare instance.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

from paged_kv.engine import SamplingParams, StepOutput
from paged_kv.engine.process import messages
from paged_kv.engine.process.engine_core import EngineCoreProc
from paged_kv.engine.request import Request, Sequence
from paged_kv.engine.stream import emit_samples


class _Front:
    closed = False


def _median_us(run, repeats: int) -> float:
    """Median µs of `run()` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def measure(streams: int, repeats: int) -> dict[str, float]:
    """µs per step of each part (see the module docstring) for `streams` outputs."""
    sink: list[StepOutput] = []
    requests = [Request(i, [1, 2, 3], SamplingParams(max_tokens=8), 0.0, on_output=sink.append)
                for i in range(streams)]
    seqs = [Sequence(request, 0, [1, 2, 3], None) for request in requests]
    samples = [(seq, 7, None) for seq in seqs]
    plain = ([sink.append] * streams, list(range(streams)), [0] * streams, (7,) * streams, [])

    core = EngineCoreProc.__new__(EngineCoreProc)  # its `_collect`'s state alone
    core._ids, core._unstarted, core._told, core._pending = {}, set(), {}, {}
    front = _Front()
    listeners = [partial(core._collect, front, i) for i in range(streams)]
    outputs = [StepOutput(i, 0, [7], None) for i in range(streams)]

    def collect() -> None:
        core._pending = {}
        for listener, out in zip(listeners, outputs, strict=True):
            listener(out)

    message = messages.Outputs([(i, out) for i, out in enumerate(outputs)], 0, 0)
    frame = messages.encode(message)
    parts = {
        "emit, carried": lambda: (emit_samples(samples, [], plain), sink.clear()),
        "emit, changed": lambda: (emit_samples(samples, []), sink.clear()),
        "core collect": collect,
        "encode": lambda: messages.encode(message),
        "decode": lambda: messages.decode_from_core(frame),
    }
    return {name: _median_us(run, repeats) for name, run in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="256,1024", help="outputs in the step")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    for streams in (int(n) for n in args.streams.split(",")):
        for name, us in measure(streams, args.repeats).items():
            print(f"{streams:5d} streams  {name:14s} {us:8.1f} us a step "
                  f"{1e3 * us / streams:6.1f} ns an output")


if __name__ == "__main__":
    main()
