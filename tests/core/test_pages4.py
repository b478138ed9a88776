"""4-bit pages (int4, nvfp4) through the cache: accounting, refusals, round trips and
attention within bounds, bytes kept by copies, swaps and the tiers' block bytes, the key
rotation, and the engine's greedy tokens against float pages."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from paged_kv import CacheConfig, PagedKVCache
from paged_kv.kernels import quant4
from paged_kv.kernels.rotation import hadamard

from ..kernels.test_quant4 import bound
from .test_quantised import cache_with_sequences, with_outliers

FORMATS = ["int4", "nvfp4"]
CODES = {"int4": quant4.INT4, "nvfp4": quant4.NVFP4}
# relative error of attention on 4-bit pages vs SDPA on the original float32 K/V (randn
# K/V, head_dim 32), measured: int4 0.08-0.13, nvfp4 0.12-0.16; pinned about 2x
ATTENTION_BOUNDS = {"int4": 0.25, "nvfp4": 0.3}


@pytest.mark.parametrize(("fmt", "per_head"), [("int4", 64 + 8 * 2), ("nvfp4", 64 + 8)])
def test_bytes_per_token_formula(fmt: str, per_head: int) -> None:
    shape = dict(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.float16)
    config = CacheConfig(num_blocks=9, kv_cache_dtype=fmt, **shape)
    # head_dim / 2 bytes of codes + head_dim / 16 scales per (layer, K/V, head)
    assert config.bytes_per_token == 2 * 4 * 8 * per_head
    cache = PagedKVCache(config)
    pool = cache.pool
    assert pool.kv.shape[-1] == 64 and pool.kv.dtype == torch.uint8
    assert pool.scales.shape[-2:] == (8, 8) and pool.scales.dtype == config.scale_dtype
    assert pool.nbytes == config.total_bytes == cache.stats().total_bytes
    assert pool.block_nbytes == config.bytes_per_block
    budget = 256 << 20
    fp16 = CacheConfig.for_memory(budget, **shape)
    packed = CacheConfig.for_memory(budget, kv_cache_dtype=fmt, **shape)
    assert packed.total_bytes <= budget
    # 256 bytes of float16 per head against 80 (int4) or 72 (nvfp4)
    assert packed.num_blocks >= 0.99 * 256 / per_head * fp16.num_blocks


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [8, 24, 100])
def test_head_dim_not_a_multiple_of_16_is_refused_by_name(fmt: str, head_dim: int) -> None:
    with pytest.raises(ValueError, match=rf"head_dim.*multiple of 16, got {head_dim}"):
        CacheConfig(num_layers=1, num_kv_heads=1, head_dim=head_dim, kv_cache_dtype=fmt)


def test_nvfp4_refused_by_name_without_float8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='nvfp4' needs torch.float8_e4m3fn"):
        CacheConfig(num_layers=1, num_kv_heads=1, head_dim=16, kv_cache_dtype="nvfp4")
    CacheConfig(num_layers=1, num_kv_heads=1, head_dim=16, kv_cache_dtype="int4")


def test_rotation_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="kv_rotation"):
        CacheConfig(num_layers=1, num_kv_heads=1, head_dim=16, kv_rotation=1)


def test_hadamard_is_orthonormal_and_its_own_inverse() -> None:
    for head_dim in (16, 48, 128):
        matrix = hadamard(head_dim, torch.device("cpu"))
        torch.testing.assert_close(matrix @ matrix, torch.eye(head_dim))
        torch.testing.assert_close(matrix, matrix.T)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_cache_round_trip_within_bound(fmt: str, block_size: int) -> None:
    cache, keys, values = cache_with_sequences(fmt, [1, 7, 17, 33], block_size=block_size)
    padded = cache.gather(0, ["s0", "s1", "s2", "s3"])
    packed = cache.gather(0, ["s0", "s1", "s2", "s3"], packed=True)
    for name, originals, got, got_packed in zip("kv", (keys, values), padded, packed[:2],
                                                strict=True):
        original = torch.cat(originals)
        _, scales = quant4.quantize_reference(original, CODES[fmt])
        assert ((got_packed - original).abs() <= bound(fmt, original, scales)).all(), name
        for row, x in enumerate(originals):
            assert torch.equal(got[row, :x.shape[0]], got_packed[packed[2][row]:
                                                               packed[2][row + 1]])
            assert not got[row, x.shape[0]:].any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [6, 3, 1]], ids=["decode", "prefill"])
def test_attention_on_4bit_pages_vs_sdpa(fmt: str, query_lens: list[int]) -> None:
    seq_lens = [7, 23, 40]
    torch.manual_seed(0)
    cache, keys, values = cache_with_sequences(
        fmt, [n - q for n, q in zip(seq_lens, query_lens, strict=True)], outlier=1.0)
    batch = cache.prepare({f"s{i}": q for i, q in enumerate(query_lens)})
    for i, q in enumerate(query_lens):
        keys[i] = torch.cat([keys[i], with_outliers(q, 2, 32, 90 + i, outlier=1.0)])
        values[i] = torch.cat([values[i], with_outliers(q, 2, 32, 95 + i, outlier=1.0)])
    cache.write(0, torch.cat([k[-q:] for k, q in zip(keys, query_lens, strict=True)]),
                torch.cat([v[-q:] for v, q in zip(values, query_lens, strict=True)]), batch)
    query = torch.randn(batch.num_tokens, 4, 32)
    got = cache.attention(0, query, batch)
    start = 0
    for k, v, q in zip(keys, values, query_lens, strict=True):
        n = k.shape[0]
        mask = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]
        want = F.scaled_dot_product_attention(
            query[start:start + q].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, enable_gqa=True).transpose(0, 1)
        error = float((got[start:start + q] - want).norm() / want.norm())
        assert error < ATTENTION_BOUNDS[fmt], f"{fmt} {query_lens}: relative error {error:.4f}"
        start += q


def raw_pool(cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.pool.kv.clone(), cache.pool.scales.view(torch.uint8).clone()


@pytest.mark.parametrize("fmt", FORMATS)
def test_copies_forks_swaps_and_tier_bytes_keep_codes_and_scales(fmt: str) -> None:
    cache, _, _ = cache_with_sequences(fmt, [12, 9], num_host_blocks=8)
    k0, v0 = cache.gather(0, ["s0", "s1"])
    cache.fork("s0", "c")
    batch = cache.prepare({"c": 1})  # copy-on-write of the shared partial block
    cache.write(0, torch.full((1, 2, 32), 3.0), torch.full((1, 2, 32), -3.0), batch)
    k, _ = cache.gather(0, ["s0", "c"])
    assert torch.equal(k[0, :12], k0[0, :12]) and torch.equal(k[1, :12], k0[0, :12])
    torch.testing.assert_close(k[1, 12], torch.full((2, 32), 3.0), rtol=2.0 ** -3, atol=0)
    cache.swap_out("s1")
    batch = cache.prepare({"s0": 3})  # s1's freed blocks are reused and overwritten
    cache.write(0, torch.randn(3, 2, 32), torch.randn(3, 2, 32), batch)
    cache.swap_in("s1")
    k1, v1 = cache.gather(0, ["s1"])
    assert torch.equal(k1[0], k0[1, :9]) and torch.equal(v1[0], v0[1, :9]), "swap lost bytes"
    # the tiers' unit: a block's bytes out of one pool and into another
    blocks = np.array(cache.tables.blocks("s0")[:2])
    data = cache.pool.read_blocks(blocks)
    assert data.shape == (2, cache.config.bytes_per_block)
    other = PagedKVCache(cache.config)
    other.pool.write_blocks(np.array([3, 4]), data)
    for mine, theirs in zip(raw_pool(cache), raw_pool(other), strict=True):
        assert torch.equal(mine[:, :, blocks], theirs[:, :, [3, 4]])
    cache.check()


def test_rotation_leaves_float_attention_and_gathered_keys_as_they_were() -> None:
    seq_lens, query_lens = [9, 20], [3, 1]
    outputs, gathered = [], []
    for rotation in (False, True):
        torch.manual_seed(0)
        cache, _, _ = cache_with_sequences("auto", [n - q for n, q in
                                                       zip(seq_lens, query_lens, strict=True)],
                                              head_dim=48, outlier=1.0, kv_rotation=rotation)
        batch = cache.prepare({"s0": 3, "s1": 1})
        cache.write(0, torch.randn(4, 2, 48), torch.randn(4, 2, 48), batch)
        outputs.append(cache.attention(0, torch.randn(4, 4, 48), batch))
        gathered.append(cache.gather(0, ["s0", "s1"])[0])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gathered[1], gathered[0], rtol=1e-5, atol=1e-5)


def attention_error(fmt: str, rotation: bool, outlier: float) -> float:
    """Relative error of attention on `fmt` pages (rotated keys or not) against float pages,
    keys with two outlier channels (x `outlier`) at head_dim 64."""
    torch.manual_seed(1)
    key = torch.randn(40, 2, 64)
    key[..., [3, 37]] *= outlier
    value, query = torch.randn(40, 2, 64), 0.3 * torch.randn(40, 4, 64)
    outputs = []
    for fields in ({"kv_cache_dtype": fmt, "kv_rotation": rotation}, {}):
        cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=2, head_dim=64,
                                         block_size=8, num_blocks=16, dtype=torch.float32,
                                         **fields))
        cache.add_sequence("a")
        batch = cache.prepare({"a": 40})
        cache.write(0, key, value, batch)
        outputs.append(cache.attention(0, query, batch))
    return float((outputs[0] - outputs[1]).norm() / outputs[1].norm())


@pytest.mark.parametrize(("fmt", "outlier", "plain", "rotated"),
                         [("int4", 20.0, 0.136, 0.103), ("nvfp4", 20.0, 0.148, 0.141),
                          ("int4", 1.0, 0.088, 0.088)])
def test_rotation_against_outlier_channels(fmt: str, outlier: float, plain: float,
                                           rotated: float) -> None:
    """Two outlier channels x20: a group's scale follows its outlier and its other 15
    values lose their bits; rotated keys share the outliers' energy over the head. Measured
    errors pinned (+10%): the rotation cuts int4's by a quarter, nvfp4's a little (its
    e2m1 grid is already finer near 0), and costs nothing without outliers."""
    errors = [attention_error(fmt, rotation, outlier) for rotation in (False, True)]
    assert errors[0] <= 1.1 * plain and errors[1] <= 1.1 * rotated, errors
    if outlier > 1:
        assert errors[1] < errors[0], errors


# first greedy tokens equal to float pages' over the 16 prompts below, measured: int4 11,
# int4 + rotation 12, nvfp4 7, nvfp4 + rotation 8. The model's random weights leave most
# next-token logits nearly tied (a float32 top-2 gap of 0.01-0.2): 4-bit K/V flips some of
# those, never one with a clear gap (> 0.3)
AGREEMENT = {"int4": 10, "int4+rotation": 11, "nvfp4": 6, "nvfp4+rotation": 7}


def test_engine_greedy_on_4bit_pages_agrees_with_float_pages() -> None:
    from paged_kv.engine import Engine, SamplingParams, TinyLlama
    from paged_kv.engine.config import EngineConfig

    model = TinyLlama()
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 2048, int(n)).tolist() for n in rng.integers(4, 60, 16)]
    top = [model.forward_dense(torch.tensor(p))[-1].topk(2).values for p in prompts]
    clear = [i for i, values in enumerate(top) if float(values[0] - values[1]) > 0.3]
    assert len(clear) >= 4
    params = SamplingParams(max_tokens=4)
    first = {}
    for name in ("float", *AGREEMENT):
        fields = {} if name == "float" else {"kv_cache_dtype": name.split("+")[0],
                                             "kv_rotation": name.endswith("rotation")}
        engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=256,
                                                                     **fields)))
        first[name] = [o.outputs[0].token_ids[0] for o in engine.generate(prompts, params)]
        assert engine.pool_bytes_per_rank() == [engine.cache.config.total_bytes]
    for name, at_least in AGREEMENT.items():
        same = [a == b for a, b in zip(first["float"], first[name], strict=True)]
        print(f"{name}: first tokens equal to float pages' for {sum(same)}/16 prompts")
        assert sum(same) >= at_least, f"{name}: {sum(same)}/16"
        assert all(same[i] for i in clear), f"{name} flipped a clear choice"


def test_replace_keeps_the_format_checked() -> None:
    config = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=32, kv_cache_dtype="nvfp4")
    with pytest.raises(ValueError, match="head_dim"):
        dataclasses.replace(config, head_dim=40)


def test_demo_and_serve_take_4bit_pages(capsys: pytest.CaptureFixture) -> None:
    from paged_kv.cli import build_parser, main

    reports = {}
    for kv_cache_dtype in ("auto", "int4", "nvfp4"):
        assert main(["demo", "--num-requests", "4", "--memory-mib", "0.5", "--num-layers", "1",
                     "--hidden-size", "64", "--vocab-size", "256", "--json",
                     "--kv-cache-dtype", kv_cache_dtype]) == 0
        reports[kv_cache_dtype] = json.loads(capsys.readouterr().out)
        assert reports[kv_cache_dtype]["generated_tokens"] > 0
    # float32 pages at head_dim 32: 128 bytes per token-head against 16 + 4 (int4) or
    # 16 + 2 (nvfp4)
    assert reports["int4"]["bytes_per_token"] * 128 == reports["auto"]["bytes_per_token"] * 20
    assert reports["nvfp4"]["pool_tokens"] >= 6.5 * reports["auto"]["pool_tokens"]
    for kv_cache_dtype in ("int4", "nvfp4"):
        args = build_parser().parse_args(["serve", "--kv-cache-dtype", kv_cache_dtype])
        assert args.kv_cache_dtype == kv_cache_dtype
