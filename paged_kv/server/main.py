"""``paged-kv serve``: build the engine from the command line and run the app under uvicorn."""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path

import torch
import uvicorn

from ..events import KVEventsConfig
from ..serving import Engine
from ..serving.sizing import cache_config_for_free_memory
from ..tiers import TierConfig

logger = logging.getLogger("paged_kv.server")


def read_api_keys(path: str | Path) -> dict[str, str]:
    """``{key: tenant}`` from a file of ``KEY TENANT`` lines (blank lines and ``#`` skipped).

    Raises
    ------
    ValueError
        Naming the line that is not two fields, or a key given twice.
    """
    keys: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{path}:{number}: expected 'KEY TENANT', got {len(fields)} fields")
        if fields[0] in keys:
            raise ValueError(f"{path}:{number}: key given twice")
        keys[fields[0]] = fields[1]
    if not keys:
        raise ValueError(f"{path}: no 'KEY TENANT' lines")
    return keys


def events_config(args: argparse.Namespace, model_name: str) -> KVEventsConfig | None:
    """The ``--kv-events*`` flags as a config (None: off). The replay socket defaults to
    the next port; the topic to ``kv@HOST:PORT@MODEL``, the form llm-d reads."""
    if args.kv_events is None:
        return None
    replay = args.kv_events_replay
    if replay is None:
        base, _, port = args.kv_events.rpartition(":")
        replay = f"{base}:{int(port) + 1}" if port.isdigit() else f"{base}:*"
    topic = args.kv_events_topic
    if topic is None:
        topic = f"kv@{args.host}:{args.port}@{model_name}"
    return KVEventsConfig(args.kv_events, None if replay == "off" else replay, topic=topic,
                          token_ids=args.kv_events_token_ids)


def build_engine(model: torch.nn.Module, *, memory_mib: float, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, preemption: str,
                 memory_fraction: float | None = None, kv_cache_dtype: str = "auto",
                 tensor_parallel_size: int = 1, kv_tiers: TierConfig | None = None,
                 kv_events: KVEventsConfig | None = None) -> Engine:
    """An engine whose pool takes `memory_mib` of K/V, or `memory_fraction` of the free
    memory (the host pool as much again for swap)."""
    probe = model.cache_config(num_blocks=2, block_size=block_size, kv_cache_dtype=kv_cache_dtype)
    if memory_fraction is not None:
        num_blocks = cache_config_for_free_memory(model, memory_fraction, block_size=block_size,
                                                  kv_cache_dtype=kv_cache_dtype).num_blocks
    else:
        num_blocks = int(memory_mib * 2**20) // probe.bytes_per_block
    if num_blocks < 2:
        raise ValueError(f"argument --memory-mib: {memory_mib} MiB holds {num_blocks} KV "
                         f"blocks of {probe.bytes_per_block} bytes; need at least 2")
    cache_config = model.cache_config(num_blocks=num_blocks, block_size=block_size,
                                      num_host_blocks=num_blocks if preemption == "swap" else 0,
                                      kv_cache_dtype=kv_cache_dtype)
    return Engine(model, cache_config, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, preemption=preemption,
                  tensor_parallel_size=tensor_parallel_size, kv_tiers=kv_tiers,
                  kv_events=kv_events)


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM / SIGINT; running requests get `--drain-timeout` s."""
    from .app import create_app
    from .loop import EngineLoop
    from .tokenizer import ByteTokenizer, HFTokenizer

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.model is None:
        from ..serving import TinyLlama

        model, tokenizer, name = TinyLlama(), ByteTokenizer(), "paged-kv-tiny-llama"
    else:
        from ..serving.hf import HFCausalLM

        model = HFCausalLM.from_pretrained(args.model)
        tokenizer, name = HFTokenizer(args.model), Path(args.model).name
    engine = build_engine(model, memory_mib=args.memory_mib, block_size=args.block_size,
                          max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          preemption=args.preemption, memory_fraction=args.memory_fraction,
                          kv_cache_dtype=args.kv_cache_dtype,
                          tensor_parallel_size=args.tensor_parallel_size,
                          kv_tiers=TierConfig.from_args(args),
                          kv_events=events_config(args, name))
    _log_setup(engine, name, args.api_keys_map)
    app = create_app(EngineLoop(engine), tokenizer, model_name=name,
                     api_keys=args.api_keys_map, max_waiting=args.max_waiting)
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                    timeout_graceful_shutdown=args.drain_timeout))
    logger.info("serving on http://%s:%d", args.host, args.port)
    try:
        server.run()
    finally:
        engine.close()  # tensor-parallel workers stop with the server
    return 0


def _log_setup(engine: Engine, name: str, api_keys: dict[str, str] | None) -> None:
    config = engine.cache.config
    logger.info("model %s; KV pool %d blocks of %d tokens (%.1f MiB)", name, config.num_blocks,
                config.block_size, config.num_blocks * config.bytes_per_block / 2**20)
    if engine.events is not None:
        logger.info("KV events on %s (replay %s)", engine.events.endpoint,
                    engine.events.replay_endpoint)
    if api_keys is None:
        logger.info("single tenant: no --api-keys file, so no auth and one shared prefix cache")
    else:
        logger.info("%d API keys, %d tenants; prefix caches are per tenant",
                    len(api_keys), len(set(api_keys.values())))


class _Server(uvicorn.Server):
    """uvicorn's server, but SIGTERM after a clean drain exits 0 (uvicorn re-raises it)."""

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            logger.info("SIGTERM: no new connections; draining running requests")
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]
