"""The server keeps OpenAI's and vLLM's semantics: a tiny temperature is greedy, a failed step
is a 500 and a dead engine a 503, the stream is the text, EOS and ``ignore_eos`` act as in
vLLM, every request field is honoured or refused by name, auth comes before validation,
and tenants never share a cached prefix. Each runs against the app in-process (Starlette's
TestClient runs its lifespan, so the in-process engine client starts and stops with it)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
from starlette.testclient import TestClient

from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.server import ByteTokenizer, InprocClient
from paged_kv.server.http.app import create_app

CONFIG = TinyLlamaConfig(num_layers=1, hidden_size=64, intermediate_size=64, vocab_size=300,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position=512)
PROMPT = [5, 6, 7, 8, 9, 10, 11]


def make_client(model=None, tokenizer=None, *, num_blocks: int = 128, **app_kwargs):
    model = model or TinyLlama(CONFIG, seed=1)
    engine = Engine(model, EngineConfig(
        cache=model.cache_config(num_blocks=num_blocks, block_size=8)))
    app = create_app(InprocClient(engine), tokenizer or ByteTokenizer(), model_name="tiny",
                     **app_kwargs)
    return TestClient(app)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64, block_size=8)))
    return engine.generate([prompt], SamplingParams(max_tokens=n))[0].outputs[0].token_ids


def sse(response) -> list:
    return ["DONE" if line == "data: [DONE]" else json.loads(line[6:])
            for line in response.iter_lines() if line.startswith("data: ")]


# -- bug 1: a tiny temperature is greedy, and never aborts anyone ---------------------------
@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-38, 1e-6])
def test_tiny_temperature_is_greedy_for_everyone(temperature):
    model = TinyLlama(CONFIG, seed=1)
    want = greedy(model, PROMPT, 6)
    with make_client(model) as client:
        for temp in (temperature, 0.0):
            r = client.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 6, "temperature": temp, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and choice["token_ids"] == want


def test_sampling_params_refuse_non_finite_values():
    for field in ("temperature", "top_p"):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match=field):
                SamplingParams(**{field: bad})
    assert SamplingParams(temperature=1e-45).temperature == 0.0
    assert SamplingParams(temperature=0.5).temperature == 0.5


# -- bug 2: failures are errors, and a dead engine is not healthy ---------------------------
class FailOn(torch.nn.Module):
    """The model, except that a step holding `poison` raises (a test hook)."""

    def __init__(self, model: TinyLlama, poison: int) -> None:
        super().__init__()
        self.inner, self.poison = model, poison
        self.config = model.config

    def cache_config(self, **kwargs):
        return self.inner.cache_config(**kwargs)

    def forward(self, token_ids, *args):
        if (token_ids == self.poison).any():
            raise RuntimeError("poisoned input")
        return self.inner(token_ids, *args)


def test_a_failing_step_is_a_500_and_other_requests_still_complete():
    model = TinyLlama(CONFIG, seed=1)
    with make_client(FailOn(model, poison=299)) as client:
        bad = client.post("/v1/completions", json={"prompt": [1, 299, 3], "max_tokens": 4})
        assert bad.status_code == 500, bad.text
        assert bad.json()["error"]["type"] == "server_error"
        assert "poisoned" in bad.json()["error"]["message"]
        with client.stream("POST", "/v1/completions", json={
                "prompt": [299], "max_tokens": 4, "stream": True}) as stream:
            events = sse(stream)
        assert any(isinstance(e, dict) and "error" in e for e in events), events
        assert not any(isinstance(e, dict) and e.get("choices") and
                       e["choices"][0]["finish_reason"] in ("stop", "length", "abort")
                       for e in events), "a failed stream must not finish like a success"
        good = client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "return_token_ids": True,
            "temperature": 0})
        assert good.status_code == 200
        assert good.json()["choices"][0]["token_ids"] == greedy(model, PROMPT, 5)
        assert client.get("/health").status_code == 200


def test_a_dead_engine_answers_503_on_health_and_requests():
    with make_client() as client:
        engine_client = client.app.state.service.engine  # an InprocClient
        engine_client.submit(engine_client.engine.close).result(timeout=10)
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code in (500, 503), r.text
        for _ in range(100):
            if client.get("/health").status_code == 503:
                break
        health = client.get("/health")
        assert health.status_code == 503 and "closed" in health.json()["error"]["message"]
        after = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert after.status_code == 503


# -- bug 3: the stream is the text ---------------------------------------------------------
def word_tokenizer(path, words: list[str], chat_template: str | None = None):
    """Whole-word tokens with a metaspace ("▁") and ``clean_up_tokenization_spaces=True``,
    as many checkpoints ship, saved to `path`; returns (`HFTokenizer`, transformers')."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {w: i for i, w in enumerate(["[UNK]", *words])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Metaspace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                                clean_up_tokenization_spaces=True)
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    from paged_kv.server import HFTokenizer

    return HFTokenizer(path), transformers.AutoTokenizer.from_pretrained(path)


def _word_tokenizer(tmp_path):
    """Tokens whose first ones can end in a space that a following "," takes away under
    clean-up: ``"fv "`` + ``","`` decodes to ``"fv,"`` (what many real checkpoints do)."""
    words = ["\u2581fv", "\u2581xkzmn", "\u2581", ",", "\u2581hello", ".", "\u2581a"]
    return word_tokenizer(tmp_path, words)[0]


def test_streamed_text_equals_the_whole_text_with_clean_up_spaces(tmp_path):
    tokenizer = _word_tokenizer(tmp_path)
    assert tokenizer.decode([1, 3]) == "fv "  # a trailing space, which clean-up would
    assert tokenizer.decode([1, 3, 4]) == "fv ,"  # take away; no clean-up since issue 28
    config = TinyLlamaConfig(num_layers=1, hidden_size=64, intermediate_size=64,
                             vocab_size=8, num_heads=4, num_kv_heads=2, head_dim=16)
    for seed in range(4):
        with make_client(TinyLlama(config, seed=seed), tokenizer) as client:
            body = {"prompt": [1, 3, 2], "max_tokens": 40, "ignore_eos": True,
                    "temperature": 0}
            whole = client.post("/v1/completions", json=body).json()["choices"][0]
            with client.stream("POST", "/v1/completions",
                               json={**body, "stream": True}) as stream:
                events = sse(stream)
        streamed = "".join(e["choices"][0]["text"] for e in events if e != "DONE")
        assert streamed == whole["text"], (seed, streamed, whole["text"])


# -- bug 4 and planted fault 4: EOS --------------------------------------------------------
def test_ignore_eos_reaches_the_engine_and_the_tokenizer_eos_stops_otherwise():
    base = TinyLlama(CONFIG, seed=1)
    want = greedy(base, PROMPT, 10)
    eos = want[3]

    class Tokenizer(ByteTokenizer):
        eos_token_id = eos

    for model_eos, tokenizer in (((eos,), ByteTokenizer()), ((), Tokenizer())):
        model = TinyLlama(CONFIG, seed=1)
        model.eos_token_ids = model_eos  # the model's own EOS, or only the tokenizer's
        with make_client(model, tokenizer) as client:
            body = {"prompt": PROMPT, "max_tokens": 10, "return_token_ids": True,
                    "temperature": 0}
            stopped = client.post("/v1/completions", json=body).json()["choices"][0]
            assert stopped["token_ids"] == want[:want.index(eos) + 1]
            assert stopped["finish_reason"] == "stop"
            kept = client.post("/v1/completions",
                               json={**body, "ignore_eos": True}).json()["choices"][0]
            assert kept["token_ids"] == want and kept["finish_reason"] == "length"


# -- bug 7: --max-waiting 0 ----------------------------------------------------------------
def test_max_waiting_zero_serves_an_idle_server():
    with make_client(max_waiting=0) as client:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200, r.text


# -- bug 8: every field honoured or refused -------------------------------------------------
@pytest.mark.parametrize(("field", "name"), [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1.0}, "frequency_penalty"),
    ({"logit_bias": {"5": 3}}, "logit_bias"), ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"), ({"min_tokens": 2}, "min_tokens"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"min_p": 0.1}, "min_p"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logprobs": 2, "stream": True}, "logprobs"),
    ({"temperature": "nan"}, "temperature"),
])
def test_unhonoured_fields_are_refused_naming_them(field, name):
    with make_client() as client:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **field})
    assert r.status_code == 400, r.text
    assert name in r.json()["error"]["message"]


def test_neutral_values_of_refused_fields_are_accepted():
    with make_client() as client:
        r = client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 2, "presence_penalty": 0, "frequency_penalty": 0,
            "best_of": 1, "logit_bias": {}, "user": "u", "top_k": -1})
    assert r.status_code == 200, r.text


def test_completion_logprobs_and_echo():
    model = TinyLlama(CONFIG, seed=1)
    with make_client(model) as client:
        choice = client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "logprobs": 2,
            "return_token_ids": True, "temperature": 0}).json()["choices"][0]
        echoed = client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "logprobs": 1,
            "echo": True}).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(choice["token_ids"]) == 4
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    # two ids may decode to one string (a partial UTF-8 byte), so keys can merge
    assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])
    dense = model.forward_dense(torch.tensor(PROMPT + choice["token_ids"])).float()
    first = dense[len(PROMPT) - 1].log_softmax(-1)[choice["token_ids"][0]]
    assert logprobs["token_logprobs"][0] == pytest.approx(float(first), abs=1e-4)
    echo = echoed["logprobs"]
    assert len(echo["tokens"]) == len(PROMPT) + 4
    assert echo["token_logprobs"][0] is None and echo["token_logprobs"][1] <= 0
    assert echo["text_offset"] == sorted(echo["text_offset"])


def test_chat_parts_developer_role_logprobs_and_default_length():
    with make_client() as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                      {"type": "text", "text": "there"}]}],
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True, "max_tokens": 3})
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)
        image = client.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
        assert image.status_code == 400 and "image_url" in image.json()["error"]["message"]
        long = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
        assert long.status_code == 200
        assert long.json()["usage"]["completion_tokens"] > 16  # not OpenAI's completions 16


# -- auth comes first, on every /v1 route (planted fault 1) --------------------------------
def test_auth_before_body_validation_on_every_route():
    keys = {"key-a": "alice", "key-b": "bob"}
    with make_client(api_keys=keys) as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            malformed = client.post(path, content=b"{not json",
                                    headers={"content-type": "application/json"})
            assert malformed.status_code == 401, (path, malformed.text)
            assert client.post(path, json={}).status_code == 401
        assert client.get("/v1/models").status_code == 401
        ok = client.get("/v1/models", headers={"Authorization": "Bearer key-a"})
        assert ok.status_code == 200


def test_tenants_never_share_a_cached_prefix_on_chat():
    keys = {"key-a": "alice", "key-b": "bob"}
    long = "a shared system prompt that spans several blocks of the cache " * 3
    body = {"messages": [{"role": "system", "content": long},
                         {"role": "user", "content": "hi"}], "max_tokens": 1}
    with make_client(api_keys=keys) as client:
        def cached(key: str) -> int:
            r = client.post("/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("key-a") == 0
        assert cached("key-b") == 0, "bob was served alice's prefix"
        assert cached("key-a") > 0, "the same tenant reuses its prefix"
