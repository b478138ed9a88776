"""The torch path's recurrences, sequential scan against chunked, on CPU.

``python benchmarks/recurrent_chunked.py [threads] [cross|big]``: ``cross`` times one sequence
of 1-64 tokens (the crossover behind ``recurrent.CHUNKED_FROM``), ``big`` one 512-token
prefill of a Qwen3-Next-sized gated delta layer (16 heads, key and value dims 128). Each
figure is the best of 5 runs (other processes share the cores).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from paged_kv.kernels import recurrent


def best(fn: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of `repeats` timed runs of `fn`, after one warm-up, in seconds."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def delta(length: int, heads: int = 16, key_heads: int = 16,
          dim: int = 128) -> Callable[[], object]:
    """One fresh-state gated delta rule call on `length` random tokens."""
    q, k = torch.randn(length, key_heads, dim), torch.randn(length, key_heads, dim)
    v, g = torch.randn(length, heads, dim), -F.softplus(torch.randn(length, heads))
    beta, state = torch.sigmoid(torch.randn(length, heads)), torch.randn(1, heads, dim, dim)
    cu = torch.tensor([0, length])
    return lambda: recurrent.gated_delta_rule(q, k, v, g, beta, cu, state)


def ssd(length: int, heads: int = 8, dim: int = 16, size: int = 16) -> Callable[[], object]:
    """One SSD call on `length` random tokens, one group."""
    x, dt = torch.randn(length, heads, dim), torch.randn(length, heads)
    B, C = torch.randn(length, 1, size), torch.randn(length, 1, size)
    A, D, state = -torch.rand(heads), torch.randn(heads), torch.randn(1, heads, dim, size)
    cu = torch.tensor([0, length])
    return lambda: recurrent.ssd(x, dt, A, B, C, D, cu, state, torch.randn(heads))


def compare(name: str, make: Callable[[int], Callable[[], object]], lengths) -> None:
    """Print the scan's and the chunked path's best time at each length."""
    saved = recurrent.CHUNKED_FROM[name]
    for length in lengths:
        fn = make(length)
        recurrent.CHUNKED_FROM[name] = None
        scanned = best(fn)
        recurrent.CHUNKED_FROM[name] = 1
        chunked = best(fn)
        print(f"{name} {length} tokens: scan {scanned * 1e3:.2f} ms, chunked "
              f"{chunked * 1e3:.2f} ms ({scanned / chunked:.1f}x)", flush=True)
    recurrent.CHUNKED_FROM[name] = saved


if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    if (sys.argv[2] if len(sys.argv) > 2 else "cross") == "big":
        compare("gated_delta_rule", delta, [512])
    else:
        compare("gated_delta_rule", lambda n: delta(n, 4, 2, 16), [1, 2, 4, 8, 16, 32, 64])
        compare("gated_delta_rule", delta, [1, 2, 4, 8, 16, 32])
        compare("ssd", ssd, [1, 2, 4, 8, 16, 32, 64])
