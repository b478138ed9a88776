"""Fixtures of the serving tests: each test module's model, and seeded prompts."""

from __future__ import annotations

import pytest
import torch

from paged_kv.engine import TinyLlama


@pytest.fixture(scope="module")
def model(request) -> TinyLlama:
    """The test module's `TinyLlama`, built once per module from its ``CONFIG`` and its
    ``MODEL_SEED`` (0 unless it sets one): float32 weights, as ``cache_config()`` is."""
    module = request.module
    return TinyLlama(module.CONFIG, seed=getattr(module, "MODEL_SEED", 0))


def prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    """`length` token ids below `vocab_size`, drawn from a generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def save_random_checkpoints(tmp_path_factory, configs: dict[str, object]) -> dict[str, object]:
    """``{name: folder}``: each transformers config's model, seeded with 0, saved in a
    temporary folder of its own (a name's spaces become underscores)."""
    import transformers

    paths = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        paths[name] = tmp_path_factory.mktemp(name.replace(" ", "_"))
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(paths[name])
    return paths


def generate_greedy(paths: dict[str, object], prompts: dict[str, list[int]], max_tokens: int,
                    **load: object) -> dict[tuple[str, str], list[int]]:
    """transformers' own greedy tokens ``{(name, prompt name): tokens}`` of each checkpoint
    in `paths` (float32, loaded with `load`, e.g. ``attn_implementation="eager"``)."""
    import transformers

    found = {}
    for name, path in paths.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, **load).eval()
        for prompt_name, ids in prompts.items():
            ids = torch.tensor([ids])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
            found[name, prompt_name] = out[0, ids.shape[1]:].tolist()
    return found
