"""The engine core: `EngineCore` steps the `Engine` (model, cache, tiers; tensor-parallel
workers hang off it) and keeps its failures inside it; `EngineCoreProc` is that core in a
process of its own (vLLM's names), serving API server processes over a Unix socket
(`core_socket.py`): they send it requests and get back one `Outputs` message per step each
(`messages.py`).

Single-threaded on purpose: messages are taken in between steps, as `InprocClient` does
with its calls, so the engine needs no lock, and the process has the GIL to itself.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections import deque
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from ...events import KVEventsConfig
from ...handoff import HandoffConfig
from ...tenants import TenantPolicy
from ...tiers import TierConfig
from .. import Engine, EngineDeadError, StepOutput
from ..config import EngineConfig
from ..limits import EngineLimits
from ..sizing import pool_config
from . import messages
from .core_socket import CoreListener, Front

logger = logging.getLogger("paged_kv.server.core")
_IDLE_POLL_S = 0.1  # how often an idle core looks at its parent and at SIGTERM
# the most a step waits for requests an API server announced (`messages.Arriving`): a
# route's read and checks and the hop, ~0.5 ms on this 2-core machine; a request that
# misses the step boundary by that much waits a whole step more (7-15 ms here)
ARRIVAL_HOLD_S = 0.001
_PROBE = ("paged-kv", "cached-tokens probe")  # a sequence id no request has (never added)


def build_engine(model: torch.nn.Module, *, memory_mib: float, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, preemption: str,
                 memory_fraction: float | None = None, kv_cache_dtype: str = "auto",
                 tensor_parallel_size: int = 1, kv_tiers: TierConfig | None = None,
                 kv_events: KVEventsConfig | None = None,
                 tenants: TenantPolicy | None = None,
                 handoff: HandoffConfig | None = None) -> Engine:
    """An engine whose pool takes `memory_mib` of K/V, or `memory_fraction` of the free
    memory (the host pool as much again for swap): `sizing.pool_config`; `tenants` (the
    tenants file's policy) is checked against that pool (ValueError naming the field)."""
    cache_config, _ = pool_config(model, block_size=block_size, memory_mib=memory_mib,
                                  memory_fraction=memory_fraction, preemption=preemption,
                                  kv_cache_dtype=kv_cache_dtype)
    if tenants is not None:
        cache_config = dataclasses.replace(cache_config, tenants=tenants)
    return Engine(model, EngineConfig(cache=cache_config, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      preemption=preemption,
                                      tensor_parallel_size=tensor_parallel_size, kv_tiers=kv_tiers,
                                      kv_events=kv_events, handoff=handoff))


def engine_from_args(args: argparse.Namespace) -> Engine:
    """The engine ``paged-kv serve`` flags describe: the embedded model, or ``--model``'s
    checkpoint (``args.model_factory``, a picklable callable of no arguments, replaces
    both: a test hook)."""
    factory = getattr(args, "model_factory", None)
    if factory is not None:
        model = factory()
    elif args.model is None:
        from .. import TinyLlama

        model = TinyLlama()
    else:
        from ..hf import HFCausalLM

        model = HFCausalLM.from_pretrained(args.model)
    return build_engine(model, memory_mib=args.memory_mib, block_size=args.block_size,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        preemption=args.preemption, memory_fraction=args.memory_fraction,
                        kv_cache_dtype=args.kv_cache_dtype,
                        tensor_parallel_size=args.tensor_parallel_size,
                        kv_tiers=TierConfig.from_args(args),
                        kv_events=events_config(args, model_name(args)),
                        tenants=getattr(getattr(args, "tenants_file", None), "policy", None),
                        handoff=HandoffConfig.from_args(args))


def model_name(args: argparse.Namespace) -> str:
    """The id ``/v1/models`` reports: the first ``--served-model-name``, else the checkpoint
    directory's name, or the embedded model's."""
    if getattr(args, "served_model_name", None):
        return args.served_model_name[0]
    return "paged-kv-tiny-llama" if args.model is None else Path(args.model).name


def events_config(args: argparse.Namespace, model_name: str) -> KVEventsConfig | None:
    """The ``--kv-events*`` flags as a config (None: off). The replay socket defaults to
    the next port; the topic to ``kv@HOST:PORT@MODEL``, the form llm-d reads."""
    if getattr(args, "kv_events", None) is None:
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


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no-op elsewhere)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG


def run_core(args: argparse.Namespace, address: str, ready: Connection, parent_pid: int) -> None:
    """The engine-core process's target: build the engine, send its `EngineLimits` (or the
    startup error) through `ready`, then serve `address` until SIGTERM or the parent dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the API server stops us in order
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = engine_from_args(args)
    except Exception as exc:  # the API server raises it (a bad flag: exit 2 with its message)
        ready.send(("error", exc))
        raise SystemExit(1) from None
    try:
        core = EngineCoreProc(engine, address, parent_pid,
                              getattr(args, "arrival_hold_ms", ARRIVAL_HOLD_S * 1e3) / 1e3)
        signal.signal(signal.SIGTERM, core.drain)
        if getattr(engine.handoff, "server", None) is not None:
            logger.info("prefill role: leased pages served on %s", engine.handoff.server.endpoint)
        if engine.events is not None:
            logger.info("KV events on %s (replay %s)", engine.events.endpoint,
                        engine.events.replay_endpoint)
        ready.send(("ready", EngineLimits.of(engine)))
        code = core.run()
    finally:
        engine.close()
    raise SystemExit(code)


class EngineCore:
    """The engine as a server hosts it: one step at a time, a step that fails failing the
    requests it could have touched rather than the host, a dead engine failing every
    request; and the count of waiting requests a server's 429s use. No I/O of its own:
    `EngineCoreProc` serves it to API server processes over a Unix socket, `InprocClient`
    on a thread of this process, so failure handling and the waiting count exist once for
    both.

    Parameters
    ----------
    engine : Engine
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dead: str | None = None  # why the engine cannot step any more (health: 503)

    @property
    def has_unfinished_requests(self) -> bool:
        """Whether the engine has requests to step."""
        return self.engine.has_unfinished_requests

    @property
    def num_waiting(self) -> int:
        """Requests that would wait for a running slot: those waiting in the engine less the
        slots free now (an idle engine's count is minus its free slots, so a server with
        ``--max-waiting 0`` still serves). The scheduler's queue, not ``engine.stats()``: a
        whole snapshot each step for one int."""
        engine = self.engine
        return engine.num_waiting_requests - (engine.max_num_seqs - len(engine.scheduler.running))

    def step(self) -> bool:
        """One engine step; False once the engine is dead (`dead` says why, and every request
        in it has failed with that message)."""
        try:
            self.engine.step()
        except EngineDeadError as exc:
            logger.error("engine dead: %s", exc)
            self.dead = str(exc)
            self.fail_all(self.dead)
            return False
        except Exception as exc:  # fails the requests it could have touched, not the host
            logger.exception("engine step failed; failing the requests in the engine")
            self.fail_all(f"the engine step failed: {exc!r}")
        return True

    def flush_tenant(self, tenant: str | None, retention_only: bool = False) -> int:
        """An admin's flush of `tenant`'s cached blocks, or with `retention_only` the end of
        their soft retention (`Engine.flush_tenant`); returns how many blocks. None: the one
        tenant of a server without API keys, so every cached block (nothing is retained
        without a tenant policy)."""
        if tenant is None:
            return 0 if retention_only else self.engine.cache.reset_prefix_cache()
        return self.engine.flush_tenant(tenant, retention_only=retention_only)

    def cached_tokens(self, prompt_token_ids: list[int], salt: str | None) -> int:
        """Tokens of the prompt's full blocks that the prefix cache holds for `salt` now (a
        warm-up's answer). Planned, not admitted: nothing changes. One token is appended
        so that the prompt's last full block is looked up too (an admission leaves the
        last prompt token to compute)."""
        cache = self.engine.cache
        full = len(prompt_token_ids) // cache.config.block_size * cache.config.block_size
        if not full:
            return 0
        plan = cache.plan_admission(_PROBE, [*prompt_token_ids, 0], salt=salt)
        return min(plan.num_hit, full)

    def fail_all(self, message: str) -> None:
        """Fail every request in the engine with `message` (its clients get an error)."""
        for request_id in self.engine.unfinished_request_ids():
            with contextlib.suppress(Exception):  # a dead engine may fail to free too
                self.engine.abort(request_id, error=message)


class EngineCoreProc(EngineCore):
    """The `EngineCore` of ``paged-kv serve``'s engine-core process: steps it while requests
    from API servers come and go, over one Unix socket (a `Front` per API server).

    Parameters
    ----------
    engine : Engine
    address : str
        The socket's path to listen on, or ``ipc://PATH`` (the API servers connect to it).
    parent_pid : int
        The process that started this one: when it is gone, so is this one.
    arrival_hold_s : float
        How long a step may wait, at most, for the `Add`s of requests an API server has
        announced (`messages.Arriving`): a request that reached the API server before the
        step boundary joins that step, as it would in-process, rather than waiting a
        whole step more because its route was still reading it. Each announcement counts
        for this long after it came; an `Add` takes back the oldest one.
    """

    def __init__(self, engine: Engine, address: str, parent_pid: int,
                 arrival_hold_s: float = ARRIVAL_HOLD_S) -> None:
        super().__init__(engine)
        self._parent = parent_pid
        self._hold = arrival_hold_s
        self._arriving: deque[float] = deque()  # when announcements came, oldest first
        self._ids: dict[tuple[Front, int], int] = {}  # (API server, its id) -> engine id
        self._pending: dict[Front, list[tuple[int, StepOutput]]] = {}
        self._fronts: set[Front] = set()
        self._received: dict[Front, int] = {}  # API server -> the `Add`s taken from it
        self._told: dict[Front, tuple[int, int]] = {}  # API server -> (waiting, received)
        self._unstarted: set[tuple[Front, int]] = set()  # requests with no output yet
        self._listener = CoreListener(address, self._fronts.add, self._take, self._front_left)
        self._draining = self._announced = False

    def drain(self, *_: object) -> None:
        """SIGTERM: refuse new requests, finish the running ones, then stop (exit 0)."""
        self._draining = True

    def run(self) -> int:
        """Serve until drained (0), orphaned or dead (1)."""
        try:
            while True:
                self._listener.poll(0 if self.engine.has_unfinished_requests else _IDLE_POLL_S)
                if os.getppid() != self._parent:
                    logger.error("the API server is gone; the engine core stops")
                    return 1
                if self._draining and not self._announced:  # (not from the signal handler)
                    self._announced = True
                    for front in list(self._fronts):
                        self._send(front, messages.Draining())
                if self._draining and not self.engine.has_unfinished_requests:
                    self._flush()
                    for front in list(self._fronts):
                        self._send(front, messages.Bye())
                    return 0
                if self.engine.has_unfinished_requests:
                    self._await_announced()
                    if not self.step():
                        self._flush()  # the failed requests' last outputs
                        return 1
                self._flush()
        finally:
            self._listener.close()  # (the last outputs and Bye leave first)

    def _await_announced(self) -> None:
        """Before a step: wait while requests announced in the last `arrival_hold_s` have
        not come, at most `arrival_hold_s` in all (a stream of announcements never holds a
        step longer; an announcement whose request was refused simply expires)."""
        arriving, hold = self._arriving, self._hold
        now = time.monotonic()
        deadline = now + hold
        while arriving and now < deadline:
            if arriving[0] + hold <= now:
                arriving.popleft()
                continue
            self._listener.poll(min(deadline, arriving[0] + hold) - now)
            now = time.monotonic()

    def _send(self, front: Front, message: messages.FromCore) -> None:
        self._listener.send(front, messages.encode(message))

    def _take(self, front: Front, frame: bytes) -> None:
        """One message from an API server (the listener's callback, between steps)."""
        message = messages.decode_to_core(frame)
        if isinstance(message, messages.Add):
            if self._arriving:  # (any API server's: a refused one's expires)
                self._arriving.popleft()
            self._add(front, message)
        elif isinstance(message, messages.Arriving):
            if self._hold > 0:  # (without a hold nothing would expire them)
                self._arriving.append(time.monotonic())
        elif isinstance(message, messages.Abort):
            engine_id = self._ids.get((front, message.request_id))
            if engine_id is not None:
                self.engine.abort(engine_id)
        elif isinstance(message, messages.Flush | messages.CachedQuery):
            self._reply(front, message)
        else:  # MetricsQuery
            self._send(front, messages.MetricsText(message.token, self.engine.metrics_text()))

    def _front_left(self, front: Front) -> None:
        """An API server closed its connection: its requests have no one to answer, so they
        stop (their blocks freed) and it is told nothing more."""
        for key in [key for key in self._ids if key[0] is front]:
            with contextlib.suppress(Exception):  # (it may finish in the same breath)
                self.engine.abort(self._ids.pop(key))
        self._unstarted = {key for key in self._unstarted if key[0] is not front}
        self._fronts.discard(front)
        for table in (self._pending, self._received, self._told):
            table.pop(front, None)

    def _add(self, front: Front, message: messages.Add) -> None:
        self._received[front] = self._received.get(front, 0) + 1
        try:
            if self._draining:
                raise ValueError("the engine core is shutting down")
            engine_id = self.engine.add_request(
                message.prompt_token_ids, message.params, salt=message.salt,
                priority=message.priority, retention_seconds=message.retention_seconds,
                on_output=partial(self._collect, front, message.request_id),
                handoff=message.handoff)
        except (TypeError, ValueError) as exc:  # the API server checked; this is a race
            self._pending.setdefault(front, []).extend(
                (message.request_id, out) for out in messages.failed_outputs(
                    message.request_id, message.params.n, str(exc)))
            return
        self._ids[front, message.request_id] = engine_id
        self._unstarted.add((front, message.request_id))

    def _reply(self, front: Front, message: messages.Flush | messages.CachedQuery) -> None:
        try:
            if isinstance(message, messages.Flush):
                value = self.flush_tenant(message.tenant, message.retention_only)
            else:
                value = self.cached_tokens(message.prompt_token_ids, message.salt)
            reply = messages.Reply(message.token, value)
        except (TypeError, ValueError) as exc:
            reply = messages.Reply(message.token, 0, str(exc))
        self._send(front, reply)

    def _collect(self, front: Front, request_id: int, out: StepOutput) -> None:
        if front.closed:  # its API server left (`_front_left` aborts what it had)
            return
        key = (front, request_id)
        if out.output is not None:  # the request's last output
            self._ids.pop(key, None)
        if key in self._unstarted:
            self._unstarted.discard(key)
            told = self._told.get(front)
            if told is not None:
                # a first token leaves the moment the engine hands it over, alone, with the
                # counts the API server has already (unchanged): not behind the rest of the
                # step, the flush, and the other requests' tokens in one bigger message
                self._send(front, messages.Outputs([(request_id, out)], *told))
                return
        self._pending.setdefault(front, []).append((request_id, out))

    def _flush(self) -> None:
        """One `Outputs` message to each API server that has outputs from this step, or
        whose queue count (`num_waiting`, and the `Add`s taken from it) changed since it
        was last told: a server's 429s count the queue of every server, and a request it
        refuses never reaches the core, so waiting for its own outputs could leave it
        refusing for good on an idle core."""
        pending, self._pending = self._pending, {}
        waiting = self.num_waiting
        for front in self._fronts | pending.keys():
            outputs = pending.get(front)
            counts = (waiting, self._received.get(front, 0))
            if outputs or self._told.get(front) != counts:
                self._told[front] = counts
                self._send(front, messages.Outputs(outputs or [], *counts))
