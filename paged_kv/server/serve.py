"""``paged-kv serve``: the engine core in a process of its own (`engine/engine_core.py`'s
`EngineCoreProc`, started by `engine/processes.py`), and one or more API server processes
(uvicorn, the `http/` app over a `CoreClient`) sharing one listening socket. The one module
that knows both rooms."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import uvicorn

from ..engine.process.engine_core import model_name
from .http.graceful import GracefulServer
from .tenants_file import TenantsFile, read_tenants_file

logger = logging.getLogger("paged_kv.server")
__all__ = ["read_api_keys", "serve"]


def read_api_keys(path: str | Path) -> dict[str, str]:
    """``{key: tenant}`` from a tenants file: ``KEY TENANT`` lines (blank lines and ``#``
    skipped), or the TOML format of `tenants_file` (its tenants' keys; admin keys and
    limits are left out).

    Raises
    ------
    ValueError
        Naming the line that is not two fields, or a key given twice (or the TOML field).
    """
    return read_tenants_file(path).keys


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM / SIGINT (running requests get `--drain-timeout` s) or
    until the engine core stops: 0 after a clean drain, 1 when the core died."""
    from ..engine.process.processes import CoreProcess, bind_socket, start_fronts, stop_fronts

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tokenizer, name = _tokenizer(args)
    tenants: TenantsFile | None = args.tenants_file
    if tenants is None:
        logger.info("single tenant: no --api-keys file, so no auth and one shared prefix cache")
    else:
        logger.info("%d API keys, %d admin keys, %d tenants%s; prefix caches are per tenant",
                    len(tenants.keys), len(tenants.admin_keys), len(tenants.tenant_names),
                    "" if tenants.policy is None else " with limits")
    with CoreProcess(args) as core:
        config = core.limits.cache_config
        logger.info("model %s; KV pool %d blocks of %d tokens (%.1f MiB); engine core pid %d",
                    name, config.num_blocks, config.block_size,
                    config.num_blocks * config.bytes_per_block / 2**20, core.pid)
        sock = bind_socket(args.host, args.port)
        fronts = start_fronts(args.api_server_count - 1, run_front, args, core, sock,
                              tokenizer, name)
        logger.info("serving on http://%s:%d (%d API server processes)", args.host,
                    sock.getsockname()[1], args.api_server_count)
        try:
            code = run_front(0, args, core, sock, tokenizer, name, peers=fronts)
        finally:
            stop_fronts(fronts, args.drain_timeout + 10)
    return code


def run_front(index: int, args: argparse.Namespace, core, sock, tokenizer, name: str,
              peers: list | None = None) -> int:
    """One API server process: the app over a `CoreClient`, under uvicorn on `sock`.
    Returns the exit code (1 when the engine core, or one of `peers`, died)."""
    from ..engine.process.core_client import CoreClient
    from .http.app import create_app
    from .http.protocol import InputLimits

    client = CoreClient(core.address, b"api-%d" % index, core.limits, core.sentinel,
                        peers=peers)
    tenants: TenantsFile | None = args.tenants_file
    app = create_app(client, tokenizer, model_name=name,
                     served_model_names=args.served_model_name or (),
                     api_keys=None if tenants is None else tenants.keys,
                     admin_keys=() if tenants is None else tenants.admin_keys,
                     tenant_names=() if tenants is None else tenants.tenant_names,
                     max_waiting=args.max_waiting,
                     input_limits=InputLimits(args.max_logprobs, args.max_request_bytes),
                     handoff_secret=(None if getattr(args, "role", "both") == "both"
                                     else args.handoff_secret))
    # access_log off: warning level prints none, but uvicorn would still consult the logger
    server = _Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                    timeout_graceful_shutdown=args.drain_timeout))
    client.on_exit = lambda code: setattr(server, "should_exit", True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has drained: no traceback
        return 130
    return client.exit_code or 0


def _tokenizer(args: argparse.Namespace):
    from .http.tokenizer import ByteTokenizer, HFTokenizer

    return (ByteTokenizer() if args.model is None else HFTokenizer(args.model)), model_name(args)


class _Server(GracefulServer):
    """uvicorn's server, but SIGTERM after a clean drain exits 0 (uvicorn re-raises it)."""

    sigterm_message = "SIGTERM: no new connections; draining running requests"
