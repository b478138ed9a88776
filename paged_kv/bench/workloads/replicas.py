"""``--workloads replicas``: four replicas behind each routing policy, one request sequence.

Tenants share long system prompts across multi-turn sessions (each turn's prompt extends
the last). The same sessions go through round robin, sglang-router's ``cache_aware``,
``paged-kv route`` (KV events), and one replica with four times the pool (the oracle: no
routing to get wrong); the replicas start fresh for each policy. Figures: prefix hit rate
(cached / prompt tokens, from the replicas' own usage), TTFT, throughput, load spread and
the router's event-to-index lag.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np

from ..netdelay import free_port, stop_all, wait_healthy
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat, percentile

NUM_REPLICAS = 4
MEMORY_MIB = 16  # `paged-kv serve`'s default pool: 8K tokens of the embedded model
MODEL_NAME = "paged-kv-tiny-llama"
ROUTE = "paged-kv route (KV events)"
ORACLE = "one replica, 4x pool (oracle)"
DESCRIPTION = (
    "{replicas} paged-kv serve replicas of the embedded TinyLlama (one thread each, "
    "--memory-mib {mib}, --kv-events) on 127.0.0.1, started fresh for each policy; "
    "{tenants} tenants (one API key each, so one prefix-cache salt each) with "
    "{sys_lo}-{sys_hi}-token system prompts, in two scenarios: 'own prompts' (every tenant "
    "its own) and '{apps} apps' (the prompt of one of {apps} apps, each sent by {per_app} "
    "tenants: the same text, which the salts keep from sharing a block); each tenant runs "
    "{sessions} multi-turn session(s) of {turns} turns (each turn's prompt is the "
    "last one plus a canned answer and a new question), {clients} clients each running one "
    "session at a time, streaming, {max_tokens} greedy tokens a turn. Hit rate = cached / "
    "prompt tokens from the replicas' usage; load = each replica's running + waiting "
    "requests sampled every 0.2 s, averaged, max / min over replicas; lag = KV event "
    "publication to the router's index (its histogram). sglang-router: cache_aware with its "
    "defaults. Oracle: one replica with {replicas}x the pool, no router.")


def _text(rng: np.random.Generator, n: int) -> str:
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ,.", dtype=np.uint8)
    return bytes(rng.choice(letters, n)).decode()


def sessions(num_tenants: int, per_tenant: int, turns: int, *, apps: int | None = None,
             seed: int = 0, system: tuple[int, int] = (1024, 2048),
             ) -> list[tuple[str, list[str]]]:
    """``(tenant, [prompt of each turn])`` per session, shuffled (tenants interleaved).

    Tenant t's system prompt is app ``t % apps``'s (default: one app per tenant): tenants
    of one app send the same text, which their salts keep from sharing a cached block.
    """
    rng = np.random.default_rng(seed)
    prompts_of_app = [_text(rng, int(rng.integers(*system))) for _ in range(apps or num_tenants)]
    out = []
    for tenant in range(num_tenants):
        for _ in range(per_tenant):
            prompts, text = [], prompts_of_app[tenant % len(prompts_of_app)]
            for _ in range(turns):
                text += "\nUser: " + _text(rng, int(rng.integers(64, 160))) + "\nAssistant:"
                prompts.append(text)
                text += " " + _text(rng, 64)
            out.append((f"tenant{tenant}", prompts))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


@contextlib.contextmanager
def _processes(commands: list[list[str]], env: dict) -> Iterator[list[str]]:
    """Start each ``(url, argv)``; yield the URLs once all answer /health; stop them all."""
    procs, urls = [], []
    try:
        for argv in commands:
            port = free_port()
            procs.append(subprocess.Popen([*argv, "--port", str(port)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            wait_healthy(url, proc)
        yield urls
    finally:
        stop_all(procs)


def _replica(keys_file: str, mib: float) -> list[str]:
    return [sys.executable, "-m", "paged_kv.cli", "serve", "--memory-mib", str(mib),
            "--api-keys", keys_file, "--max-waiting", "100000",
            "--kv-events", f"tcp://127.0.0.1:{free_port()}", "--kv-events-replay", "off"]


def _router(policy: str, urls: list[str], keys_file: str) -> list[str]:
    replicas = [a for url in urls for a in ("--replica", url)]
    if policy == "sglang":
        return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--worker-urls", *urls, "--policy", "cache_aware", "--log-level", "error",
                "--prometheus-port", str(free_port())]
    return [sys.executable, "-m", "paged_kv.cli", "route", "--policy", policy,
            "--api-keys", keys_file, *replicas]


async def _session(client, url: str, tenant: str, prompts: list[str], max_tokens: int,
                   records: list[dict]) -> None:
    for prompt in prompts:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        start, first, usage = time.perf_counter(), None, None
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer key-{tenant}"}) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    first = first or time.perf_counter()
                    if '"usage"' in line and '"choices": []' in line:
                        usage = json.loads(line[6:])["usage"]
        records.append({"ttft": first - start, "prompt": usage["prompt_tokens"],
                        "cached": usage["prompt_tokens_details"]["cached_tokens"]})


async def _drive(url: str, work: list[tuple[str, list[str]]], clients: int, max_tokens: int,
                 replicas: list[str]) -> tuple[list[dict], float, list[dict[str, float]]]:
    import httpx

    records: list[dict] = []
    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    loads: list[dict[str, float]] = []

    async def client_loop(client) -> None:
        while not queue.empty():
            tenant, prompts = queue.get_nowait()
            await _session(client, url, tenant, prompts, max_tokens, records)

    async def sample(client, stop: asyncio.Event) -> None:
        while not stop.is_set():
            loads.append({r: await _load(client, r) for r in replicas})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(client, stop))
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - start
        stop.set()
        await sampler
    return records, wall, loads


async def _load(client, url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get(f"{url}/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name in ("paged_kv_running_requests", "paged_kv_waiting_requests")
               for s in f.samples)


def _router_lag(url: str) -> tuple[float, float]:
    """p50 and p99 (bucket bounds) of the router's event-to-index lag histogram, in s."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    buckets = [(float(s.labels["le"]), s.value) for f in text_string_to_metric_families(text)
               if f.name == "paged_kv_router_event_lag_seconds" for s in f.samples
               if s.name.endswith("_bucket")]
    total = max((count for _, count in buckets), default=0)
    if not total:
        return float("nan"), float("nan")
    return tuple(next(le for le, count in sorted(buckets) if count >= q * total)
                 for q in (0.5, 0.99))


def _policy_run(policy: str, work, keys_file: str, env: dict, clients: int,
                max_tokens: int) -> dict:
    count, mib = (1, NUM_REPLICAS * MEMORY_MIB) if policy == "oracle" else \
        (NUM_REPLICAS, MEMORY_MIB)
    with _processes([_replica(keys_file, mib) for _ in range(count)], env) as replicas:
        if policy == "oracle":
            records, wall, loads = asyncio.run(_drive(replicas[0], work, clients, max_tokens,
                                                      replicas))
            return _summary(records, wall, loads, None)
        with _processes([_router(policy, replicas, keys_file)], env) as [router]:
            time.sleep(1.0)  # the router's first probes and subscriptions
            records, wall, loads = asyncio.run(_drive(router, work, clients, max_tokens,
                                                      replicas))
            lag = _router_lag(router) if policy == "cache" else None
    return _summary(records, wall, loads, lag)


def _summary(records: list[dict], wall: float, loads: list[dict[str, float]],
             lag: tuple[float, float] | None) -> dict:
    ttft = [r["ttft"] for r in records]
    mean_load = {r: float(np.mean([s[r] for s in loads])) for r in loads[0]} if loads else {}
    spread = (max(mean_load.values()) / max(min(mean_load.values()), 1e-9)
              if len(mean_load) > 1 else 1.0)
    return {"hit_rate": sum(r["cached"] for r in records) / sum(r["prompt"] for r in records),
            "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
            "throughput": len(records) / wall, "load_spread": spread, "lag": lag,
            "requests": len(records)}


POLICIES = {"round robin": "round_robin", "sglang-router cache_aware": "sglang", ROUTE: "cache",
            ORACLE: "oracle"}


def run(scale: Scale) -> WorkloadResult | None:
    """Hit rate, TTFT, throughput, load spread and event lag of each policy, in two
    scenarios: every tenant its own system prompt, and apps whose prompt several tenants
    send."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        policies = {k: v for k, v in POLICIES.items() if v != "sglang"}
    else:
        policies = POLICIES
    quick = scale.name == "quick"
    tenants, per_tenant, turns = (16, 1, 3) if quick else (32, 2, 4)
    clients, max_tokens = 8, 8
    scenarios = {"own prompts": None, f"{tenants // 4} apps": tenants // 4}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = os.path.join(tmp, "keys")
        with open(keys_file, "w") as f:
            f.writelines(f"key-tenant{t} tenant{t}\n" for t in range(tenants))
        for scenario, apps in scenarios.items():
            work = sessions(tenants, per_tenant, turns, apps=apps)
            for name, policy in policies.items():
                print(f"  replicas, {scenario}: {name}", file=sys.stderr, flush=True)
                results.setdefault(scenario, {})[name] = _policy_run(
                    policy, work, keys_file, env, clients, max_tokens)
    return _result(results, DESCRIPTION.format(
        replicas=NUM_REPLICAS, mib=MEMORY_MIB, tenants=tenants, sys_lo=1024, sys_hi=2048,
        sessions=per_tenant, turns=turns, clients=clients, max_tokens=max_tokens,
        apps=tenants // 4, per_app=4))


def _result(scenarios: dict[str, dict[str, dict]], description: str) -> WorkloadResult:
    figures, info, plots = [], {}, []
    for scenario, results in scenarios.items():
        ours = results[ROUTE]
        for name, base in results.items():
            if name == ROUTE:
                continue
            figures.append(Figure(f"{scenario}: prefix hit rate vs {name}",
                                  Stat((ours["hit_rate"],), ""), name,
                                  Stat((base["hit_rate"],), ""), True))
            if name == ORACLE:
                continue
            for key, label in (("ttft_p50", "TTFT p50"), ("ttft_p95", "TTFT p95")):
                figures.append(Figure(f"{scenario}: {label} vs {name}",
                                      Stat((1e3 * ours[key],), "ms"), name,
                                      Stat((1e3 * base[key],), "ms"), False))
            figures.append(Figure(f"{scenario}: throughput vs {name}",
                                  Stat((ours["throughput"],), "req/s"), name,
                                  Stat((base["throughput"],), "req/s"), True))
        info.update({f"{scenario}, {name}: {key}": (round(v, 4) if isinstance(v, float) else v)
                     for name, r in results.items() for key, v in r.items()
                     if key != "lag" and not (name == ORACLE and key == "load_spread")})
        if ours["lag"] is not None:
            info[f"{scenario}: event-to-index lag p50 / p99 (bucket bound, ms)"] = \
                f"{1e3 * ours['lag'][0]:.1f} / {1e3 * ours['lag'][1]:.1f}"
        names = tuple(results)
        plots.append(Plot(f"{scenario}: prefix hit rate by policy", "", "cached / prompt tokens",
                          (Series("hit rate", names,
                                  tuple(results[n]["hit_rate"] for n in names)),), kind="bar"))
    return WorkloadResult("replicas", "Replicas: routing policies over four replicas",
                          description, figures, info, plots=plots)
