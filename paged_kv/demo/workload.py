"""The demo's requests: seeded, long-tailed prompt and output lengths, a shared system
prompt and parallel sampling, as a serving workload has them."""

from __future__ import annotations

import numpy as np

from ..engine.sampling import SamplingParams


def make_workload(num_requests: int, *, vocab_size: int, seed: int = 0,
                  system_prompt_len: int = 64, mean_prompt_len: int = 160,
                  max_prompt_len: int = 1024, mean_output_len: int = 48,
                  max_output_len: int = 256) -> list[tuple[list[int], SamplingParams]]:
    """Seeded requests: long-tailed prompt and output lengths, half of the prompts behind one
    shared system prompt, every eighth request sampled ``n = 4`` times."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, system_prompt_len).tolist()
    requests = []
    for i in range(num_requests):
        # lognormal with sigma 1: median ~ 0.6 x mean, a long tail clipped at the maximum
        prompt_len = int(np.clip(rng.lognormal(np.log(mean_prompt_len) - 0.5, 1.0), 1,
                                 max_prompt_len))
        output_len = int(np.clip(rng.lognormal(np.log(mean_output_len) - 0.5, 1.0), 1,
                                 max_output_len))
        prompt = rng.integers(0, vocab_size, prompt_len).tolist()
        if i % 2 == 0:
            prompt = system + prompt
        n = 4 if i % 8 == 3 else 1
        params = SamplingParams(max_tokens=output_len, n=n, seed=seed * 1000 + i,
                                temperature=0.8 if n > 1 else 0.0, top_k=50)
        requests.append((prompt, params))
    return requests
