"""``--workloads tiers``: time to first token of a long prompt whose prefix comes from each
tier (device, host RAM, disk, Redis written by another process, Redis 50 ms away, Redis
down) against recomputing it, and the Redis store path against a raw pipeline.

Every repeat uses a fresh prompt, so the only cached copy is the one the condition put
there. The model is Llama-shaped with random weights, sized so that the prefill is long
enough (about a second here) for the tiers to matter.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable

import torch

from ...engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from ...engine.config import EngineConfig
from ...tiers import TierConfig, codec
from ..netdelay import DelayProxy, free_port, redis_server
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat

MODEL = dict(num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64, hidden_size=512,
             intermediate_size=1408, vocab_size=4096, max_position=4096)
BLOCK_SIZE = 8  # 2 x 8 layers x 8 tokens x 2 heads x 64 x 4 bytes = 64 KiB a block
PROMPT_LEN = 2048
DELAY_S = 0.025  # each way: a store 50 ms away
RECOMPUTE = "recompute (no tier holds the prefix)"
DESCRIPTION = (
    "TinyLlama with random weights ({layers} layers, hidden {hidden}, {kv_heads} KV heads x "
    "{head_dim}, float32), block size {block_size} ({block_kib:.0f} KiB blocks), prompts of "
    "{prompt_len} tokens, max_num_batched_tokens {prompt_len} (one prefill step), one token "
    "generated; time to first token from Engine.generate. Each repeat sends a fresh prompt: "
    "device = sent twice; host = written down, device prefix cache dropped, sent again; disk = "
    "written down by one engine, read by a new engine (a restart) after the files were "
    "dropped from the OS page cache (posix_fadvise DONTNEED); Redis = written by another "
    "process (a second engine in a subprocess), read here; Redis 50 ms away = the same "
    "through a loopback proxy holding every chunk 25 ms each way; Redis down = a URL where "
    "nothing listens. Baseline: the same prompt recomputed by an engine without tiers. "
    "Store path: RedisStore.put of encoded blocks (header and checksum included) against a "
    "raw redis-py pipeline SETting the same payloads; round trips per 64-block lookup "
    "counted at the proxy; Redis memory per payload byte from INFO memory.")


def _model() -> TinyLlama:
    return TinyLlama(TinyLlamaConfig(**MODEL), seed=0)


def _engine(model: TinyLlama, tiers: TierConfig | None) -> Engine:
    config = model.cache_config(num_blocks=2 * PROMPT_LEN // BLOCK_SIZE + 16,
                                block_size=BLOCK_SIZE)
    return Engine(model, EngineConfig(cache=config, max_num_batched_tokens=PROMPT_LEN,
                                      kv_tiers=tiers))


def _prompt(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, MODEL["vocab_size"], (PROMPT_LEN,), generator=generator).tolist()


def _ttft(engine: Engine, prompt: list[int]) -> float:
    [out] = engine.generate([prompt], SamplingParams(max_tokens=1))
    return out.time_to_first_token


def _warm(engine: Engine) -> Engine:
    """One short unrelated prompt through a fresh engine, so that what is timed next is
    not its first forward (the recompute baseline's engine is warm too)."""
    _ttft(engine, _prompt(-1)[:64])
    return engine


def _write(model: TinyLlama, tiers: TierConfig, prompt: list[int]) -> None:
    with _engine(model, tiers) as engine:
        _ttft(engine, prompt)
        engine.tiers.flush(60)


WRITER = textwrap.dedent("""
    import json, sys
    from paged_kv.bench.workloads import tiers
    from paged_kv.tiers import TierConfig
    url, prompt = sys.argv[1], json.loads(sys.stdin.read())
    tiers._write(tiers._model(), TierConfig(remote_url=url), prompt)
""")


def _write_elsewhere(url: str, prompt: list[int]) -> None:
    """Another replica process computes `prompt` and writes it down to Redis."""
    import json

    subprocess.run([sys.executable, "-c", WRITER, url], input=json.dumps(prompt), text=True,
                   check=True, timeout=300)


def _conditions(model: TinyLlama, url: str | None, workdir: str) -> dict[str, Callable]:
    """Each condition: seed -> TTFT of a fresh prompt served the condition's way."""

    def device(seed: int) -> float:
        with _engine(model, None) as engine:
            _ttft(engine, _prompt(seed))
            return _ttft(engine, _prompt(seed))

    def host(seed: int) -> float:
        with _engine(model, TierConfig(host_mib=256)) as engine:
            _ttft(engine, _prompt(seed))
            engine.tiers.flush(60)
            engine.cache.reset_prefix_cache()
            return _ttft(engine, _prompt(seed))

    def disk(seed: int) -> float:
        tiers = TierConfig(disk_dir=os.path.join(workdir, "disk"), disk_mib=1024)
        _write(model, tiers, _prompt(seed))
        with _engine(model, tiers) as engine:
            _warm(engine)
            engine.tiers.stores[0].drop_page_cache()
            return _ttft(engine, _prompt(seed))

    conditions = {"device (prefix cache)": device, "host RAM tier": host, "disk tier": disk}
    if url is None:
        return conditions

    def remote(seed: int, through: str | None = None) -> float:
        _write_elsewhere(url, _prompt(seed))
        with _engine(model, TierConfig(remote_url=through or url)) as engine:
            return _ttft(_warm(engine), _prompt(seed))

    def far(seed: int) -> float:
        proxy = DelayProxy(int(url.rsplit(":", 1)[1].split("/")[0]), DELAY_S)
        try:
            return remote(seed, f"redis://127.0.0.1:{proxy.port}/0")
        finally:
            proxy.close()

    def down(seed: int) -> float:
        with _engine(model, TierConfig(remote_url=f"redis://127.0.0.1:{free_port()}/0")) as e:
            return _ttft(_warm(e), _prompt(seed))

    conditions.update({"Redis tier, written by another process": remote,
                       "Redis tier 50 ms away": far, "Redis tier down": down})
    return conditions


def _store_figures(url: str, repeats: int, nbytes: int) -> tuple[list[Figure], dict]:
    """RedisStore.put (encoded) against a raw pipeline of the same payloads; round trips
    of a 64-block lookup; Redis memory per payload byte."""
    import redis

    from ...tiers.remote import RedisStore

    store = RedisStore(url, value_bytes=codec.HEADER.size + nbytes)
    raw = redis.Redis.from_url(url)
    digest, count = os.urandom(16), 64
    payloads = [os.urandom(nbytes) for _ in range(count)]
    ours, theirs = [], []
    for r in range(repeats):
        keys = [os.urandom(32) for _ in range(count)]
        start = time.perf_counter()
        store.put([(codec.store_key("bench", k), codec.encode(k, digest, p))
                   for k, p in zip(keys, payloads, strict=True)])
        ours.append(time.perf_counter() - start)
        pipe = raw.pipeline(transaction=False)
        start = time.perf_counter()
        for k, p in zip(keys, payloads, strict=True):
            pipe.set(f"raw:{r}:{k.hex()}", p)
        pipe.execute()
        theirs.append(time.perf_counter() - start)
    raw.flushall()
    used = raw.info("memory")["used_memory"]
    keys = [os.urandom(32) for _ in range(count)]
    store.put([(codec.store_key("bench", k), codec.encode(k, digest, p))
               for k, p in zip(keys, payloads, strict=True)])
    per_byte = (raw.info("memory")["used_memory"] - used) / (count * nbytes)
    trips = _lookup_round_trips(url, keys)
    store.close()
    mib = count * nbytes / 2**20
    figure = Figure(f"store {count} blocks of {nbytes // 1024} KiB", Stat(tuple(
        mib / s for s in ours), "MiB/s"), "raw redis-py pipeline SET, same payloads",
        Stat(tuple(mib / s for s in theirs), "MiB/s"), higher_is_better=True)
    return [figure], {"round trips per 64-block lookup (its time / the added RTT)":
                      round(trips, 2),
                      "Redis memory / payload bytes": round(per_byte, 4)}


def _lookup_round_trips(url: str, keys: list[bytes]) -> float:
    """Round trips of one lookup of `keys` through a proxy adding `DELAY_S` each way: its
    time over the time a round trip adds."""
    from ...tiers.remote import RedisStore

    proxy = DelayProxy(int(url.rsplit(":", 1)[1].split("/")[0]), DELAY_S)
    far = RedisStore(f"redis://127.0.0.1:{proxy.port}/0")
    far.contains([codec.store_key("bench", keys[0])])  # connect first
    start = time.perf_counter()
    far.contains([codec.store_key("bench", k) for k in keys])
    trips = (time.perf_counter() - start) / (2 * DELAY_S)
    far.close()
    proxy.close()
    return trips


def run(scale: Scale) -> WorkloadResult:
    """TTFT per tier against recompute, and the Redis store path."""
    repeats = max(2, min(3, scale.repeats))
    model = _model()
    nbytes = model.cache_config(num_blocks=2, block_size=BLOCK_SIZE).bytes_per_block
    figures, info, notes = [], {"repeats": repeats, "prompt tokens": PROMPT_LEN}, []
    with tempfile.TemporaryDirectory() as workdir, contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(redis_server())
        except (FileNotFoundError, RuntimeError) as exc:
            url = None
            notes.append(f"no Redis figures: {exc}")
        seeds = iter(range(10**6))
        with _engine(model, None) as engine:
            _ttft(engine, _prompt(next(seeds)))  # warm up
            base = Stat(tuple(_ttft(engine, _prompt(next(seeds))) for _ in range(repeats)), "s")
        for name, condition in _conditions(model, url, workdir).items():
            value = Stat(tuple(condition(next(seeds)) for _ in range(repeats)), "s")
            figures.append(Figure(f"TTFT, prefix from the {name}", value, RECOMPUTE, base,
                                  higher_is_better=False))
        if url is not None:
            store_figures, store_info = _store_figures(url, repeats, nbytes)
            figures += store_figures
            info.update(store_info)
    description = DESCRIPTION.format(
        layers=MODEL["num_layers"], hidden=MODEL["hidden_size"], kv_heads=MODEL["num_kv_heads"],
        head_dim=MODEL["head_dim"], block_size=BLOCK_SIZE, block_kib=nbytes / 1024,
        prompt_len=PROMPT_LEN)
    ttft = [f for f in figures if f.name.startswith("TTFT")]
    labels = tuple(f.name.removeprefix("TTFT, prefix from the ") for f in ttft)
    plot = Plot(f"Time to first token, {PROMPT_LEN}-token prompt", "where the prefix is", "s",
                (Series("from the tier", labels, tuple(f.value.median for f in ttft)),
                 Series("recompute", labels, tuple(f.baseline.median for f in ttft))),
                kind="bar")
    return WorkloadResult("tiers", "Cache tiers: a prefix from each tier against recompute",
                          description, figures, info, plots=[plot], notes=notes)
