"""The processes of ``paged-kv serve``: the engine core (spawned, so it starts with a fresh
interpreter and its own torch threads) and extra API servers (forked before any event loop
or connection to the core exists, sharing the listening socket the first one bound)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable

from ..limits import EngineLimits
from .engine_core import die_with_parent, run_core

logger = logging.getLogger("paged_kv.server")


class CoreProcess:
    """The engine-core process, started on entering and stopped (SIGTERM, drained) on exit.

    Parameters
    ----------
    args : argparse.Namespace
        ``paged-kv serve``'s flags (the engine's are read in the core).

    Raises
    ------
    Exception
        What the core raised while starting (ValueError for a bad flag), or RuntimeError
        with its exit code.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self._dir = tempfile.mkdtemp(prefix="paged-kv-")
        self.address = f"{self._dir}/core.sock"  # the core's Unix socket (removed on stop)
        self._stop_timeout = args.drain_timeout + 10
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe(duplex=False)
        self._process = context.Process(target=run_core, name="paged-kv-engine-core",
                                        args=(args, self.address, theirs, os.getpid()))
        self._process.start()
        theirs.close()
        self.limits = self._wait_ready(ours)

    def _wait_ready(self, ready) -> EngineLimits:
        try:
            while not ready.poll(0.1):
                if not self._process.is_alive():
                    raise RuntimeError(f"the engine core exited with "
                                       f"{describe_exit(self._process.exitcode)} while "
                                       "starting")
            kind, payload = ready.recv()
        except BaseException:
            self.stop()
            raise
        if kind != "ready":
            self.stop()
            raise payload
        return payload

    @property
    def pid(self) -> int:
        """The core's process id."""
        return self._process.pid

    @property
    def sentinel(self) -> int:
        """A descriptor that turns readable when the core has exited."""
        return self._process.sentinel

    def stop(self) -> int | None:
        """SIGTERM the core (it drains and exits 0), wait, kill if it hangs; its exit code."""
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(self._stop_timeout)
            if self._process.is_alive():
                logger.error("the engine core did not stop in %.0f s; killing it",
                             self._stop_timeout)
                self._process.kill()
                self._process.join()
        shutil.rmtree(self._dir, ignore_errors=True)
        return self._process.exitcode

    def __enter__(self) -> CoreProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def describe_exit(code: int | None) -> str:
    """A process's exit code for a log line: ``exit code 1``, ``signal SIGKILL``."""
    if code is None:
        return "an exit status not known yet"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket every API server process accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def start_fronts(count: int, run_front: Callable[..., int], *args: object) -> list:
    """Fork `count` more API server processes, numbered 1.., each ``run_front(i, *args)``."""
    context = multiprocessing.get_context("fork")
    fronts = [context.Process(target=_front, args=(run_front, i, *args),
                              name=f"paged-kv-api-{i}") for i in range(1, count + 1)]
    for front in fronts:
        front.start()
    return fronts


def _front(run_front: Callable[..., int], index: int, *args: object) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    raise SystemExit(run_front(index, *args))


def stop_fronts(fronts: list, timeout: float) -> None:
    """SIGTERM the forked API servers (they drain), wait, kill those that hang."""
    for front in fronts:
        if front.is_alive():
            front.terminate()
    for front in fronts:
        front.join(timeout)
        if front.is_alive():
            front.kill()
            front.join()
