"""``paged-kv route``: its flags, and the run (the serving libraries imported only then)."""

from __future__ import annotations

import argparse
import logging
import os
import urllib.parse

from ..handoff.config import SECRET_ENV
from .policy import POLICIES

logger = logging.getLogger("paged_kv.router")


def replica_url(text: str) -> str:
    """An ``http(s)://HOST:PORT`` replica URL (argparse type)."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {text!r}")
    return text.rstrip("/")


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _add_replica_flags(route: argparse.ArgumentParser) -> None:
    """The replicas: ``--replica`` ones, or ``--prefill`` and ``--decode`` ones."""
    route.add_argument("--replica", action="append", type=replica_url, default=None,
                       metavar="URL", help="a replica (repeat the flag for each)")
    route.add_argument("--prefill", action="append", type=replica_url, default=None,
                       metavar="URL",
                       help="a prefill replica (paged-kv serve --role prefill; repeat the "
                            "flag for each): each request is prefilled there, chosen by "
                            "--policy, then handed to a --decode replica (with --decode, "
                            "instead of --replica)")
    route.add_argument("--decode", action="append", type=replica_url, default=None,
                       metavar="URL",
                       help="a decode replica (paged-kv serve --role decode; repeat the flag "
                            "for each): the least loaded one decodes a request, with the "
                            "prefill's hand-off parameters, and streams the answer")
    route.add_argument("--handoff-secret", default=os.environ.get(SECRET_ENV, ""),
                       help=f"the engines' --handoff-secret (required with --prefill): the "
                            f"router signs each body it sends them, as only it may ask for "
                            f"a hand-off (default: ${SECRET_ENV}, which keeps it out of the "
                            f"process list)")


def add_route_parser(commands: argparse._SubParsersAction) -> None:
    """``paged-kv route``."""
    route = commands.add_parser(
        "route", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="a cache-aware router in front of paged-kv serve replicas (OpenAI routes); "
             "needs the events extra")
    _add_replica_flags(route)
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
    route.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                       help="connections to the replicas at most, all together: each "
                            "request in flight holds one (default: no limit; the replicas' "
                            "--max-waiting refuses what they cannot queue)")
    route.add_argument("--pool-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="how long a request waits for a connection when "
                            "--max-connections are in use, then 503")
    route.set_defaults(run=route_main)


def check_replica_flags(args: argparse.Namespace) -> None:
    """``--replica`` URLs, or ``--prefill`` and ``--decode`` URLs together; none twice.

    Raises
    ------
    ValueError
        Naming the flag (``paged-kv route`` then exits 2).
    """
    split = {"--prefill": args.prefill, "--decode": args.decode}
    if args.replica and any(split.values()):
        flag = "--prefill" if args.prefill else "--decode"
        raise ValueError(f"argument {flag}: not allowed with --replica (--prefill and "
                         f"--decode route a split deployment, --replica a colocated one)")
    for flag, other in (("--prefill", "--decode"), ("--decode", "--prefill")):
        if split[flag] and not split[other]:
            raise ValueError(f"argument {other}: needed with {flag} (a request is "
                             f"prefilled on one replica and decoded on another)")
    if not args.replica and not any(split.values()):
        raise ValueError("argument --replica: a replica is needed (or --prefill and "
                         "--decode replicas)")
    urls = [*(args.replica or []), *(args.prefill or []), *(args.decode or [])]
    for flag, given in (("--replica", args.replica), *split.items()):
        for url in given or []:
            if urls.count(url) > 1:
                raise ValueError(f"argument {flag}: the replica {url} given twice")
    if args.prefill and not getattr(args, "handoff_secret", ""):
        raise ValueError(f"argument --handoff-secret: needed with --prefill (or "
                         f"${SECRET_ENV}): the engines take a hand-off only from a router "
                         f"holding their secret")


def route_main(args: argparse.Namespace) -> int:
    """Run the router until SIGTERM (exit 0 once it has shut down cleanly) or SIGINT
    (130)."""
    import uvicorn

    from ..server.http.tokenizer import ByteTokenizer, HFTokenizer
    from ..server.serve import read_api_keys
    from .app import RouterServer, create_router_app
    from .disagg import DisaggRouter
    from .index import PrefixIndex
    from .proxy import Router
    from .replicas import ReplicaSet

    check_replica_flags(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tokenizer = ByteTokenizer() if args.model is None else HFTokenizer(args.model)
    api_keys = None if args.api_keys is None else read_api_keys(args.api_keys)
    options = dict(policy=args.policy, api_keys=api_keys, balance_abs=args.balance_abs,
                   balance_rel=args.balance_rel, load_tokens=args.load_tokens,
                   max_connections=args.max_connections, pool_timeout=args.pool_timeout)
    followed = args.replica or args.prefill
    replicas = ReplicaSet(followed, PrefixIndex(), lambda *a: router.on_batch(*a),
                          interval=args.probe_interval)
    if args.replica:
        router = Router(replicas, tokenizer, **options)
        logger.info("routing (%s) over %d replicas on http://%s:%d", args.policy,
                    len(args.replica), args.host, args.port)
    else:  # the decode replicas' own prefixes are not routed by: no events followed
        decode = ReplicaSet(args.decode, PrefixIndex(), lambda *a: None,
                            interval=args.probe_interval, subscribe=False)
        router = DisaggRouter(replicas, decode, tokenizer, secret=args.handoff_secret,
                              **options)
        logger.info("routing: prefill (%s) over %d replicas, decode (least load) over %d, "
                    "on http://%s:%d", args.policy, len(args.prefill), len(args.decode),
                    args.host, args.port)
    server = RouterServer(uvicorn.Config(create_router_app(router), host=args.host,
                                         port=args.port, log_level="warning",
                                         access_log=False))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down
        return 130
    return 0 if server.started else 1

