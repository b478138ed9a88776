"""``paged-kv route``: its flags, and the run (the serving libraries imported only then)."""

from __future__ import annotations

import argparse
import logging
import urllib.parse

from .policy import POLICIES

logger = logging.getLogger("paged_kv.router")


def replica_url(text: str) -> str:
    """An ``http(s)://HOST:PORT`` replica URL (argparse type)."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {text!r}")
    return text.rstrip("/")


def add_route_parser(commands: argparse._SubParsersAction) -> None:
    """``paged-kv route``."""
    route = commands.add_parser(
        "route", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="a cache-aware router in front of paged-kv serve replicas (OpenAI routes); "
             "needs the events extra")
    route.add_argument("--replica", action="append", type=replica_url, required=True,
                       metavar="URL", help="a replica (repeat the flag for each)")
    route.add_argument("--policy", choices=POLICIES, default="cache")
    route.add_argument("--host", default="127.0.0.1")
    route.add_argument("--port", type=int, default=8080)
    route.add_argument("--api-keys", metavar="FILE", default=None,
                       help="the replicas' 'KEY TENANT' file: auth here, and keys salted per "
                            "tenant as the replicas salt them")
    route.add_argument("--model", default=None, metavar="DIR",
                       help="the replicas' checkpoint, for its tokenizer (default: the "
                            "embedded model's bytes)")
    route.add_argument("--balance-abs", type=int, default=8,
                       help="least load when the busiest replica has this many requests "
                            "more than the idlest ...")
    route.add_argument("--balance-rel", type=float, default=1.5,
                       help="... and this many times as many")
    route.add_argument("--load-tokens", type=float, default=512.0,
                       help="what a request in flight costs a replica, in prompt tokens to "
                            "compute: a cached prefix shorter than this per queued request "
                            "does not outweigh the queue")
    route.add_argument("--probe-interval", type=float, default=1.0,
                       help="seconds between /health probes of each replica")
    route.set_defaults(run=route_main)


def route_main(args: argparse.Namespace) -> int:
    """Run the router until SIGTERM / SIGINT."""
    import uvicorn

    from ..server.main import read_api_keys
    from ..server.tokenizer import ByteTokenizer, HFTokenizer
    from .app import create_router_app
    from .index import PrefixIndex
    from .proxy import Router
    from .replicas import ReplicaSet

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if len(set(args.replica)) != len(args.replica):
        raise ValueError("argument --replica: a replica given twice")
    tokenizer = ByteTokenizer() if args.model is None else HFTokenizer(args.model)
    api_keys = None if args.api_keys is None else read_api_keys(args.api_keys)
    router = Router(ReplicaSet(args.replica, PrefixIndex(), lambda *a: router.on_batch(*a),
                               interval=args.probe_interval),
                    tokenizer, policy=args.policy, api_keys=api_keys,
                    balance_abs=args.balance_abs, balance_rel=args.balance_rel,
                    load_tokens=args.load_tokens)
    logger.info("routing (%s) over %d replicas on http://%s:%d", args.policy,
                len(args.replica), args.host, args.port)
    uvicorn.run(create_router_app(router), host=args.host, port=args.port,
                log_level="warning")
    return 0
