"""``--workloads tenants``: a noisy neighbour on `paged-kv serve`, with and without a
tenant policy.

Two tenants share one server (the embedded TinyLlama, a pool of four system prompts).
The noisy tenant floods unique prompts from a few closed-loop clients; the quiet tenant
sends one request behind a long system prompt after every ten of the noisy tenant's. Four
runs, each on a fresh server: the quiet tenant alone (its solo hit rate, the target's
denominator), both with no policy (one global LRU: today's default), with a quota on the
noisy tenant, and with a reservation for the quiet tenant. Reported: the quiet tenant's
prefix hit rate and time to first token, the noisy tenant's throughput, each against the
run without a policy (the hit rate also against the solo run).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from ..netdelay import serve_process
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat, percentile

BLOCK = 16
POOL_PER_PROMPT = 4  # the pool holds four system prompts: ten noisy prompts overrun it
NOISY_CLIENTS = 3
RATE_RATIO = 10  # noisy requests per quiet request
KEYS = {"noisy": "sk-noisy", "quiet": "sk-quiet"}
DESCRIPTION = (
    "paged-kv serve (embedded TinyLlama, {blocks} blocks of {block} tokens) on 127.0.0.1, a "
    "fresh server per run. Noisy tenant: {clients} closed-loop clients sending unique "
    "{noisy_len}-token prompts (max_tokens 8). Quiet tenant: after every {ratio} noisy "
    "completions, one request of a {system_len}-token system prompt plus a unique "
    "{suffix}-token question (max_tokens 1: its latency is its time to first token); "
    "{quiet_requests} of them. Hit rate: cached_tokens / prompt_tokens of the quiet "
    "tenant's requests after its first (from each response's usage). Policies (tenants "
    "file): none; quota: the noisy tenant may keep {quota} cached blocks; reservation: "
    "{reservation} of the quiet tenant's cached blocks are kept from the other's pressure. "
    "Noisy throughput: its prompt and generated tokens over its run time.")


def _shape(scale: Scale) -> dict:
    quick = scale.name == "quick"
    system_len = 1024 if quick else 2048
    blocks = POOL_PER_PROMPT * system_len // BLOCK
    return {"system_len": system_len, "noisy_len": system_len // 2, "suffix": 32,
            "quiet_requests": 4 if quick else 8, "ratio": RATE_RATIO,
            "clients": NOISY_CLIENTS, "blocks": blocks, "block": BLOCK,
            "quota": blocks // 4, "reservation": system_len // BLOCK + 4}


def _memory_mib(blocks: int) -> float:
    """The --memory-mib that gives the embedded model's pool `blocks` blocks."""
    from ...engine import TinyLlama

    per_block = TinyLlama().cache_config(num_blocks=2, block_size=BLOCK).bytes_per_block
    return blocks * per_block / 2**20


def tenants_file(policy: str, shape: dict) -> str:
    """The TOML tenants file of one run (`policy`: none, quota or reservation)."""
    limits = {"none": ("", ""), "quota": (f"quota = {shape['quota']}\n", ""),
              "reservation": ("", f"reservation = {shape['reservation']}\n")}[policy]
    return "".join(f'[tenants.{name}]\nkeys = ["{KEYS[name]}"]\n{extra}'
                   for name, extra in zip(("noisy", "quiet"), limits, strict=True))


@contextlib.contextmanager
def _server(policy: str, shape: dict, threads: int):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tenants.toml"
        path.write_text(tenants_file(policy, shape))
        with serve_process(threads, "--api-keys", str(path), "--max-waiting", "100000",
                           "--block-size", str(BLOCK), "--memory-mib",
                           repr(_memory_mib(shape["blocks"]))) as port:
            yield port


async def _post(session, url: str, tenant: str, prompt: list[int], max_tokens: int) -> dict:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    async with session.post(url, json=body, headers=headers) as response:
        response.raise_for_status()
        return (await response.json())["usage"]


async def _drive(port: int, shape: dict, noisy: bool, seed: int) -> dict:
    """One run: the quiet tenant's requests (behind the noisy tenant's, when `noisy`)."""
    import aiohttp

    rng = random.Random(seed)
    vocab = 2000
    system = [rng.randrange(1, vocab) for _ in range(shape["system_len"])]
    url = f"http://127.0.0.1:{port}/v1/completions"
    done, stop = [0], asyncio.Event()
    noisy_tokens: list[int] = []

    async def flood(session) -> None:
        while not stop.is_set():
            prompt = [rng.randrange(1, vocab) for _ in range(shape["noisy_len"])]
            usage = await _post(session, url, "noisy", prompt, 8)
            noisy_tokens.append(usage["total_tokens"])
            done[0] += 1

    hits, latencies = [], []
    async with aiohttp.ClientSession() as session:
        clients = [asyncio.create_task(flood(session))
                   for _ in range(shape["clients"] if noisy else 0)]
        start = time.perf_counter()
        for i in range(shape["quiet_requests"]):
            while noisy and done[0] < shape["ratio"] * i:
                await asyncio.sleep(0.005)
            question = [rng.randrange(1, vocab) for _ in range(shape["suffix"])]
            sent = time.perf_counter()
            usage = await _post(session, url, "quiet", system + question, 1)
            latencies.append(time.perf_counter() - sent)
            details = usage.get("prompt_tokens_details") or {}
            hits.append(details.get("cached_tokens", 0) / usage["prompt_tokens"])
        stop.set()
        await asyncio.gather(*clients)
        wall = time.perf_counter() - start
    return {"hit_rate": float(np.mean(hits[1:])), "ttft": latencies[1:],
            "noisy_throughput": sum(noisy_tokens) / wall if noisy else 0.0}


def _one(policy: str, shape: dict, noisy: bool, seed: int) -> dict:
    import torch

    with _server(policy, shape, torch.get_num_threads()) as port:
        return asyncio.run(_drive(port, shape, noisy, seed))


def run(scale: Scale) -> WorkloadResult:
    """The solo run and the three policies, alternating over the repeats."""
    shape = _shape(scale)
    repeats = 1 if scale.name == "quick" else 2
    runs: dict[str, list[dict]] = {k: [] for k in ("solo", "none", "quota", "reservation")}
    for r in range(repeats):
        runs["solo"].append(_one("none", shape, False, seed=r))
        for policy in ("none", "quota", "reservation"):
            runs[policy].append(_one(policy, shape, True, seed=r))
    return _result(runs, shape, repeats)


def _stat(runs: list[dict], key: str, unit: str, scale: float = 1.0) -> Stat:
    return Stat(tuple(scale * r[key] for r in runs), unit)


def _ttft(runs: list[dict], q: int) -> Stat:
    return Stat(tuple(1e3 * percentile(r["ttft"], q) for r in runs), "ms")


def _result(runs: dict[str, list[dict]], shape: dict, repeats: int) -> WorkloadResult:
    # the hit rates against the solo run (no policy's collapses: a ratio to it divides by 0)
    figures = [Figure(f"{policy}: quiet tenant's hit rate",
                      _stat(runs[policy], "hit_rate", "fraction"), "quiet tenant alone",
                      _stat(runs["solo"], "hit_rate", "fraction"), True)
               for policy in ("none", "quota", "reservation")]
    for policy in ("quota", "reservation"):
        mine = runs[policy]
        figures += [
            Figure(f"{policy}: quiet tenant's time to first token, p50", _ttft(mine, 50),
                   "no policy", _ttft(runs["none"], 50), False),
            Figure(f"{policy}: quiet tenant's time to first token, p95", _ttft(mine, 95),
                   "no policy", _ttft(runs["none"], 95), False),
            Figure(f"{policy}: noisy tenant's throughput",
                   _stat(mine, "noisy_throughput", "tokens/s"), "no policy",
                   _stat(runs["none"], "noisy_throughput", "tokens/s"), True)]
    labels = ("alone", "no policy", "quota", "reservation")
    hit = tuple(float(np.median([r["hit_rate"] for r in runs[k]])) for k in runs)
    plot = Plot("the quiet tenant's prefix hit rate", "", "cached / prompt tokens",
                (Series("hit rate", labels, hit),), kind="bar")
    return WorkloadResult(
        key="tenants", title="Tenants: a noisy neighbour with and without a tenant policy",
        description=DESCRIPTION.format(**shape), figures=figures,
        info={"quiet tenant's hit rate alone / no policy (median)":
              f"{hit[0]:.3f} / {hit[1]:.3f}", "runs of each (median)": repeats},
        plots=[plot])
