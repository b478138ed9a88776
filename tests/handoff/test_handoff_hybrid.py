"""The hand-off of hybrid layouts (layer groups: sliding-window, chunked, sink layers) between
two `Engine`s in one process (real ZMQ on loopback).

The prefill engine leases exactly what the decode engine's tier fetch asks for (the leading
group's blocks, then each other group's last window under its `group_key`s, named by
``group_starts``); the decode engine's greedy tokens equal a single engine's and the model's
own (`TinyLlama.forward_dense`, transformers' ``generate``) for prompts shorter and longer
than the window; every prompt block but the last came from the peer; no lease is left, both
caches check and hold no block.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("prometheus_client")

from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.engine.threads import intra_op_threads
from paged_kv.handoff import HandoffConfig
from paged_kv.handoff.params import parse_params

from ..conftest import prometheus_value
from ..engine.conftest import prompt
from ..engine.test_tiny_hybrid import SHAPE, VARIANTS

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# shorter than the window (8), one past it, several windows, past two chunks of 16
LENGTHS = (3, 9, 23, 41)
TINY = {**{name: VARIANTS[name] for name in ("mixed", "sliding", "chunked", "sinks")},
        # Gemma 3's shape: five window layers to each full one
        "gemma3": dict(num_layers=6, layer_kinds=("sliding:8",) * 5 + ("full",))}


@pytest.fixture(autouse=True)
def one_thread():
    with intra_op_threads(1):
        yield


def engines(make_model, block_size: int, dtype: str = "auto") -> dict[str, Engine]:
    """A prefill, a decode and a ``both`` engine over models from `make_model()`."""
    built = {}
    for role in ("prefill", "decode", "both"):
        model = make_model()
        config = model.cache_config(num_blocks=128, block_size=block_size,
                                    kv_cache_dtype=dtype)
        built[role] = Engine(model, EngineConfig(
            cache=config, num_threads=1,
            handoff=None if role == "both" else HandoffConfig(role, secret="s")))
    return built


def run(e: Engine, request_id: int, limit: int = 5000):
    for _ in range(limit):
        for out in e.step():
            if out.request_id == request_id:
                return out
    raise AssertionError("the request did not finish")


def prefill(e: Engine, tokens: list[int]) -> dict:
    rid = e.add_request(tokens, SamplingParams(max_tokens=1, temperature=0),
                        handoff=parse_params({"do_remote_decode": True}))
    return run(e, rid).kv_transfer_params


def fallbacks(e: Engine) -> float:
    text = e.metrics_text()
    return sum(prometheus_value(text, "paged_kv_handoff_fallbacks_total", f'{{reason="{r}"}}')
               for r in ("missing_params", "engine_gone", "lease_expired", "transfer_failed",
                         "verify_failed", "tenant_mismatch"))


def hand_off(built: dict[str, Engine], tokens: list[int]) -> tuple[list[int], list[int]]:
    """The decode engine's tokens of `tokens` after a hand-off, and the single engine's;
    every full block but the one holding the last token must come from the peer."""
    pre, dec, both = built["prefill"], built["decode"], built["both"]
    params = {**prefill(pre, tokens), "do_remote_prefill": True}
    assert len(params.get("group_starts", ())) == len(dec.cache.groups) - 1
    out = run(dec, dec.add_request(tokens, GREEDY, handoff=parse_params(params)))
    [ref] = both.generate([tokens], GREEDY)
    size = dec.cache.config.block_size
    assert out.cached_by_source.get("peer", 0) == (len(tokens) - 1) // size * size, \
        f"prompt of {len(tokens)}: not every block came from the peer"
    assert fallbacks(dec) == 0, f"prompt of {len(tokens)}: the hand-off fell back"
    return out.outputs[0].token_ids, ref.outputs[0].token_ids


def assert_idle(built: dict[str, Engine]) -> None:
    """No lease left on the prefill engine, no fallback, every cache checks and is empty."""
    pre = built["prefill"]
    deadline = time.monotonic() + 5
    while prometheus_value(pre.metrics_text(), "paged_kv_handoff_leases", '{state="live"}') \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert prometheus_value(pre.metrics_text(), "paged_kv_handoff_leases",
                            '{state="live"}') == 0
    assert fallbacks(built["decode"]) == 0
    for e in built.values():
        e.check()
        assert e.stats().num_live_blocks == 0
        assert not e.has_unfinished_requests


def close(built: dict[str, Engine]) -> None:
    for e in built.values():
        e.close()


@pytest.mark.parametrize("block_size", [4, 6])
@pytest.mark.parametrize("variant", sorted(TINY))
def test_tiny_hybrid_models_give_the_single_engines_and_the_references_tokens(variant,
                                                                              block_size):
    """Window 8 with blocks of 4 (a divisor) and 6 (none); prompts inside and far past
    the window and two chunks; the reference is ``forward_dense``'s greedy loop."""
    config = TinyLlamaConfig(**{**SHAPE, **TINY[variant]})
    built = engines(lambda: TinyLlama(config), block_size)
    try:
        assert built["decode"].cache.groups  # a hybrid layout
        model = TinyLlama(config)  # the engines' weights (the same seed)
        for length in LENGTHS:
            tokens = prompt(length, seed=length, vocab_size=SHAPE["vocab_size"])
            got, single = hand_off(built, tokens)
            assert got == single, f"{variant}, block {block_size}, prompt of {length}"
            assert got == dense_tokens(model, tokens), f"{variant}: not forward_dense's"
        assert_idle(built)
    finally:
        close(built)


def test_int8_pages_of_a_hybrid_model_give_the_single_engines_tokens():
    """8-bit pages (with their scales) of the sliding/full mix hand over as they are."""
    config = TinyLlamaConfig(**SHAPE, **TINY["mixed"])
    built = engines(lambda: TinyLlama(config), 4, "int8")
    try:
        for length in LENGTHS:
            got, single = hand_off(built, prompt(length, seed=length, vocab_size=256))
            assert got == single
        assert_idle(built)
    finally:
        close(built)


def test_a_decode_engines_own_prefix_hit_asks_the_peer_for_the_rest_only():
    """A prompt extending one the decode engine already served (under a tenant's salt):
    the device's hit plus the peer's blocks make every full block but the last, the
    window groups ask for their last window only, and the tokens are the single engine's."""
    config = TinyLlamaConfig(**SHAPE, **TINY["mixed"])
    built = engines(lambda: TinyLlama(config), 4)
    pre, dec, both = built["prefill"], built["decode"], built["both"]
    try:
        first = prompt(41, seed=41, vocab_size=256)
        for tokens in (first[:23], first):
            params = {**prefill_salted(pre, tokens), "do_remote_prefill": True}
            rid = dec.add_request(tokens, GREEDY, salt="t",
                                  handoff=parse_params(params))
            out = run(dec, rid)
            [ref] = both.generate([tokens], GREEDY)
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert 0 < out.cached_by_source["peer"] < 40
        assert sum(out.cached_by_source.values()) == 40
        assert fallbacks(dec) == 0
        assert_idle(built)
    finally:
        close(built)


def prefill_salted(e: Engine, tokens: list[int]) -> dict:
    rid = e.add_request(tokens, SamplingParams(max_tokens=1, temperature=0), salt="t",
                        handoff=parse_params({"do_remote_decode": True}))
    return run(e, rid).kv_transfer_params


def test_params_without_group_starts_fall_back_never_silently():
    """A hybrid decode engine given a uniform prefill's parameters (no ``group_starts``)
    counts a ``missing_params`` fallback and recomputes the same tokens."""
    config = TinyLlamaConfig(**SHAPE, **TINY["mixed"])
    built = engines(lambda: TinyLlama(config), 4)
    pre, dec, both = built["prefill"], built["decode"], built["both"]
    try:
        tokens = prompt(23, seed=23, vocab_size=256)
        params = {**prefill(pre, tokens), "do_remote_prefill": True}
        del params["group_starts"]
        out = run(dec, dec.add_request(tokens, GREEDY, handoff=parse_params(params)))
        [ref] = both.generate([tokens], GREEDY)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.cached_by_source.get("peer", 0) == 0
        assert prometheus_value(dec.metrics_text(), "paged_kv_handoff_fallbacks_total",
                                '{reason="missing_params"}') == 1
        dec.check()
        assert dec.stats().num_live_blocks == 0
    finally:
        close(built)


@pytest.mark.parametrize("value", ["3", [1, "2"], [-1], [True]])
def test_bad_group_starts_name_the_field(value):
    with pytest.raises(ValueError, match=r"kv_transfer_params\.group_starts"):
        parse_params({"group_starts": value})


def dense_tokens(model: TinyLlama, tokens: list[int]) -> list[int]:
    out: list[int] = []
    while len(out) < MAX_TOKENS:
        out.append(int(model.forward_dense(torch.tensor(tokens + out))[-1].argmax()))
    return out


# -- transformers' hybrid families ---------------------------------------------------------
HF_FAMILIES = ("gemma2", "gemma3", "gpt-oss")
HF_LENGTHS = (10, 40)  # inside and past the window of 16


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_hybrid_checkpoints_give_generates_tokens(family, tmp_path):
    """Tiny random Gemma 2, Gemma 3 and gpt-oss checkpoints (window 16, blocks of 6): the
    decode engine's tokens after a hand-off equal the single engine's and ``generate``'s."""
    transformers = pytest.importorskip("transformers")
    from paged_kv.engine.hf import HFCausalLM

    from ..engine.test_hybrid_models import hybrid_configs, save_checkpoint

    save_checkpoint(hybrid_configs()[family][0], tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    built = engines(lambda: HFCausalLM.from_pretrained(tmp_path), 6)
    try:
        for length in HF_LENGTHS:
            tokens = prompt(length, seed=length, vocab_size=128)
            got, single = hand_off(built, tokens)
            ids = torch.tensor([tokens])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids),
                                       do_sample=False, max_new_tokens=MAX_TOKENS,
                                       eos_token_id=None, pad_token_id=0)[0, length:].tolist()
            assert got == single == generated, f"{family}, prompt of {length}"
        assert_idle(built)
    finally:
        close(built)


# -- over HTTP: three ``paged-kv serve`` processes on a Gemma 2 checkpoint --------------------
def gemma2_checkpoint(path):
    """A tiny random Gemma 2 checkpoint (a vocabulary of 128; window and full layers) with
    a word-level tokenizer of 96 printable characters (serve needs one), saved at `path`."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from ..engine.test_hybrid_models import hybrid_configs, save_checkpoint

    save_checkpoint(hybrid_configs()["gemma2"][0], path)
    vocab = {"<unk>": 0, **{chr(32 + i): i + 1 for i in range(95)}}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=word_level,
                                         unk_token="<unk>").save_pretrained(path)
    return path


def test_servers_hand_over_a_gemma2_checkpoints_pages(tmp_path):
    """``--role prefill`` and ``--role decode`` servers on a tiny Gemma 2 checkpoint: the
    prefill's ``kv_transfer_params`` carry ``group_starts`` through JSON, and the decode
    server's tokens equal a ``both`` server's, its usage counting the peer's tokens."""
    from ..server.test_server import running_server
    from .conftest import post_as_router

    common = ("--model", str(gemma2_checkpoint(tmp_path / "ckpt")), "--block-size", "4",
              "--memory-mib", "2")
    handoff = (*common, "--handoff-secret", "s")
    tokens = prompt(40, seed=40, vocab_size=96)
    body = {"prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}

    def post(url: str, extra: dict) -> dict:
        reply = post_as_router(f"{url}/v1/completions", {**body, **extra}, secret="s")
        assert reply.status_code == 200, reply.text
        return reply.json()

    with running_server("--role", "prefill", *handoff, log=tmp_path / "prefill") as (_, pre), \
            running_server("--role", "decode", *handoff, log=tmp_path / "decode") as (_, dec), \
            running_server(*common, log=tmp_path / "both") as (_, both):
        params = post(pre, {"max_tokens": 1, "kv_transfer_params":
                            {"do_remote_decode": True}})["kv_transfer_params"]
        assert len(params["group_starts"]) == 1  # Gemma 2: a window group, a full one
        got = post(dec, {"kv_transfer_params": {**params, "do_remote_prefill": True}})
        want = post(both, {})
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    usage = got["usage"]["prompt_tokens_details"]
    assert usage["cached_tokens_by_source"]["peer"] == (40 - 1) // 4 * 4


# -- latent pages: DeepSeek V2 / V3 --------------------------------------------------------
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_latent_checkpoints_hand_over_their_latent_pages(family, tmp_path_factory):
    """DeepSeek's latent rows are pages like any (one kv head of half a row): a hand-off
    carries them, and the decode engine's tokens equal the single engine's and
    ``generate``'s."""
    pytest.importorskip("transformers")
    from paged_kv.engine.hf import HFCausalLM

    from ..engine.conftest import generate_greedy, save_random_checkpoints
    from ..engine.test_latent_models import latent_configs

    path = save_random_checkpoints(tmp_path_factory, {family: latent_configs()[family]})[family]
    prompts = {length: prompt(length, seed=length, vocab_size=128) for length in HF_LENGTHS}
    expected = generate_greedy({family: path}, prompts, MAX_TOKENS,
                               attn_implementation="eager")
    built = engines(lambda: HFCausalLM.from_pretrained(path), 6)
    try:
        for length, tokens in prompts.items():
            got, single = hand_off(built, tokens)
            assert got == single == expected[family, length], f"{family}, prompt of {length}"
        assert_idle(built)
    finally:
        close(built)
