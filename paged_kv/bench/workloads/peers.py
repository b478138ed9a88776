"""``--workloads peers``: the engine against what a transformers user would run instead.

The same greedy requests on one seeded local Llama checkpoint (built here, never
downloaded) go through `Engine` + `HFCausalLM`, transformers' `generate_batch` (its own
continuous batching over its paged cache; at its defaults, and tuned for CPU) and plain
`generate` with a `DynamicCache` in left-padded batches, interleaved within each repeat.
Every system must produce the engine's tokens before any speed is reported: a faster
wrong answer is no result. Needs the ``hf`` extra.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .. import trace
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat, percentile

BLOCK_SIZE = 16
BATCH_TOKENS = 512      # the engine's max_num_batched_tokens, and generate_batch's when tuned
GENERATE_BATCH = 16     # plain generate: requests per left-padded batch
SYSTEM_PROMPT_LEN = 128
MEDIAN_PROMPT_LEN = 150
ENGINE = "paged_kv Engine"
GB_DEFAULT = "generate_batch, defaults"
GB_TUNED = "generate_batch, tuned"
GENERATE = "generate, DynamicCache"
SKIP_REASON = "peers: skipped, needs the hf extra (pip install 'paged_kv[hf]')"
DESCRIPTION = (
    "{num_requests} requests, greedy, {new_tokens} new tokens each, on a seeded Llama "
    "checkpoint ({model}) saved locally with save_pretrained. Prompts: lognormal lengths "
    "(median {median} tokens), every second one behind one shared {system}-token system "
    "prompt. Systems, interleaved within each repeat: the engine (HFCausalLM, block size "
    "{block_size}, {batch_tokens} tokens per step, a pool of {num_blocks} blocks); "
    "transformers {version} generate_batch at its defaults{defaults_note}, and tuned for CPU "
    "(page_size {block_size}, max_batch_tokens {batch_tokens}, num_blocks {num_blocks}: the "
    "engine's); generate with a DynamicCache in left-padded batches of {batch} (explicit "
    "attention mask). All four produced identical tokens (checked before timing is reported). "
    "Serving time runs from the requests' arrival to the last token, after each system is set "
    "up; 'with setup' adds building the engine or starting generate_batch's manager (which "
    "allocates its cache). Time to first token is measured where a system reports it "
    "(generate does not). KV bytes: the engine's pool, generate_batch's cache tensor, the "
    "largest DynamicCache. RSS: the process's resident memory at its peak during the run, above "
    "what it was before (sampled every 5 ms).")


@dataclasses.dataclass(frozen=True, slots=True)
class PeerRun:
    """One system serving all requests once (times in seconds, memory in bytes)."""

    token_ids: tuple[tuple[int, ...], ...]
    serve_s: float
    total_s: float
    ttft: tuple[float, ...] | None
    kv_bytes: int
    rss_growth: int
    kv_bytes_used: int | None = None  # the engine's live blocks at its busiest step


class PeakRSS:
    """Context manager: the process's peak resident bytes above its value on entry."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.growth = 0

    @staticmethod
    def current() -> int:
        """Resident bytes now (``/proc/self/statm``; 0 where there is none)."""
        try:
            return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGESIZE")
        except OSError:
            return 0

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.growth = max(self.growth, self.current() - self._start)

    def __enter__(self) -> PeakRSS:
        self._start = self.current()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.growth = max(self.growth, self.current() - self._start)
        self._stop.set()
        self._thread.join()


def build_checkpoint(path: Path, *, hidden: int, layers: int, heads: int, kv_heads: int,
                     vocab: int, max_position: int, seed: int = 0) -> Path:
    """Save a seeded random Llama (float32, no EOS, pad id 0) under `path`; returns `path`."""
    import transformers

    torch.manual_seed(seed)
    # a wide init keeps the logits apart, so greedy choices are not decided by rounding
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_position, initializer_range=0.1, bos_token_id=None,
        eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config = transformers.GenerationConfig(pad_token_id=0)
    model.save_pretrained(path)
    return path


def make_prompts(num_requests: int, *, vocab: int, seed: int = 0,
                 max_prompt_len: int = 512) -> list[list[int]]:
    """Lognormal prompt lengths (median `MEDIAN_PROMPT_LEN`), every second one behind one
    shared `SYSTEM_PROMPT_LEN`-token system prompt counted in its length; ids from 1 (0 pads)."""
    lengths = trace.LognormalLengths.with_median(MEDIAN_PROMPT_LEN, 0.6, low=8, high=max_prompt_len)
    return trace.make_prompts(trace.PromptSpec(
        lengths, vocab_size=vocab, min_token_id=1, system_prompt_len=SYSTEM_PROMPT_LEN,
        shared_fraction=0.5, length_counts_system=True), num_requests, seed)


def run_engine(runner: torch.nn.Module, prompts: list[list[int]], new_tokens: int,
               num_blocks: int) -> PeerRun:
    """The engine on `runner` (an `HFCausalLM`), all requests queued at once."""
    from ...engine import Engine, SamplingParams
    from ...engine.config import EngineConfig

    with PeakRSS() as rss:
        start = time.perf_counter()
        engine = Engine(runner, EngineConfig(
            cache=runner.cache_config(num_blocks=num_blocks, block_size=BLOCK_SIZE),
            max_num_seqs=len(prompts), max_num_batched_tokens=BATCH_TOKENS))
        serve_start = time.perf_counter()
        ids = [engine.add_request(p, SamplingParams(max_tokens=new_tokens)) for p in prompts]
        finished, peak_blocks = {}, 0
        while engine.has_unfinished_requests:
            finished.update((out.request_id, out) for out in engine.step())
            peak_blocks = max(peak_blocks, engine.stats().num_live_blocks)
        end = time.perf_counter()
    outputs = [finished[i] for i in ids]
    return PeerRun(tuple(tuple(out.outputs[0].token_ids) for out in outputs), end - serve_start,
                   end - start, tuple(out.time_to_first_token for out in outputs),
                   engine.cache.config.total_bytes, rss.growth,
                   peak_blocks * engine.cache.config.bytes_per_block)


def run_generate_batch(model, prompts: list[list[int]], new_tokens: int,
                       cb_config=None) -> PeerRun:
    """transformers' `generate_batch`; serving time from the first request's creation (after
    the manager is set up) to the last one's end, as its outputs record them."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    with PeakRSS() as rss:
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=config,
                                       continuous_batching_config=cb_config,
                                       record_timestamps=True, persistent_manager=True)
        total = time.perf_counter() - start
        manager = model._cached_continuous_batching_manager
        kv_bytes = manager.batch_processor.cache.cache_tensor.nbytes
        model.destroy_cached_continuous_batching_manager()
    results = list(outputs.values())
    first = min(r.created_time for r in results)
    return PeerRun(tuple(tuple(r.generated_tokens) for r in results),
                   max(r.lifespan[1] for r in results) - first, total,
                   tuple(r.timestamps[0] - r.created_time for r in results), kv_bytes,
                   rss.growth)


def run_generate(model, prompts: list[list[int]], new_tokens: int) -> PeerRun:
    """Plain `generate` on left-padded batches of `GENERATE_BATCH`, one after another."""
    tokens, kv_bytes = [], 0
    with PeakRSS() as rss:
        start = time.perf_counter()
        for first in range(0, len(prompts), GENERATE_BATCH):
            batch = prompts[first:first + GENERATE_BATCH]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=new_tokens, pad_token_id=0,
                                 return_dict_in_generate=True)
            tokens += [tuple(row) for row in out.sequences[:, width:].tolist()]
            cache = getattr(out, "cache", None) or out.past_key_values  # renamed in 5.x
            kv_bytes = max(kv_bytes, sum(layer.keys.nbytes + layer.values.nbytes
                                         for layer in cache.layers))
        elapsed = time.perf_counter() - start
    return PeerRun(tuple(tokens), elapsed, elapsed, None, kv_bytes, rss.growth)


SYSTEMS = (ENGINE, GB_DEFAULT, GB_TUNED, GENERATE)
METRICS = [  # name, value of one run (None: not measured), unit, higher is better
    ("throughput, generated tokens (serving)", lambda r, n: n / r.serve_s, "tokens/s", True),
    ("throughput, generated tokens (with setup)", lambda r, n: n / r.total_s, "tokens/s", True),
    ("time to first token, median", lambda r, n: r.ttft and 1e3 * percentile(r.ttft, 50), "ms",
     False),
    ("time to first token, p99", lambda r, n: r.ttft and 1e3 * percentile(r.ttft, 99), "ms",
     False),
    ("KV cache bytes allocated", lambda r, n: r.kv_bytes / 2**20, "MiB", False),
    ("process RSS growth at peak", lambda r, n: max(r.rss_growth, 1) / 2**20, "MiB", False),
]


def run(scale: Scale) -> WorkloadResult | None:
    """All systems on the same requests, `scale.peers_repeats` interleaved repeats; None (the
    caller prints `SKIP_REASON`) without transformers."""
    if importlib.util.find_spec("transformers") is None:
        return None
    import transformers

    from ...engine.hf import HFCausalLM

    prompts = make_prompts(scale.peers_requests, vocab=scale.peers_vocab)
    num_blocks = sum(-(-(len(p) + scale.peers_new_tokens) // BLOCK_SIZE) for p in prompts) + 1
    quiet = logging.getLogger("ContinuousBatchingLogger")  # psutil and EOS notices, per call
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    transformers.utils.logging.disable_progress_bar()  # one bar per checkpoint load
    try:
        with tempfile.TemporaryDirectory(prefix="paged-kv-peers-") as tmp:
            path = build_checkpoint(Path(tmp), hidden=scale.peers_hidden, heads=8, kv_heads=4,
                                    layers=scale.peers_layers, vocab=scale.peers_vocab,
                                    max_position=1024)
            models = (HFCausalLM.from_pretrained(path), *(
                transformers.AutoModelForCausalLM.from_pretrained(path).eval() for _ in range(2)))
        for warm_up in _systems(scale, *models, prompts[:2], num_blocks).values():
            warm_up()  # first calls pay for lazy imports and allocator growth
        systems = _systems(scale, *models, prompts, num_blocks)
        runs: dict[str, list[PeerRun]] = {name: [] for name in systems}
        for _ in range(scale.peers_repeats):
            for name, serve in systems.items():
                runs[name].append(serve())
    finally:
        quiet.setLevel(level)
        transformers.utils.logging.enable_progress_bar()
    _check_same_tokens(runs, prompts)
    return _result(scale, runs, prompts, num_blocks, transformers.__version__)


def _systems(scale: Scale, runner, batch_model, generate_model, prompts: list[list[int]],
             num_blocks: int) -> dict[str, Callable[[], PeerRun]]:
    from transformers import ContinuousBatchingConfig

    new = scale.peers_new_tokens
    tuned = dict(page_size=BLOCK_SIZE, max_batch_tokens=BATCH_TOKENS, num_blocks=num_blocks)
    systems = {ENGINE: lambda: run_engine(runner, prompts, new, num_blocks)}
    if scale.peers_defaults:
        systems[GB_DEFAULT] = lambda: run_generate_batch(batch_model, prompts, new)
    systems[GB_TUNED] = lambda: run_generate_batch(batch_model, prompts, new,
                                                   ContinuousBatchingConfig(**tuned))
    systems[GENERATE] = lambda: run_generate(generate_model, prompts, new)
    return systems


def _check_same_tokens(runs: dict[str, list[PeerRun]], prompts: list[list[int]]) -> None:
    """Raise RuntimeError, naming the first difference, unless every run equals the engine's."""
    want = runs[ENGINE][0].token_ids
    for name, system_runs in runs.items():
        for repeat, peer in enumerate(system_runs):
            for i, (a, b) in enumerate(zip(want, peer.token_ids, strict=True)):
                if a != b:
                    at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                              min(len(a), len(b)))
                    raise RuntimeError(
                        f"peers: {name} (repeat {repeat}) differs from the engine on request "
                        f"{i} (prompt of {len(prompts[i])} tokens) at generated token {at}; "
                        f"no speed is reported for different answers")


def _result(scale: Scale, runs: dict[str, list[PeerRun]], prompts: list[list[int]],
            num_blocks: int, version: str) -> WorkloadResult:
    generated = sum(map(len, runs[ENGINE][0].token_ids))
    figures = []
    for name, metric, unit, higher in METRICS:
        engine = Stat(tuple(metric(r, generated) for r in runs[ENGINE]), unit)
        for peer in SYSTEMS[1:]:
            values = [metric(r, generated) for r in runs.get(peer, [])]
            if values and all(v is not None for v in values):
                figures.append(Figure(name, engine, peer, Stat(tuple(values), unit), higher))
    model = (f"Llama, hidden {scale.peers_hidden}, {scale.peers_layers} layers, 8/4 heads, "
             f"vocab {scale.peers_vocab}, float32")
    info = {"prompt tokens": sum(map(len, prompts)), "generated tokens": generated,
            "longest prompt (tokens)": max(map(len, prompts)), "model": model,
            "engine: KV in use at its busiest step (MiB)":
                runs[ENGINE][-1].kv_bytes_used / 2**20}
    return WorkloadResult(
        key="peers", title="7. Peers: the engine against transformers' generate_batch and generate",
        description=DESCRIPTION.format(
            num_requests=len(prompts), new_tokens=scale.peers_new_tokens, model=model,
            median=MEDIAN_PROMPT_LEN, system=SYSTEM_PROMPT_LEN, block_size=BLOCK_SIZE,
            batch_tokens=BATCH_TOKENS, num_blocks=num_blocks, version=version,
            batch=GENERATE_BATCH,
            defaults_note="" if scale.peers_defaults else " (left out in --quick: it sizes "
            "its cache from the free memory, which takes seconds to allocate)"),
        figures=figures, info=info, plots=_plots(runs, generated))


def _plots(runs: dict[str, list[PeerRun]], generated: int) -> list[Plot]:
    names = tuple(runs)

    def bars(metric) -> tuple[float, ...]:
        return tuple(float(np.median([metric(r) for r in runs[n]])) for n in names)

    speed = Plot("generated tokens/s (median over repeats)", "", "tokens/s", (
        Series("serving", names, bars(lambda r: generated / r.serve_s)),
        Series("with setup", names, bars(lambda r: generated / r.total_s))), kind="bar")
    memory = Plot("memory", "", "MiB", (
        Series("KV cache allocated", names, bars(lambda r: r.kv_bytes / 2**20)),
        Series("RSS growth at peak", names, bars(lambda r: r.rss_growth / 2**20))), kind="bar",
        logy=True)
    return [speed, memory]
