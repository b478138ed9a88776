"""Hostile and odd input to the OpenAI server (issue 28): bounded log-probabilities and
vLLM's ``prompt_logprobs``, 400s (never 500s) naming the field in ``param`` for integers
too large to send, lone surrogates, over-long integer literals and chat templates that
refuse, a request-size limit, and detokenization that keeps every character.

Most tests run the app in-process (Starlette's TestClient, as `test_openai_semantics`); one
`paged-kv serve` subprocess checks the same through the process split and the flags.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random

import pytest
import torch

pytest.importorskip("fastapi")

from paged_kv.engine import RequestOutput, SamplingParams, StepOutput, TinyLlama
from paged_kv.server import ByteTokenizer
from paged_kv.server.http.generation import Generation
from paged_kv.server.http.protocol import InputLimits

from .test_openai_semantics import CONFIG, PROMPT, make_client, sse
from .test_openai_semantics import word_tokenizer as semantics_word_tokenizer
from .test_server import httpx, running_server

BIG = 2**64  # msgpack cannot send it: the engine core never may get it


def post(client, path: str, body: dict | bytes):
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


def assert_400(response, param: str | None, *words: str) -> dict:
    """An OpenAI error body, 400, naming `param` (and `words` in its message)."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "400"
    assert error["param"] == param, error
    if param is not None:  # (an error of the whole body says "body: ...")
        assert not error["message"].startswith("body:"), error
    for word in words:
        assert word in error["message"], (word, error)
    return error


# -- item 6: prompt_logprobs bounded and returned in vLLM's shape ---------------------------
@pytest.mark.parametrize(("path", "field", "extra"), [
    ("/v1/completions", "logprobs", {}),
    ("/v1/completions", "prompt_logprobs", {}),
    ("/v1/chat/completions", "top_logprobs", {"logprobs": True}),
    ("/v1/chat/completions", "prompt_logprobs", {}),
])
def test_logprob_fields_past_max_logprobs_are_400_naming_them(path, field, extra):
    body = {"max_tokens": 2, **extra}
    body.update({"prompt": PROMPT} if "chat" not in path
                else {"messages": [{"role": "user", "content": "hi"}]})
    with make_client() as default, \
            make_client(input_limits=InputLimits(max_logprobs=3)) as strict:
        assert_400(post(default, path, {**body, field: 21}), field, "20", "--max-logprobs")
        assert post(default, path, {**body, field: 20}).status_code == 200
        assert_400(post(strict, path, {**body, field: 4}), field, "3")
        assert post(strict, path, {**body, field: 3}).status_code == 200


def test_prompt_logprobs_come_back_in_vllms_shape():
    model = TinyLlama(CONFIG, seed=1)
    dense = model.forward_dense(torch.tensor(PROMPT)).float().log_softmax(-1)
    with make_client(model) as client:
        text = client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 2, "n": 2, "prompt_logprobs": 2}).json()
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "prompt_logprobs": 1}).json()
        plain = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert "prompt_logprobs" not in plain.json()["choices"][0]  # not asked, not computed
    assert text["choices"][0]["prompt_logprobs"] == text["choices"][1]["prompt_logprobs"]
    rows = text["choices"][0]["prompt_logprobs"]
    assert len(rows) == len(PROMPT) and rows[0] is None
    for position, (token, row) in enumerate(zip(PROMPT[1:], rows[1:], strict=True)):
        want = dense[position]  # the prompt's next token, predicted from the ones before
        top = torch.topk(want, 2).indices.tolist()
        keys = [int(key) for key in row]  # the prompt's token first, then the likeliest
        assert keys == [token, *(t for t in top if t != token)]
        for key, entry in zip(keys, row.values(), strict=True):
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert entry["logprob"] == pytest.approx(float(want[key]), abs=1e-4)
            # ranked among the top 2; a prompt token beyond them is not ranked
            assert entry["rank"] == (top.index(key) + 1 if key in top else None)
            assert entry["decoded_token"] == ByteTokenizer().decode([key])
    chat_rows = chat["prompt_logprobs"]  # vLLM: beside the choices, not in them
    assert chat_rows[0] is None and all(1 <= len(r) <= 2 for r in chat_rows[1:])
    assert "prompt_logprobs" not in chat["choices"][0]


def test_the_engine_computes_only_the_log_probabilities_asked_for():
    with make_client() as client:
        service = client.app.state.service

        def engine_params(body: dict, kind: str = "text") -> SamplingParams:
            from paged_kv.server.http.protocol import ChatCompletionRequest, CompletionRequest

            model = CompletionRequest if kind == "text" else ChatCompletionRequest
            return service.sampling(model.model_validate(body), PROMPT, kind)

        base = {"prompt": PROMPT, "max_tokens": 2}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert engine_params(base).prompt_logprobs is None
        assert engine_params({**base, "logprobs": 5}).prompt_logprobs is None  # no echo
        assert engine_params({**base, "logprobs": 0, "echo": True}).prompt_logprobs == 0
        assert engine_params({**base, "logprobs": 3, "echo": True,
                              "prompt_logprobs": 1}).prompt_logprobs == 3
        assert engine_params({**base, "echo": True}).prompt_logprobs is None
        assert engine_params({**chat, "logprobs": True}, "chat").prompt_logprobs is None
        assert engine_params({**chat, "prompt_logprobs": 2}, "chat").prompt_logprobs == 2


def test_prompt_logprobs_on_a_stream_are_refused():
    with make_client() as client:
        r = post(client, "/v1/completions", {"prompt": PROMPT, "stream": True,
                                             "prompt_logprobs": 1})
    assert_400(r, "prompt_logprobs", "stream")


# -- planted fault: echo with logprobs 0 ----------------------------------------------------
@pytest.mark.parametrize("num", [0, 1])
def test_echo_gives_a_log_probability_for_every_prompt_token(num):
    with make_client() as client:
        choice = client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "logprobs": num,
            "echo": True}).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert all(len(top) <= num for top in logprobs["top_logprobs"][1:])
    assert "prompt_logprobs" not in choice


def test_zero_log_probabilities_is_the_chosen_token_s_not_none():
    """0 asks for the chosen tokens' log-probabilities alone; only an absent field is off."""
    with make_client() as client:
        text = client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "logprobs": 0,
            "prompt_logprobs": 0}).json()["choices"][0]
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 0}).json()["choices"][0]
    assert len(text["logprobs"]["token_logprobs"]) == 3
    assert all(lp <= 0 for lp in text["logprobs"]["token_logprobs"])
    assert [len(row) for row in text["prompt_logprobs"][1:]] == [1] * (len(PROMPT) - 1)
    content = chat["logprobs"]["content"]
    assert len(content) == 3 and all(c["top_logprobs"] == [] for c in content)


def test_echo_and_prompt_logprobs_each_get_their_own_count():
    with make_client() as client:
        choice = client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 2, "logprobs": 2, "echo": True,
            "prompt_logprobs": 0}).json()["choices"][0]
    prompt_part = choice["logprobs"]["top_logprobs"][1:len(PROMPT)]
    assert all(1 <= len(top) <= 2 for top in prompt_part)  # echo's logprobs: 2
    assert any(len(top) == 2 for top in prompt_part)
    rows = choice["prompt_logprobs"]
    assert [len(row) for row in rows[1:]] == [1] * (len(PROMPT) - 1)  # only the token
    assert all(list(row) == [str(t)] for t, row in zip(PROMPT[1:], rows[1:], strict=True))


# -- item 8: integers too large to send, lone surrogates, long literals: 400, not 500 -------
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = {"prompt": PROMPT, "max_tokens": 2}


@pytest.mark.parametrize(("base", "field", "value", "param"), [
    (TEXT, "top_k", BIG, "top_k"), (TEXT, "stop_token_ids", [3, BIG], "stop_token_ids.1"),
    (TEXT, "prompt_logprobs", BIG, "prompt_logprobs"), (TEXT, "logprobs", BIG, "logprobs"),
    (TEXT, "n", BIG, "n"), (TEXT, "best_of", BIG, "best_of"),
    (TEXT, "max_tokens", BIG, "max_tokens"), (TEXT, "seed", BIG, "seed"),
    (TEXT, "min_tokens", BIG, "min_tokens"), (TEXT, "top_k", -BIG, "top_k"),
    (TEXT, "stop_token_ids", [-1], "stop_token_ids.0"), (TEXT, "prompt", [5, BIG], "prompt"),
    (CHAT, "max_completion_tokens", BIG, "max_completion_tokens"),
    (CHAT, "top_logprobs", BIG, "top_logprobs"),
])
def test_every_integer_field_is_bounded(base, field, value, param):
    path = "/v1/chat/completions" if "messages" in base else "/v1/completions"
    with make_client() as client:
        assert_400(post(client, path, {**base, field: value}), param, field)
        assert post(client, path, base).status_code == 200  # and the server goes on


@pytest.mark.parametrize(("base", "field", "param"), [
    (TEXT, "max_tokens", "max_tokens"), (TEXT, "top_k", "top_k"),
    (TEXT, "temperature", "temperature"), (TEXT, "prompt", "prompt.1"),
    (CHAT, "messages", "messages.0.content.0"),
])
def test_an_integer_literal_too_long_for_python_is_400_at_its_field(base, field, param):
    digits = "7" * 5000  # json.loads raises ValueError (not JSONDecodeError) for it
    literal = {"prompt": f"[5, {digits}]",
               "messages": f'[{{"role": "user", "content": [{digits}]}}]'}.get(field, digits)
    raw = json.dumps({**base, field: "HOLE"}).replace('"HOLE"', literal).encode()
    path = "/v1/chat/completions" if "messages" in base else "/v1/completions"
    with make_client() as client:
        assert_400(post(client, path, raw), param, "5000 digits")
        assert_400(post(client, path, b'{"prompt": "\xff"}'), None, "UTF-8")
        deep = b'{"prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        assert_400(post(client, path, deep), None, "nested")  # (RecursionError in json)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "ab\ud800c", "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [5], "stop": ["x", "\udfff"]}, "stop.1"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud83d"}]},
     "messages.0.content"),
])
def test_a_lone_surrogate_is_400_at_its_field(path, body, param):
    raw = json.dumps(body).encode()  # ensure_ascii: "\\ud800", valid JSON
    assert b"\\ud" in raw
    with make_client() as client:
        error = assert_400(post(client, path, raw), param, "surrogate")
        assert "\\ud" in error["message"]  # quoted escaped, so the error itself encodes
        pair = post(client, "/v1/completions", {"prompt": "\U0001F600", "max_tokens": 1})
        assert pair.status_code == 200  # a surrogate pair in JSON is one real character


# -- item 13: the field in `param`, not "body: ..." in the message --------------------------
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {**TEXT, "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {**TEXT, "best_of": 3}, "best_of"),
    ("/v1/completions", {**TEXT, "stream_options": {}}, "stream_options"),
    ("/v1/completions", {**TEXT, "stream": True, "echo": True}, "echo"),
    ("/v1/completions", {**TEXT, "stream": True, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {**TEXT, "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/completions", {**TEXT, "temperature": -1}, "temperature"),
    ("/v1/completions", {**TEXT, "n": 500}, "n"),  # past max_num_seqs: the engine's check
    ("/v1/completions", {"prompt": [5, 300]}, "prompt"),  # past the vocabulary
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 600}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "stream": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content"),
])
def test_a_refused_field_is_named_in_param(path, body, param):
    with make_client() as client:
        assert_400(post(client, path, body), param)


# -- item 13: --max-request-bytes -----------------------------------------------------------
def test_a_body_past_max_request_bytes_is_413_before_it_is_parsed():
    limits = InputLimits(max_request_bytes=500)
    small = json.dumps({"prompt": "x" * 450, "max_tokens": 1}).encode()
    big = json.dumps({"prompt": "x" * 550, "max_tokens": 1}).encode()
    assert len(small) <= 500 < len(big)

    def chunked():  # no Content-Length: the limit holds while the body arrives
        yield big[:300]
        yield big[300:]

    with make_client(input_limits=limits) as client:
        assert post(client, "/v1/completions", small).status_code == 200
        for content in (big, chunked()):
            r = client.post("/v1/completions", content=content,
                            headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "413"
            assert "--max-request-bytes" in error["message"] and "500" in error["message"]
        assert post(client, "/v1/completions", {"prompt": "x", "max_tokens": 1}
                    ).status_code == 200


# -- HF tokenizers built here (no download) -------------------------------------------------
WORDS = ["\u2581hello", "\u2581,", ",", "\u2581world", "\u2581.", ".", "\u2581", "\u2581n't",
         "\u2581'", "'", "\u2581's", "\u2581do", "\u2581?", "\u2581!", "\u2581'm"]
REFUSE_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                 "{{ raise_exception('System role not supported') }}{% endif %}"
                 "{{ m['content'] }}{% endfor %}")


def word_tokenizer(path, chat_template: str | None = None):
    """`WORDS` as a checkpoint's tokenizer, clean-up on; (`HFTokenizer`, transformers')."""
    return semantics_word_tokenizer(path, WORDS, chat_template)


class _Outputs:
    """The engine as a `Generation` sees it: `add` keeps the callback, nothing runs."""

    is_alive, dead = True, None

    async def add(self, prompt_token_ids, params, salt, on_output) -> int:
        self.on_output = on_output
        return 0

    def abort(self, request_id: int) -> None:
        pass


def streamed(tokenizer, token_ids: list[int]) -> tuple[str, str]:
    """(the deltas a client streams, the final text) for tokens arriving one per step."""

    async def run() -> tuple[str, str]:
        engine = _Outputs()
        generation = Generation(engine, tokenizer, [1], SamplingParams(), [], None)
        await generation.start()
        last = RequestOutput(0, [1], [], True, 0, 0, 0.0, [])
        for i, token in enumerate(token_ids):
            done = i == len(token_ids) - 1
            engine.on_output(StepOutput(0, 0, [token], "length" if done else None,
                                        last if done else None))
        deltas = [delta async for _, delta, _ in generation.updates()]
        return "".join(deltas), generation.choices[0].text

    return asyncio.run(run())


# -- item 12: detokenization keeps every character ------------------------------------------
def test_detokenization_keeps_the_characters_clean_up_would_drop(tmp_path):
    tokenizer, hf = word_tokenizer(tmp_path)
    ids = tokenizer.encode("hello , world .")
    assert hf.convert_ids_to_tokens(ids) == ["\u2581hello", "\u2581,", "\u2581world", "\u2581."]
    assert streamed(tokenizer, ids) == ("hello , world .",) * 2
    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randrange(1, len(WORDS) + 1) for _ in range(rng.randrange(1, 7))]
        want = hf.decode(ids, clean_up_tokenization_spaces=False)
        assert streamed(tokenizer, ids) == (want, want), hf.convert_ids_to_tokens(ids)


def test_served_text_is_the_tokens_decoded_without_clean_up(tmp_path):
    tokenizer, hf = word_tokenizer(tmp_path)
    config = dataclasses.replace(CONFIG, vocab_size=len(WORDS) + 1)
    texts = set()
    for seed in range(3):
        with make_client(TinyLlama(config, seed=seed), tokenizer) as client:
            body = {"prompt": "hello , world", "max_tokens": 30, "ignore_eos": True,
                    "temperature": 1.0, "seed": seed, "return_token_ids": True}
            whole = client.post("/v1/completions", json=body).json()["choices"][0]
            with client.stream("POST", "/v1/completions",
                               json={**body, "stream": True}) as stream:
                events = [e for e in sse(stream) if e != "DONE"]
        want = hf.decode(whole["token_ids"], skip_special_tokens=True,
                         clean_up_tokenization_spaces=False)
        assert whole["text"] == want
        assert "".join(e["choices"][0]["text"] for e in events) == want
        texts.add(want)
    assert any(" ," in text or " ." in text or " '" in text for text in texts)


# -- item 8: a chat template that raises ----------------------------------------------------
def test_a_chat_template_that_refuses_the_messages_is_400(tmp_path):
    tokenizer, _ = word_tokenizer(tmp_path, chat_template=REFUSE_SYSTEM)
    config = dataclasses.replace(CONFIG, vocab_size=len(WORDS) + 1)
    with make_client(TinyLlama(config, seed=0), tokenizer) as client:
        refused = post(client, "/v1/chat/completions", {"messages": [
            {"role": "system", "content": "hello"}, {"role": "user", "content": "hello"}]})
        assert_400(refused, "messages", "System role not supported")
        fine = post(client, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
        assert fine.status_code == 200, fine.text


# -- the same through `paged-kv serve`: the process split and the flags ---------------------
@pytest.fixture(scope="module")
def limited_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("input") / "log"
    with running_server("--max-logprobs", "3", "--max-request-bytes", "8000",
                        log=log) as (_, url):
        yield url


def test_serve_refuses_hostile_input_with_400s_and_goes_on(limited_server):
    url = f"{limited_server}/v1/completions"
    hostile = [({"top_k": BIG}, "top_k"), ({"stop_token_ids": [BIG]}, "stop_token_ids.0"),
               ({"prompt_logprobs": BIG}, "prompt_logprobs"), ({"logprobs": 4}, "logprobs"),
               ({"prompt_logprobs": 4}, "prompt_logprobs"), ({"prompt": "a\ud800"}, "prompt"),
               ({"seed": BIG}, "seed")]
    for _ in range(3):  # more than once: nothing is left behind that refuses later requests
        for extra, param in hostile:
            raw = json.dumps({"prompt": "hi", "max_tokens": 2, **extra}).encode()
            assert_400(httpx.post(url, content=raw, timeout=30,
                                  headers={"content-type": "application/json"}), param)
    raw = b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
    assert_400(httpx.post(url, content=raw, timeout=30,
                          headers={"content-type": "application/json"}), "max_tokens", "digits")
    big = json.dumps({"prompt": "x" * 8000}).encode()
    too_large = httpx.post(url, content=big, timeout=30,
                           headers={"content-type": "application/json"})
    assert too_large.status_code == 413 and "--max-request-bytes" in too_large.text
    ok = httpx.post(url, timeout=60, json={"prompt": "hi", "max_tokens": 2, "logprobs": 3,
                                           "prompt_logprobs": 3})
    assert ok.status_code == 200, ok.text
    rows = ok.json()["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == 2 and 3 <= len(rows[1]) <= 4
    assert httpx.get(f"{limited_server}/health", timeout=10).status_code == 200


def test_serve_flags_default_to_the_input_limits_defaults():
    from paged_kv.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert InputLimits(args.max_logprobs, args.max_request_bytes) == InputLimits()
    assert InputLimits().max_logprobs == 20  # vLLM's
    with pytest.raises(ValueError, match="max_request_bytes"):
        InputLimits(max_request_bytes=0)
