"""The prefill engine's lease table and the hand-off wire, in process: expiry, heartbeat,
release, the byte bound, and a server that refuses messages without the secret."""

from __future__ import annotations

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from paged_kv.handoff.lease import LeaseTable  # noqa: E402
from paged_kv.handoff.params import parse_params  # noqa: E402
from paged_kv.handoff.server import HandoffServer, call  # noqa: E402
from paged_kv.handoff.trust import HandoffTrust  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_expires_unless_heartbeats_extend_it():
    clock = Clock()
    table = LeaseTable(lease_s=10.0, max_bytes=1 << 20, clock=clock)
    lease = table.create({b"k": b"value"}, "alice")
    clock.now += 8
    assert table.heartbeat(lease)
    clock.now += 8  # 16 s after creation, 8 after the heartbeat
    assert table.get(lease, [b"k"]) == [b"value"]
    clock.now += 3
    assert table.get(lease, [b"k"]) == "expired"
    assert (table.live, table.expired, table.nbytes) == (0, 1, 0)
    assert not table.heartbeat(lease)
    assert table.get("00" * 16, [b"k"]) == "unknown"


def test_release_drops_the_lease_once():
    table = LeaseTable(lease_s=10.0, max_bytes=1 << 20)
    lease = table.create({b"a": b"1", b"b": b"22"}, None)
    assert table.get(lease, [b"b", b"x"]) == [b"22", None]
    assert table.release(lease) and not table.release(lease)
    assert (table.live, table.released, table.expired, table.nbytes) == (0, 1, 0, 0)
    assert table.get(lease, [b"a"]) == "expired"  # released: gone, as an expired one


def test_the_table_is_bounded_by_bytes_oldest_lease_first():
    table = LeaseTable(lease_s=10.0, max_bytes=100)
    first = table.create({b"a": b"x" * 60}, None)
    second = table.create({b"b": b"y" * 30}, None)
    third = table.create({b"c": b"z" * 50}, None)  # pushes the first out
    assert table.get(first, [b"a"]) == "expired"
    assert table.get(second, [b"b"]) == [b"y" * 30] and table.get(third, [b"c"]) == [b"z" * 50]
    assert (table.live, table.evicted, table.nbytes) == (2, 1, 80)
    assert table.create({b"d": b"w" * 101}, None) is None  # never fits: not leased
    assert table.live == 2


def test_a_full_table_pushes_out_the_heaviest_tenants_oldest_lease():
    """One tenant flooding the table with hand-offs pushes out its own leases, not the
    lease another tenant made before the flood."""
    table = LeaseTable(lease_s=60.0, max_bytes=100)
    bob = table.create({b"b": b"x" * 20}, "bob")
    flood = [table.create({b"a%d" % i: b"x" * 20}, "alice") for i in range(4)]
    assert table.nbytes == 100
    table.create({b"a4": b"x" * 20}, "alice")
    assert table.get(bob, [b"b"]) == [b"x" * 20]  # oldest of all, kept
    assert table.get(flood[0], [b"a0"]) == "expired" and table.evicted == 1
    # a tenant new to the table pushes out the heaviest one's, not its own nothing
    table.create({b"c": b"x" * 40}, "carol")
    assert table.get(bob, [b"b"]) == [b"x" * 20] and table.evicted == 3


def test_the_server_answers_only_to_the_secrets_mac_and_never_sees_the_secret():
    table = LeaseTable(lease_s=10.0, max_bytes=1 << 20)
    key, value = b"k" * 32, b"v" * 10
    lease = table.create({key: value}, None)
    trust = HandoffTrust("sesame")
    server = HandoffServer(table, "127.0.0.1", 0, trust)
    context = zmq.Context()
    try:
        def ask(verb: bytes, *keys: bytes, mac: bytes | None = None,
                lease_id: bytes = lease.encode()) -> list[bytes] | None:
            mac = trust.request_mac(verb, lease_id, keys) if mac is None else mac
            return call(context, server.endpoint, [verb, mac, lease_id, *keys], 5.0)
        assert ask(b"get", key, mac=b"sesame") == [b"refused"]  # the secret is no MAC
        assert ask(b"get", key, mac=b"") == [b"refused"]
        other = HandoffTrust("another").request_mac(b"get", lease.encode(), [key])
        assert ask(b"get", key, mac=other) == [b"refused"]
        # a MAC made for one message never passes for another (a replayed get as a release)
        assert ask(b"release", mac=trust.request_mac(b"get", lease.encode(), [])) \
            == [b"refused"]
        assert server.refused == 4
        answer = ask(b"get", key)
        assert answer == [b"ok", trust.value_mac(lease.encode(), key, value), value]
        assert trust.values_ok(answer[1], lease.encode(), [key], [value]) == [True]
        # a value bound to this lease fails under another lease's id or key
        assert trust.values_ok(answer[1], b"ab" * 16, [key], [value]) == [False]
        assert trust.values_ok(answer[1], lease.encode(), [b"q" * 32], [value]) == [False]
        assert trust.values_ok(answer[1], lease.encode(), [key], [b"w" * 10]) == [False]
        assert ask(b"get", b"q" * 32) == [b"missing"]
        assert ask(b"heartbeat") == [b"ok"]
        assert ask(b"release") == [b"ok"]
        assert ask(b"get", key) == [b"expired"]
        assert ask(b"get", key, lease_id=b"ab" * 16) == [b"unknown"]
        assert table.live == 0
    finally:
        server.close()
        context.term()


@pytest.mark.parametrize(("body", "field"), [
    ([1], "kv_transfer_params"),
    ({"do_remote_prefill": "yes"}, "kv_transfer_params.do_remote_prefill"),
    ({"remote_engine": "http://x"}, "kv_transfer_params.remote_engine"),
    ({"lease": "not hex"}, "kv_transfer_params.lease"),
    ({"block_keys": ["ab"]}, "kv_transfer_params.block_keys"),
    ({"first_token": -1}, "kv_transfer_params.first_token"),
    ({"num_prompt_tokens": True}, "kv_transfer_params.num_prompt_tokens"),
    ({"lease_seconds": 0}, "kv_transfer_params.lease_seconds"),
    ({"lease_seconds": float("inf")}, "kv_transfer_params.lease_seconds"),
    ({"lease_seconds": float("nan")}, "kv_transfer_params.lease_seconds"),
    ({"remote_engine": "tcp://junkA"}, "kv_transfer_params.remote_engine"),
    ({"remote_engine": "tcp://host:0"}, "kv_transfer_params.remote_engine"),
    ({"remote_engine": "tcp://host:65536"}, "kv_transfer_params.remote_engine"),
    ({"remote_engine": "tcp://a b:5"}, "kv_transfer_params.remote_engine"),
    ({"signature": "ab"}, "kv_transfer_params.signature"),
])
def test_malformed_params_name_the_field(body, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        parse_params(body)


def test_params_lacking_fields_are_parsed_and_say_what_they_lack():
    params = parse_params({"do_remote_prefill": True, "lease": "ab"})
    assert params.do_remote_prefill and params.missing == ["remote_engine", "block_keys",
                                                           "num_prompt_tokens"]
    assert parse_params(None) is None


def test_serve_flags_make_the_config():
    from paged_kv.cli import build_parser
    from paged_kv.handoff import HandoffConfig

    parser = build_parser()
    args = parser.parse_args(["serve", "--role", "decode", "--handoff-secret", "x",
                              "--handoff-failure", "fail", "--handoff-lease-s", "2.5"])
    assert HandoffConfig.from_args(args) == HandoffConfig("decode", secret="x", lease_s=2.5,
                                                          failure="fail")
    assert HandoffConfig.from_args(parser.parse_args(["serve"])) is None  # role both
    for bad in (["--handoff-lease-s", "0"], ["--handoff-port", "65536"], ["--role", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])
    with pytest.raises(ValueError, match=r"^failure:"):
        HandoffConfig("prefill", failure="retry", secret="x")
    for lease_s in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"^lease_s:"):
            HandoffConfig("prefill", secret="x", lease_s=lease_s)
    for role in ("prefill", "decode"):  # a role without the secret: anyone could forge
        with pytest.raises(ValueError, match=r"^secret: role .* needs the hand-off secret"):
            HandoffConfig(role)
        with pytest.raises(ValueError, match=r"^secret:"):
            HandoffConfig.from_args(parser.parse_args(["serve", "--role", role,
                                                       "--handoff-secret", ""]))


def test_a_fallback_is_counted_every_time_and_logged_once_a_minute_per_reason(caplog):
    from paged_kv.handoff.metrics import HandoffMetrics

    from ..conftest import prometheus_value

    metrics = HandoffMetrics("decode")
    with caplog.at_level("WARNING", logger="paged_kv.handoff"):
        for _ in range(3):
            metrics.fallback("engine_gone", "no answer")
        metrics.fallback("lease_expired", "too late")
    text = metrics.text()
    assert prometheus_value(text, "paged_kv_handoff_fallbacks_total",
                            '{reason="engine_gone"}') == 3
    assert prometheus_value(text, "paged_kv_handoff_fallbacks_total",
                            '{reason="verify_failed"}') == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "engine_gone" in lines[0] and "lease_expired" in lines[1]


def test_a_hand_off_role_with_tensor_parallelism_is_refused_before_anything_starts():
    from paged_kv.engine import Engine, TinyLlama
    from paged_kv.engine.config import EngineConfig
    from paged_kv.handoff import HandoffConfig

    model = TinyLlama()
    config = model.cache_config(num_blocks=16, block_size=16)
    handoff = HandoffConfig("decode", "127.0.0.1", 0, "s", 30.0, "recompute")
    with pytest.raises(ValueError, match="handoff: not supported with tensor_parallel_size"):
        Engine(model, EngineConfig(cache=config, tensor_parallel_size=2, handoff=handoff))
