"""`paged-kv serve` over loopback: OpenAI shapes, streaming, tenants, backpressure, shutdown.

Each server is a real subprocess (``python -m paged_kv.cli serve``) on a free 127.0.0.1 port,
started by a fixture and stopped in its teardown; one shared server serves most tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from paged_kv.engine import Engine, SamplingParams, TinyLlama  # noqa: E402
from paged_kv.engine.config import EngineConfig  # noqa: E402
from paged_kv.server import ByteTokenizer  # noqa: E402

from ..conftest import ROOT, prometheus_value  # noqa: E402

VOCAB = 2048  # TinyLlama()'s default
MODEL = "paged-kv-tiny-llama"  # the name it is served under (another is a 404)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(*flags: str, log: Path, command: tuple[str, ...] | None = None):
    """Start ``paged-kv serve`` (or `command`, given the same flags) with `flags`, wait for
    /health (bounded), stop it after."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = command or (sys.executable, "-m", "paged_kv.cli")
    with open(log, "w") as out:
        proc = subprocess.Popen([*command, "serve", "--port", str(port), *flags], env=env,
                                stdout=out, stderr=out, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.25)
        else:
            raise RuntimeError(f"server not healthy in 60 s: {log.read_text()}")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def server_and_log(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "log"
    with running_server(log=log) as (_, url):
        yield url, log


@pytest.fixture(scope="module")
def server(server_and_log):
    return server_and_log[0]


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    """Two tenants, a small pool, and a queue of two: auth, isolation and backpressure."""
    path = tmp_path_factory.mktemp("strict")
    (path / "keys").write_text("# key tenant\nkey-a alice\nkey-a2 alice\nkey-b bob\n")
    with running_server("--api-keys", str(path / "keys"), "--max-waiting", "2",
                        "--max-num-seqs", "2", "--memory-mib", "4", log=path / "log") as (_, url):
        yield url


@pytest.fixture(scope="module")
def reference():
    """``reference(prompts, max_tokens)``: greedy `Engine.generate` on `TinyLlama()`."""
    model = TinyLlama()
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=512)))

    def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
        return [o.outputs[0].token_ids for o in outs]
    return run


def make_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def metric(url: str, name: str, labels: str = "") -> float:
    return prometheus_value(httpx.get(f"{url}/metrics", timeout=30).text, name, labels)


def leave_a_stream(url: str, body: dict, lines: int, running: int) -> None:
    """Stream a completion, read `lines` SSE lines, check that `running` sequences run on
    live blocks, then leave: the connection closes mid-stream."""
    with httpx.Client(timeout=60) as client, \
            client.stream("POST", f"{url}/v1/completions", json=body) as response:
        events = response.iter_lines()
        for _ in range(lines):
            next(events)
        assert metric(url, "paged_kv_running_requests") == running
        assert metric(url, "paged_kv_blocks", '{state="live"}') > 0


def sse_events(lines) -> list[dict]:
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append("DONE" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


# -- completions ----------------------------------------------------------------------------
def test_greedy_token_prompt_equals_engine_generate(server, reference):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    prompt = make_prompt(37, seed=1)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                         temperature=0,
                                         extra_body={"return_token_ids": True,
                                                     "ignore_eos": True})
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == reference([prompt], 12)[0]
    assert choice.model_extra["prompt_token_ids"] == prompt
    assert choice.finish_reason == "length"
    assert choice.text == ByteTokenizer().decode(choice.model_extra["token_ids"])
    assert (response.usage.prompt_tokens, response.usage.completion_tokens,
            response.usage.total_tokens) == (37, 12, 49)


def test_stream_concatenates_to_the_non_streamed_result(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    kwargs = dict(model=MODEL, prompt="The paged cache", max_tokens=20, temperature=0.9,
                  seed=7, extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].model_extra["token_ids"] == whole.model_extra["token_ids"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(whole.model_extra["token_ids"]) == 20


def test_stop_string_and_stop_token_ids(server, reference):
    prompt = make_prompt(20, seed=2)
    want = reference([prompt], 10)[0]
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stop_token_ids": [want[3]]}
    choice = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]
    first = want.index(want[3])
    assert choice["token_ids"] == want[:first + 1] and choice["finish_reason"] == "stop"
    # a stop string: ask for text, stop at the first byte the model emits
    text_prompt = "abc"
    free = httpx.post(f"{server}/v1/completions", timeout=60, json={
        "prompt": text_prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}).json()
    text = free["choices"][0]["text"].replace("\ufffd", "")
    if not text:
        pytest.skip("greedy output of this prompt holds no printable byte")
    cut = httpx.post(f"{server}/v1/completions", timeout=60, json={
        "prompt": text_prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "stop": [text[0]]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and text[0] not in cut["text"]


def test_48_concurrent_streams_get_their_tokens_then_nothing_is_left(server, reference):
    prompts = [make_prompt(5 + 3 * i, seed=100 + i) for i in range(48)]
    want = reference(prompts, 8)

    async def one(client, prompt):
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        async with client.stream("POST", f"{server}/v1/completions", json=body) as response:
            assert response.status_code == 200
            return sse_events([line async for line in response.aiter_lines()])

    async def all_of_them():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    for i, events in enumerate(asyncio.run(all_of_them())):
        assert events[-1] == "DONE", f"client {i}"
        last = events[-2]["choices"][0]
        assert last["token_ids"] == want[i], f"client {i}"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == \
            ByteTokenizer().decode(want[i])
    assert metric(server, "paged_kv_running_requests") == 0
    assert metric(server, "paged_kv_waiting_requests") == 0
    assert metric(server, "paged_kv_blocks", '{state="live"}') == 0


def test_disconnect_mid_stream_frees_the_blocks(server):
    body = {"prompt": make_prompt(40, seed=3), "max_tokens": 3000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    leave_a_stream(server, body, lines=3, running=1)
    for _ in range(200):  # bounded: the abort lands within a step of the disconnect
        if metric(server, "paged_kv_blocks", '{state="live"}') == 0:
            break
        time.sleep(0.05)
    assert metric(server, "paged_kv_blocks", '{state="live"}') == 0
    assert metric(server, "paged_kv_running_requests") == 0


def test_disconnect_while_waiting_for_a_whole_completion_frees_the_blocks(server):
    body = {"prompt": make_prompt(40, seed=5), "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", json=body, timeout=1.5)
    for _ in range(60):  # bounded, far below the ~3000 steps the request would take to finish
        if metric(server, "paged_kv_running_requests") == 0:
            break
        time.sleep(0.05)
    assert metric(server, "paged_kv_running_requests") == 0
    assert metric(server, "paged_kv_blocks", '{state="live"}') == 0
    assert metric(server, "paged_kv_http_requests_total",
                  '{endpoint="/v1/completions",status="499"}') == 1, "ended as an abort"


def test_start_up_log_says_single_tenant(server_and_log):
    url, log = server_and_log
    assert "single tenant" in log.read_text()
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200, "no auth needed"


def test_models_health_and_metrics_histograms(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["paged-kv-tiny-llama"]
    # a request of its own: the histograms must not depend on the tests run before
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    assert metric(server, "paged_kv_time_to_first_token_seconds_count") > 0
    assert metric(server, "paged_kv_inter_token_latency_seconds_count") > 0
    assert metric(server, "paged_kv_http_requests_total",
                  '{endpoint="/v1/completions",status="200"}') > 0


BAD_INPUTS = [
    pytest.param(b"{not json", 400, id="malformed-json"),
    pytest.param({"prompt": 5}, 400, id="prompt-wrong-type"),
    pytest.param({"prompt": ""}, 400, id="empty-prompt"),
    pytest.param({"prompt": []}, 400, id="empty-token-list"),
    pytest.param({"prompt": "x", "n": 0}, 400, id="n-zero"),
    pytest.param({"prompt": "x", "max_tokens": "many"}, 400, id="max-tokens-wrong-type"),
    pytest.param({"prompt": "x", "max_tokens": 0}, 400, id="max-tokens-zero"),
    pytest.param({"prompt": "x", "temperature": -1}, 400, id="negative-temperature"),
    pytest.param({"prompt": "x", "top_p": 0}, 400, id="top-p-zero"),
    pytest.param({"prompt": "x", "stop": 5}, 400, id="stop-wrong-type"),
    pytest.param({"prompt": [VOCAB + 5]}, 400, id="token-id-out-of-vocab"),
    pytest.param({"prompt": "x", "max_tokens": 10**6}, 400, id="beyond-max-position"),
    pytest.param({"prompt": "x", "n": 1000}, 400, id="n-beyond-max-num-seqs"),
    pytest.param({"prompt": "x", "seed": 10**24}, 400, id="seed-beyond-int64"),
    pytest.param({"prompt": [[1, 2]]}, 400, id="batched-prompts"),
    pytest.param([1, 2], 400, id="body-not-an-object"),
    pytest.param({"prompt": "x", "stream_options": 5}, 400, id="stream-options-wrong-type"),
]


def test_tiny_top_p_still_samples(server):
    response = httpx.post(f"{server}/v1/completions", timeout=60, json={
        "prompt": "x", "top_p": 1e-300, "temperature": 0.5, "max_tokens": 3,
        "ignore_eos": True})
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("body", "status"), BAD_INPUTS)
def test_bad_input_gets_an_openai_error(server, body, status):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{server}/v1/completions", timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_bad_chat_input(server):
    for body in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                 {"prompt": "x"}):
        response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400, body
        assert response.json()["error"]["message"]


def test_chat_on_the_embedded_model(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                              temperature=0,
                                              extra_body={"return_token_ids": True})
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.model_extra["prompt_token_ids"] == ByteTokenizer().apply_chat_template(
        messages)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == choice.message.content


# -- tenants and backpressure --------------------------------------------------------------
def test_auth_required_with_api_keys(strict_server):
    response = httpx.post(f"{strict_server}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    wrong = httpx.get(f"{strict_server}/v1/models", timeout=30,
                      headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


def test_tenants_never_share_cached_prefixes(strict_server):
    prompt = make_prompt(200, seed=4)

    def cached(key: str) -> int:
        response = httpx.post(f"{strict_server}/v1/completions", timeout=60,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                    "cache_salt": "ignored: the salt is the server's"})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("key-a") == 0
    assert cached("key-a2") > 0, "another key of the same tenant shares its prefix cache"
    assert cached("key-b") == 0, "another tenant never sees it"
    assert cached("key-b") > 0


def test_request_larger_than_the_pool_names_the_limit(strict_server):
    response = httpx.post(f"{strict_server}/v1/completions", timeout=30,
                          headers={"Authorization": "Bearer key-a"},
                          json={"prompt": "x", "max_tokens": 3000})
    assert response.status_code == 400
    assert "blocks" in response.json()["error"]["message"]


def test_overload_gets_429_never_500_and_accepted_requests_complete(strict_server):
    async def one(client, i):
        return await client.post(f"{strict_server}/v1/completions", json={
            "prompt": make_prompt(10, seed=200 + i), "max_tokens": 48, "ignore_eos": True,
            "temperature": 0})

    async def burst():
        headers = {"Authorization": "Bearer key-b"}
        async with httpx.AsyncClient(timeout=300, headers=headers) as client:
            return await asyncio.gather(*(one(client, i) for i in range(12)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) > 0 and statuses.count(200) >= 2, statuses
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] and r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 48
    assert metric(strict_server, "paged_kv_blocks", '{state="live"}') == 0


# -- shutdown ------------------------------------------------------------------------------
def test_sigterm_drains_running_requests_and_exits_0(tmp_path):
    with running_server(log=tmp_path / "log") as (proc, url):
        events: list = []
        first = threading.Event()

        def stream():
            body = {"prompt": "drain", "max_tokens": 60, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    events.append(line)
                    first.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first.wait(60), "no first chunk"
        proc.send_signal(signal.SIGTERM)
        client.join(120)
        assert proc.wait(timeout=60) == 0, (tmp_path / "log").read_text()
    parsed = sse_events(events)
    assert parsed[-1] == "DONE"
    assert parsed[-2]["choices"][0]["finish_reason"] == "length"


# -- a local Hugging Face checkpoint -------------------------------------------------------
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def _save_tiny_llama_with_tokenizer(path: Path) -> None:
    """A 2-layer Llama and a character-level tokenizer with a chat template (no download)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *chars])}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."),
                                                          behavior="isolated")
    model.decoder = tokenizers.decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, initializer_range=0.3,
                                      bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def test_chat_completions_on_a_local_checkpoint(tmp_path):
    _save_tiny_llama_with_tokenizer(tmp_path / "ckpt")
    from transformers import AutoTokenizer

    from paged_kv.engine.hf import HFCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<system>be brief\n<user>hi!\n<assistant>"
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    runner = HFCausalLM.from_pretrained(tmp_path / "ckpt")
    engine = Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=64)))
    want = engine.generate([prompt], SamplingParams(max_tokens=8))[0].outputs[0].token_ids
    with running_server("--model", str(tmp_path / "ckpt"), "--memory-mib", "2",
                        log=tmp_path / "log") as (_, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        response = client.chat.completions.create(
            model="ckpt", messages=messages, max_tokens=8, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = response.choices[0]
    assert choice.model_extra["prompt_token_ids"] == prompt
    assert choice.model_extra["token_ids"] == want
    assert choice.message.content == tokenizer.decode(want, skip_special_tokens=True)
