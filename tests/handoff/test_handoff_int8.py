"""The hand-off computes exactly what one engine computes from a prefix hit (issue 38), in
one process: the pages a prefill engine leases are, block by block, a one-engine run's
bytes (codes and scales), the decode engine loads those bytes, and its last block and
decode steps give the one engine's log-probabilities bit for bit -- for float and 8-bit
pages.

Why a prefix hit and not a cold run is the one engine to compare with: the decode engine
computes a prompt's last block alone (its blocks before arrive as pages), as one engine
does when the rest is cached, while a cold run computes the last block's K/V as the last
rows of one matmul over the whole prompt. CPU GEMM kernels round a row by how many rows
the call has and how they split among threads (MKL here: rows of a 1-3-row call, or of a
call split 2 ways, differ in their last bits from the same rows in a 30-row call), so
the last block's K/V differ in their last bits. Float pages keep that below 1e-5 in a
log-probability; 8-bit pages now and then round such a value (one within a last bit of
``x / scale = n + 1/2``) to the other code, one step ``scale = max|x| / 127`` apart,
which moves a log-probability by 2e-5 to 7e-3 (measured, default TinyLlama: a median of
3e-4 over random one-step changes in the last block; cold vs prefix hit, a code flipped
in 9 of 300 prompts of 1-3-token last blocks, by up to 1.9e-4). Which prompts it hits
depends on the CPU's kernels. That is the engine's arithmetic, with or without a
hand-off; the hand-off's is the prefix hit's, exactly, as these tests check. Steps run on
one thread, so the thread count, which would also move the last bits, is the same on
every side.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("prometheus_client")

from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.handoff import HandoffConfig
from paged_kv.handoff.params import parse_params
from paged_kv.keys import block_keys, encode_tokens, root_hash

from .test_handoff_engine import run

CONFIG = TinyLlamaConfig(num_layers=2, hidden_size=64, intermediate_size=64, vocab_size=100,
                         num_heads=4, head_dim=16)
BLOCK = 4
DTYPES = ["int8", "fp8_e4m3", "auto"]
# last blocks of 1, 2, 3 and 4 tokens, after 1 to 7 leased blocks
PROMPT_LENGTHS = [5, 6, 7, 8, 13, 30]
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


def engine(role: str, dtype: str) -> Engine:
    model = TinyLlama(CONFIG, seed=1)
    handoff = None if role == "both" else HandoffConfig(role, secret="s")
    return Engine(model, EngineConfig(
        cache=model.cache_config(num_blocks=64, block_size=BLOCK, kv_cache_dtype=dtype),
        num_threads=1, handoff=handoff))


def cached_pages(e: Engine, prompt: list[int]) -> np.ndarray:
    """``[n, block_nbytes]`` uint8: the bytes (every layer's K and V codes, then scales)
    of the blocks `e` caches for `prompt`'s first ``n = (len - 1) // BLOCK`` blocks, the
    ones a hand-off leases; AssertionError naming a block `e` lacks."""
    tokens = np.asarray(prompt, dtype=np.int64)
    ids = []
    for i, key in enumerate(block_keys(tokens, BLOCK, root_hash(None))[:(len(prompt) - 1)
                                                                        // BLOCK]):
        block = e.cache.allocator.lookup(key, encode_tokens(tokens[i * BLOCK:(i + 1) * BLOCK]))
        assert block is not None, f"prompt of {len(prompt)}: block {i} is not cached"
        ids.append(block)
    return e.cache.pool.read_blocks(np.array(ids, dtype=np.int64)).numpy()


@pytest.fixture(scope="module", params=DTYPES)
def served(request) -> tuple[str, list[dict]]:
    """Each prompt of `PROMPT_LENGTHS` served greedily through a prefill and a decode
    engine, and by one engine from a prefix hit (the prompt run first for one token, as
    the router's prefill does): per prompt, the three engines' pages and both answers."""
    dtype = request.param
    pre, dec, both = (engine(role, dtype) for role in ("prefill", "decode", "both"))
    results = []
    try:
        for length in PROMPT_LENGTHS:
            prompt = [(7 * i + length) % 100 for i in range(length)]
            params = run(pre, pre.add_request(prompt, ONE_TOKEN, handoff=parse_params(
                {"do_remote_decode": True}))).kv_transfer_params
            routed = run(dec, dec.add_request(prompt, GREEDY, handoff=parse_params(
                {**params, "do_remote_prefill": True})))
            run(both, both.add_request(prompt, ONE_TOKEN))
            direct = run(both, both.add_request(prompt, GREEDY))
            results.append({"length": length, "routed": routed, "direct": direct,
                            "pages": {name: cached_pages(e, prompt) for name, e in
                                      (("prefill", pre), ("decode", dec), ("both", both))}})
    finally:
        for e in (pre, dec, both):
            e.close()
    return dtype, results


def test_the_leased_pages_are_one_engines_bytes_and_land_unchanged(served):
    """Block by block, codes and scales: the prefill engine's pages equal one engine's
    (both computed the prompt in one step), and the decode engine holds those bytes."""
    dtype, results = served
    for result in results:
        pages = result["pages"]
        for name in ("prefill", "decode"):
            for block, (got, expected) in enumerate(zip(pages[name], pages["both"],
                                                        strict=True)):
                assert np.array_equal(got, expected), (
                    f"{dtype}, prompt of {result['length']}: block {block} of the {name} "
                    f"engine differs from one engine's in "
                    f"{int((got != expected).sum())} of {got.size} bytes")


def test_the_decode_engine_gives_a_prefix_hits_logprobs_exactly(served):
    """Tokens and every log-probability equal, not within a tolerance: the decode engine
    computes the last block against the same pages, in the same step shapes, as one
    engine whose prefix cache holds the prompt; and counts the leased tokens as the one
    engine counts its hit."""
    dtype, results = served
    for result in results:
        routed, direct = result["routed"].outputs[0], result["direct"].outputs[0]
        case = f"{dtype}, prompt of {result['length']}"
        assert routed.token_ids == direct.token_ids, case
        assert routed.logprobs == direct.logprobs, (case, routed.logprobs, direct.logprobs)
        cached = (result["length"] - 1) // BLOCK * BLOCK
        assert result["routed"].cached_by_source.get("peer") == cached, case
        assert result["direct"].prefix_hit_tokens == cached, case
