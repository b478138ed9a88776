"""What users of the peers expect from the engine: log-probabilities, stopping at the
checkpoint's EOS, and a pool sized from the free memory."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from paged_kv.cli import main
from paged_kv.engine import Engine, SamplingParams, TinyLlamaConfig, sizing
from paged_kv.engine.config import EngineConfig
from paged_kv.engine.sampling import token_logprobs

from ..conftest import tiny_llama_config

CONFIG = TinyLlamaConfig(num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=96,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position=256)
PROMPT_LENGTHS = [1, 9, 17, 30]
MODEL_SEED = 3


def _prompts(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG.vocab_size, (n,), generator=generator).tolist()
            for n in PROMPT_LENGTHS]


def _dense_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), vocab]``: log_softmax of the dense model at each generated position."""
    logits = model.forward_dense(torch.tensor(prompt + output))
    return logits[len(prompt) - 1: len(prompt) - 1 + len(output)].float().log_softmax(-1)


def _check_against_dense(model, prompt, completion, num_top: int) -> None:
    dense = _dense_logprobs(model, prompt, completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs,
                                              strict=True)):
        where = f"prompt of {len(prompt)}, token {step}"
        top = torch.topk(dense[step], num_top).indices.tolist()
        chosen, *rest = entry
        assert chosen == token, f"{where}: the chosen token comes first"
        assert rest == [t for t in top if t != token], f"{where}: top-k order"
        want = torch.tensor([dense[step, t] for t in entry])
        torch.testing.assert_close(torch.tensor(list(entry.values())), want, atol=1e-4,
                                   rtol=1e-4, msg=where)
    assert completion.cumulative_logprob == pytest.approx(
        sum(entry[t] for t, entry in zip(completion.token_ids, completion.logprobs,
                                         strict=True)))


def test_greedy_logprobs_match_the_dense_model(model):
    engine = Engine(model, EngineConfig(
        cache=model.cache_config(num_blocks=64, block_size=8),
        max_num_batched_tokens=24))  # chunked prefill over several steps
    prompts = _prompts()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6, logprobs=3))
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        _check_against_dense(model, prompt, completion, 3)
        assert all(len(entry) == 3 for entry in completion.logprobs), "greedy: chosen is top-1"


def test_sampled_logprobs_are_of_the_model_distribution(model):
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64, block_size=8)))
    prompts = _prompts(1)
    params = SamplingParams(max_tokens=8, temperature=1.5, top_k=20, seed=7, n=2, logprobs=2)
    outputs = engine.generate(prompts, params)
    not_top = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        for completion in output.outputs:
            _check_against_dense(model, prompt, completion, 2)
            not_top += sum(len(entry) == 3 for entry in completion.logprobs)
    assert not_top > 0, "hot sampling should pick a token outside the top 2 at least once"


def test_no_logprobs_unless_asked(model):
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64)))
    [output] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert output.outputs[0].logprobs is None and output.outputs[0].cumulative_logprob is None
    [output] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, logprobs=0))
    assert [list(entry) for entry in output.outputs[0].logprobs] == \
        [[t] for t in output.outputs[0].token_ids]


@pytest.mark.parametrize("budget", [7, 512], ids=["chunked prefill", "one step"])
def test_prompt_logprobs_match_the_dense_model_and_skip_the_prefix_cache(model, budget):
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64, block_size=4),
                                        max_num_batched_tokens=budget))
    shared = _prompts()[3]
    engine.generate([[*shared, 1]], SamplingParams(max_tokens=1))  # caches shared's blocks
    prompt = [*shared, 5, 6]
    [output] = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2))
    assert output.prefix_hit_tokens == 0, "every prompt position must be computed"
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    dense = model.forward_dense(torch.tensor(prompt)).float().log_softmax(-1)
    for position, entry in enumerate(output.prompt_logprobs[1:]):
        chosen, *rest = entry
        assert chosen == prompt[position + 1], f"position {position}"
        top = torch.topk(dense[position], 2).indices.tolist()
        assert rest == [t for t in top if t != chosen], f"position {position}"
        torch.testing.assert_close(torch.tensor(list(entry.values())),
                                   dense[position, list(entry)], atol=1e-4, rtol=1e-4)
    assert output.outputs[0].logprobs is None
    [output] = engine.generate([prompt], SamplingParams(max_tokens=2))
    assert output.prompt_logprobs is None and output.prefix_hit_tokens > 0


def test_prompt_logprobs_are_recorded_once_when_a_preempted_prompt_is_recomputed(model):
    engine = Engine(model, EngineConfig(
        cache=model.cache_config(num_blocks=9, block_size=4),
        max_num_batched_tokens=8))  # 8 usable blocks: 32 token slots
    prompts = [_prompts(2)[2], _prompts(3)[2]]  # 17 tokens each, + 6 to generate
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6, prompt_logprobs=0))
    assert engine.scheduler.num_preemptions > 0, "the case needs a preemption"
    for prompt, output in zip(prompts, outputs, strict=True):
        assert [None if e is None else list(e) for e in output.prompt_logprobs] == \
            [None] + [[t] for t in prompt[1:]]


def test_token_logprobs_orders_the_top_and_caps_at_the_vocabulary():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0])
    out = token_logprobs(logits, token_id=2, num_top=10)
    assert list(out) == [2, 1, 3, 0]
    assert sum(math.exp(v) for v in out.values()) == pytest.approx(1.0)


@pytest.mark.parametrize("field, value", [("logprobs", -1), ("logprobs", True),
                                          ("logprobs", 1.5), ("prompt_logprobs", -2),
                                          ("ignore_eos", "yes")])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


# -- EOS --------------------------------------------------------------------------------------
def test_the_embedded_model_has_no_eos(model):
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64)))
    assert engine.eos_token_ids == frozenset()
    [output] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12))
    assert output.outputs[0].finish_reason == "length"


@pytest.fixture(scope="module")
def llama_greedy(tmp_path_factory):
    """A tiny seeded Llama, a prompt, and the 10 greedy tokens after it (no EOS set)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tiny_llama_config(eos_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = list(range(3, 20))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return model, prompt, ids[len(prompt):], tmp_path_factory.mktemp("eos")


def _first_new(tokens: list[int], start: int) -> int:
    """Index of the first token at or after `start` that does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def _save_with_eos(llama_greedy, name: str, eos) -> object:
    model, _, _, root = llama_greedy
    model.generation_config.eos_token_id = eos
    model.save_pretrained(root / name)
    return root / name


@pytest.mark.parametrize("several", [False, True], ids=["one eos id", "several eos ids"])
def test_engine_stops_at_the_checkpoint_eos_unless_ignored(llama_greedy, several):
    from paged_kv.engine.hf import HFCausalLM

    _, prompt, greedy, _ = llama_greedy
    stop = _first_new(greedy, 3)
    later = _first_new(greedy, stop + 1) if several else None
    eos = [greedy[later], greedy[stop]] if several else greedy[stop]
    runner = HFCausalLM.from_pretrained(_save_with_eos(llama_greedy, f"eos-{several}", eos))
    assert runner.eos_token_ids == (tuple(eos) if several else (eos,))
    engine = Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=32)))
    [output] = engine.generate([prompt], SamplingParams(max_tokens=10))
    assert output.outputs[0].token_ids == greedy[:stop + 1], "stops at, and keeps, the EOS"
    assert output.outputs[0].finish_reason == "stop"
    [output] = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    assert output.outputs[0].token_ids == greedy
    assert output.outputs[0].finish_reason == "length"


# -- sizing from free memory ------------------------------------------------------------------
def _fake_free(monkeypatch, free_bytes: int) -> list[torch.device]:
    seen = []

    def free_memory_bytes(device):
        seen.append(torch.device(device))
        return free_bytes

    monkeypatch.setattr(sizing, "free_memory_bytes", free_memory_bytes)
    return seen


def test_engine_sizes_the_pool_from_free_memory(model, monkeypatch, caplog):
    per_block = model.cache_config(num_blocks=2).bytes_per_block
    seen = _fake_free(monkeypatch, 100 * per_block + 5)
    with caplog.at_level(logging.INFO, logger="paged_kv.engine.sizing"):
        engine = Engine(model, EngineConfig(memory_fraction=0.5))
    assert seen == [torch.device("cpu")]
    assert engine.cache.config.num_blocks == 50
    assert "# CPU blocks: 49 of 16 tokens = 784 tokens" in caplog.text
    assert Engine(model).cache.config.num_blocks == 90, "default fraction 0.9"
    [output] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert len(output.outputs[0].token_ids) == 2


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, True, "0.9", float("nan")])
def test_bad_memory_fraction_is_named(model, monkeypatch, fraction):
    _fake_free(monkeypatch, 1 << 30)
    with pytest.raises(ValueError, match="memory_fraction"):
        Engine(model, EngineConfig(memory_fraction=fraction))


def test_memory_fraction_with_a_cache_config_or_too_little_memory_is_an_error(model,
                                                                               monkeypatch):
    with pytest.raises(ValueError, match="memory_fraction: give it or cache, not both"):
        Engine(model, EngineConfig(cache=model.cache_config(num_blocks=8), memory_fraction=0.5))
    _fake_free(monkeypatch, model.cache_config(num_blocks=2).bytes_per_block)
    with pytest.raises(ValueError, match=r"holds 1 blocks .* at least 2"):
        Engine(model, EngineConfig(memory_fraction=1.0))


def test_free_memory_reads_meminfo_and_rejects_other_devices(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000 kB\nMemFree: 100 kB\nMemAvailable:    2048 kB\n",
                       encoding="ascii")
    monkeypatch.setattr(sizing, "MEMINFO", meminfo)
    assert sizing.free_memory_bytes("cpu") == 2048 * 1024
    meminfo.write_text("MemTotal: 8000 kB\n", encoding="ascii")
    with pytest.raises(OSError, match="no MemAvailable"):
        sizing.free_memory_bytes("cpu")
    with pytest.raises(ValueError, match="'meta' device"):
        sizing.free_memory_bytes("meta")


def test_demo_memory_fraction_flag(monkeypatch, capsys):
    _fake_free(monkeypatch, 4 << 20)
    argv = ["demo", "--num-requests", "3", "--num-layers", "1", "--hidden-size", "64",
            "--num-heads", "4", "--head-dim", "16", "--vocab-size", "64", "--json"]
    assert main([*argv, "--memory-fraction", "0.25"]) == 0
    assert '"pool_bytes": 1048576' in capsys.readouterr().out  # a quarter of 4 MiB
    with pytest.raises(SystemExit):
        main([*argv, "--memory-fraction", "0.25", "--memory-mib", "1"])
    assert "not allowed with argument" in capsys.readouterr().err
