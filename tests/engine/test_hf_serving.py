"""The engine serves a Hugging Face checkpoint from a local directory on the paged cache."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.cli import main  # noqa: E402
from paged_kv.engine import Engine, SamplingParams  # noqa: E402
from paged_kv.engine.config import EngineConfig  # noqa: E402
from paged_kv.engine.hf import HFCausalLM  # noqa: E402

from ..conftest import tiny_llama_config  # noqa: E402

PROMPT_LENGTHS = [1, 15, 16, 17, 33]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama with seeded random weights, saved with save_pretrained (no download)."""
    torch.manual_seed(0)
    config = tiny_llama_config(max_position_embeddings=512)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _transformers_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=127)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("budget", [20, 512])
def test_engine_on_a_local_checkpoint_matches_transformers_generate(checkpoint, budget):
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    runner = HFCausalLM.from_pretrained(checkpoint)
    engine = Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=64),
                                         max_num_batched_tokens=budget))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10))
    for prompt, output in zip(prompts, outputs, strict=True):
        want = _transformers_greedy(reference, prompt, 10)
        assert output.outputs[0].token_ids == want, f"prompt of {len(prompt)} tokens"
    engine.cache.check()
    assert engine.cache.stats().num_live_blocks == 0


def test_hf_attention_runs_through_the_paged_cache(checkpoint):
    runner = HFCausalLM.from_pretrained(checkpoint)
    assert runner.model.config._attn_implementation == "paged_kv"
    engine = Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=64)))
    engine.add_request(list(range(40)), SamplingParams(max_tokens=2))
    engine.step()
    stats = engine.cache.stats()
    assert stats.num_live_tokens == 40 and stats.num_live_blocks == 3, "K/V live in the pages"


def test_demo_serves_a_local_checkpoint(checkpoint, capsys):
    assert main(["demo", "--model", str(checkpoint), "--num-requests", "4", "--memory-mib",
                 "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_requests"] == 4 and report["generated_tokens"] > 0
    assert "LlamaForCausalLM" in report["model"]


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        HFCausalLM.from_pretrained(tmp_path / "nope")
