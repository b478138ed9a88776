"""latent_attention (MLA over latent pages): the Triton kernel against the torch reference on
CPU through the Triton interpreter, and the absorbed form against transformers' own DeepSeek
V2/V3 attention modules, which proves the absorption math, `absorbed_weights`' reading of
``kv_b_proj`` and the page layout (latent, then rotated rope key).

TRITON_INTERPRET is set before triton is imported, as in test_triton_kernels (which explains
the `interpreted_kernels` fixture for a triton imported earlier).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

triton = pytest.importorskip("triton")
interpreter = pytest.importorskip("triton.runtime.interpreter")
transformers = pytest.importorskip("transformers")

from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3  # noqa: E402

from paged_kv.kernels import latent  # noqa: E402
from paged_kv.kernels.quant import dequantize_reference, quantize_reference  # noqa: E402

from .conftest import TOLERANCES, cdiv  # noqa: E402


@pytest.fixture(autouse=True)
def interpreted_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the kernel (and the ``@jit`` library functions it calls) in the interpreter."""
    library = [(module, name) for module in (triton.language, triton.language.standard)
               for name, value in vars(module).items() if isinstance(value, triton.JITFunction)]
    # the kernel and the @jit helpers it calls (its own, and quant's `decode`)
    ours = [(latent, name) for name, value in vars(latent).items()
            if isinstance(value, triton.JITFunction | interpreter.InterpretedFunction)]
    for module, name in [*ours, *library]:
        function = getattr(module, name)
        if not isinstance(function, interpreter.InterpretedFunction):
            monkeypatch.setattr(module, name, interpreter.InterpretedFunction(function.fn))


def offsets(lengths: list[int]) -> torch.Tensor:
    """``[len + 1]`` int32 prefix sums (query_start_loc)."""
    result = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    result[1:] = torch.tensor(lengths).cumsum(0)
    return result


def block_tables_for(seq_lens: list[int], block_size: int) -> tuple[torch.Tensor, int]:
    """Shuffled block tables with a trailing padding column, and the pool's block count
    (3 spare blocks no table names, so reading one shows up as a wrong output)."""
    needed = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    ids = torch.randperm(num_blocks)[: sum(needed)].split(needed)
    tables = torch.zeros(len(seq_lens), max(needed, default=0) + 1, dtype=torch.int32)
    for row, row_ids in enumerate(ids):
        tables[row, : len(row_ids)] = row_ids
    return tables, num_blocks


def random_inputs(block_size: int, num_heads: int, latent_dim: int, rope_dim: int,
                  dtype: torch.dtype, seq_lens: list[int],
                  query_lens: list[int]) -> tuple[torch.Tensor, ...]:
    """(q_latent, q_rope, pages, block_tables, seq_lens, query_start_loc) of randn data;
    every slot holds randn, so slots past a sequence's end would change the output if read."""
    tables, num_blocks = block_tables_for(seq_lens, block_size)
    pages = torch.randn(num_blocks, block_size, latent_dim + rope_dim).to(dtype)
    q_latent = torch.randn(sum(query_lens), num_heads, latent_dim).to(dtype)
    q_rope = torch.randn(sum(query_lens), num_heads, rope_dim).to(dtype)
    return (q_latent, q_rope, pages, tables, torch.tensor(seq_lens, dtype=torch.int32),
            offsets(query_lens))


# (block_size, num_heads, R, P, dtype, seq_lens, query_lens): decodes, chunked prefills with
# several queries, a sequence with none, lengths on both sides of block boundaries, 20 heads
# for two head blocks, R = 24 for a padded latent tile
CASES = [
    pytest.param(4, 4, 16, 8, torch.float32, [1, 4, 5, 9], [1, 1, 1, 1], id="decode-bs4-h4-fp32"),
    pytest.param(16, 1, 16, 8, torch.bfloat16, [15, 17, 33], [1, 1, 1], id="decode-bs16-h1-bf16"),
    pytest.param(4, 3, 24, 8, torch.float32, [7, 12, 3], [3, 5, 3], id="prefill-bs4-h3-r24-fp32"),
    pytest.param(16, 20, 16, 8, torch.bfloat16, [17, 5, 20], [4, 0, 1],
                 id="mixed-bs16-h20-bf16"),
    pytest.param(4, 2, 16, 16, torch.bfloat16, [150, 90], [2, 1], id="multitile-bs4-h2-bf16"),
]


@pytest.mark.parametrize(("block_size", "num_heads", "latent_dim", "rope_dim", "dtype",
                          "seq_lens", "query_lens"), CASES)
def test_triton_matches_reference(block_size: int, num_heads: int, latent_dim: int,
                                  rope_dim: int, dtype: torch.dtype, seq_lens: list[int],
                                  query_lens: list[int]) -> None:
    torch.manual_seed(0)
    inputs = random_inputs(block_size, num_heads, latent_dim, rope_dim, dtype, seq_lens,
                           query_lens)
    expected = latent.latent_attention_reference(*inputs, scale=0.3)
    actual = latent.latent_attention_triton(*inputs, scale=0.3)
    assert actual.dtype == dtype and actual.shape == inputs[0].shape
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])


def test_reference_matches_explicit_softmax() -> None:
    """The reference, query by query against a dense softmax over the keys it may see."""
    torch.manual_seed(1)
    seq_lens, query_lens, latent_dim = [6, 9], [2, 3], 16
    q_latent, q_rope, pages, tables, lens, starts = random_inputs(
        4, 2, latent_dim, 8, torch.float32, seq_lens, query_lens)
    actual = latent.latent_attention_reference(q_latent, q_rope, pages, tables, lens, starts,
                                               scale=0.5)
    for seq, (seq_len, n) in enumerate(zip(seq_lens, query_lens, strict=True)):
        rows = torch.stack([pages[tables[seq, j // 4], j % 4] for j in range(seq_len)])
        for i in range(n):
            token, visible = int(starts[seq]) + i, seq_len - n + i + 1
            keys = rows[:visible]
            scores = (q_latent[token] @ keys[:, :latent_dim].T
                      + q_rope[token] @ keys[:, latent_dim:].T) * 0.5
            want = scores.softmax(-1) @ keys[:, :latent_dim]
            torch.testing.assert_close(actual[token], want, **TOLERANCES[torch.float32])


def pool_halves(pages: torch.Tensor, cache_dtype: torch.dtype | None = None,
                ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple | None]:
    """`pages`' rows as the engine keeps them: a pool layer ``[2, blocks, block_size, 1, D]``
    of one kv head, the row's first half in K and second in V (views), and with an 8-bit
    `cache_dtype` their codes and ``[blocks, block_size]`` scales (one per half)."""
    num_blocks, block_size, width = pages.shape
    halves = pages.view(num_blocks, block_size, 2, 1, width // 2).movedim(2, 0)
    if cache_dtype is None:
        pool = halves.contiguous()
        return (pool[0, :, :, 0], pool[1, :, :, 0]), None
    codes, scale = quantize_reference(halves.reshape(-1, 1, width // 2), cache_dtype)
    codes = codes.view(halves.shape)
    scale = scale.view(halves.shape[:-1])
    return (codes[0, :, :, 0], codes[1, :, :, 0]), (scale[0, :, :, 0], scale[1, :, :, 0])


@pytest.mark.parametrize(("latent_dim", "rope_dim", "dtype"), [
    pytest.param(16, 8, torch.float32, id="split-inside-latent-fp32"),
    pytest.param(24, 8, torch.bfloat16, id="split-inside-latent-bf16"),
    pytest.param(8, 24, torch.float32, id="split-inside-rope-fp32"),
])
def test_two_halves_read_as_one_row(latent_dim: int, rope_dim: int,
                                    dtype: torch.dtype) -> None:
    """The pool's K and V planes of one layer, each holding half a latent row (the split
    lands inside the latent, or inside the rope key): the reference gives what it gives on
    whole rows, and the kernel what the reference gives."""
    torch.manual_seed(2)
    q_latent, q_rope, pages, *rest = random_inputs(4, 20, latent_dim, rope_dim, dtype,
                                                   [17, 5, 9], [4, 1, 9])
    halves, _ = pool_halves(pages)
    whole = latent.latent_attention_reference(q_latent, q_rope, pages, *rest, scale=0.3)
    split = latent.latent_attention_reference(q_latent, q_rope, halves, *rest, scale=0.3)
    torch.testing.assert_close(split, whole, **TOLERANCES[dtype])
    actual = latent.latent_attention_triton(q_latent, q_rope, halves, *rest, scale=0.3)
    torch.testing.assert_close(actual, split, **TOLERANCES[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_halves_match_dequantized_rows(cache_dtype: torch.dtype,
                                            dtype: torch.dtype) -> None:
    """8-bit halves with a scale each: the kernel and the reference both attend over the
    dequantized rows (whole-row reference on them), and stay near the float rows."""
    torch.manual_seed(3)
    q_latent, q_rope, pages, *rest = random_inputs(4, 3, 16, 8, dtype, [9, 14], [2, 5])
    (first, second), scales = pool_halves(pages, cache_dtype)
    dequantized = torch.cat([dequantize_reference(codes, scale, torch.empty(codes.shape))
                             for codes, scale in zip((first, second), scales, strict=True)],
                            dim=-1).to(dtype)
    want = latent.latent_attention_reference(q_latent, q_rope, dequantized, *rest, scale=0.3)
    got = latent.latent_attention_reference(q_latent, q_rope, (first, second), *rest,
                                            scale=0.3, scales=scales)
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])
    actual = latent.latent_attention_triton(q_latent, q_rope, (first, second), *rest,
                                            scale=0.3, scales=scales)
    torch.testing.assert_close(actual, got, **TOLERANCES[dtype])
    exact = latent.latent_attention_reference(q_latent, q_rope, pages, *rest, scale=0.3)
    torch.testing.assert_close(got.float(), exact.float(), atol=0.15, rtol=0.1)


def test_8bit_halves_need_their_scales() -> None:
    q_latent, q_rope, pages, *rest = random_inputs(4, 2, 16, 8, torch.float32, [3], [1])
    halves, scales = pool_halves(pages, torch.int8)
    with pytest.raises(ValueError, match="scales"):
        latent.latent_attention(q_latent, q_rope, halves, *rest, scale=1.0)
    with pytest.raises(ValueError, match="scales"):
        latent.latent_attention(q_latent, q_rope, pages, *rest, scale=1.0, scales=scales)


def test_rejects_a_mismatched_page_width() -> None:
    q_latent, q_rope, pages, *rest = random_inputs(4, 2, 16, 8, torch.float32, [3], [1])
    with pytest.raises(ValueError, match="R \\+ P"):
        latent.latent_attention(q_latent, q_rope, pages[..., :-1], *rest, scale=1.0)


@pytest.mark.parametrize(("backend", "launcher"), [("triton", "latent_attention_triton"),
                                                   ("torch", "latent_attention_reference")])
def test_dispatch(monkeypatch: pytest.MonkeyPatch, backend: str, launcher: str) -> None:
    monkeypatch.setenv("PAGED_KV_BACKEND", backend)
    calls = []
    real = getattr(latent, launcher)
    monkeypatch.setattr(latent, launcher, lambda *a, **k: calls.append(1) or real(*a, **k))
    inputs = random_inputs(4, 2, 16, 8, torch.float32, [5], [2])
    out = latent.latent_attention(*inputs, scale=0.3)
    assert calls == [1]
    torch.testing.assert_close(out, latent.latent_attention_reference(*inputs, scale=0.3),
                               **TOLERANCES[torch.float32])


# ---- the absorbed form against transformers' modules -------------------------------------

def tiny_module(version: int, **overrides: object) -> tuple[torch.nn.Module, Callable]:
    """A random float32 DeepSeek V2/V3 attention module (eager) and ``positions ->
    position_embeddings`` from the model's own rotary embedding."""
    config_class = v3.DeepseekV3Config if version == 3 else v2.DeepseekV2Config
    # num_key_value_heads = heads: the modules expand K/V to every head before eager attention
    sizes = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                 qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None)
    config = config_class(**{**sizes, **overrides})
    config._attn_implementation = "eager"
    modeling = v3 if version == 3 else v2
    attention_class = modeling.DeepseekV3Attention if version == 3 else modeling.DeepseekV2Attention
    rotary_class = (modeling.DeepseekV3RotaryEmbedding if version == 3
                    else modeling.DeepseekV2RotaryEmbedding)
    module = attention_class(config, layer_idx=0).eval()
    for parameter in module.parameters():  # non-trivial norms and biases too
        torch.nn.init.normal_(parameter, std=0.3)
    rotary = rotary_class(config)
    return module, lambda positions: rotary(torch.zeros(1), positions[None])


def rotate(module: torch.nn.Module, q_rot: torch.Tensor, k_rot: torch.Tensor,
           position_embeddings: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's own rotary on ``q_rot [1, H, S, P]`` and ``k_rot [1, 1, S, P]``."""
    if isinstance(module, v2.DeepseekV2Attention):
        return v2.apply_rotary_emb(q_rot, k_rot, position_embeddings)
    cos, sin = position_embeddings
    if module.config.rope_interleave:
        return v3.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    return v3.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)


def mla_forward_reference(module: torch.nn.Module, prompts: list[torch.Tensor],
                          query_lens: list[int], position_embeddings: Callable,
                          block_size: int, kernel: Callable) -> torch.Tensor:
    """The module's attention output for each prompt's last `query_lens` tokens, computed in
    the absorbed form from latent pages: the whole prompts' latents and rotated rope keys
    are written to pages, the queries absorbed through W_UK, `kernel` attends, W_UV and
    ``o_proj`` follow. Returns ``[sum(query_lens), hidden]``."""
    num_heads, nope = module.num_heads, module.qk_nope_head_dim
    w_uk, w_uv = latent.absorbed_weights(module)
    seq_lens = [prompt.shape[0] for prompt in prompts]
    tables, num_blocks = block_tables_for(seq_lens, block_size)
    pages = torch.randn(num_blocks, block_size, module.kv_lora_rank + module.qk_rope_head_dim)
    q_latent, q_rope = [], []
    for seq, (hidden, n) in enumerate(zip(prompts, query_lens, strict=True)):
        length = hidden.shape[0]
        if module.q_lora_rank is None:
            q = module.q_proj(hidden)
        else:
            q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden)))
        q = q.view(length, num_heads, -1)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        kv = module.kv_a_proj_with_mqa(hidden)
        c = module.kv_a_layernorm(kv[:, : module.kv_lora_rank])
        k_pe = kv[None, None, :, module.kv_lora_rank:]
        q_pe, k_pe = rotate(module, q_pe.transpose(0, 1)[None], k_pe,
                            position_embeddings(torch.arange(length)))
        # the page layout: per token the normed latent, then the rotated rope key
        slots = tables[seq, torch.arange(length) // block_size].long() * block_size
        pages.view(-1, pages.shape[-1])[slots + torch.arange(length) % block_size] = torch.cat(
            [c, k_pe[0, 0]], dim=-1)
        q_latent.append(torch.einsum("thn,hnr->thr", q_nope, w_uk)[-n:])
        q_rope.append(q_pe[0].transpose(0, 1)[-n:])
    out_latent = kernel(torch.cat(q_latent), torch.cat(q_rope), pages, tables,
                        torch.tensor(seq_lens, dtype=torch.int32), offsets(query_lens),
                        module.scaling)
    out = torch.einsum("thr,hrv->thv", out_latent, w_uv).flatten(1)
    return module.o_proj(out)


def module_forward(module: torch.nn.Module, hidden: torch.Tensor,
                   position_embeddings: Callable) -> torch.Tensor:
    """The module's own causal forward (eager attention) over one prompt ``[S, hidden]``."""
    length = hidden.shape[0]
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    out, _ = module(hidden[None], attention_mask=mask,
                    position_embeddings=position_embeddings(torch.arange(length)))
    return out[0]


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0}
MODULES = [
    pytest.param(3, {}, id="v3-interleave"),
    pytest.param(3, {"rope_interleave": False, "q_lora_rank": 24}, id="v3-halves-qlora"),
    pytest.param(3, {"rope_parameters": YARN}, id="v3-yarn-mscale"),
    pytest.param(2, {"q_lora_rank": 24}, id="v2-complex-rope"),
]


@pytest.mark.parametrize(("version", "overrides"), MODULES)
@pytest.mark.parametrize("kernel", ["reference", "triton"])
@torch.no_grad()
def test_absorbed_form_matches_module(version: int, overrides: dict, kernel: str) -> None:
    torch.manual_seed(2)
    module, position_embeddings = tiny_module(version, **overrides)
    if overrides.get("rope_parameters"):
        assert module.scaling != module.qk_head_dim ** -0.5, "mscale should change the scale"
    prompts = [torch.randn(11, 64), torch.randn(6, 64)]
    query_lens = [11, 6] if kernel == "reference" else [3, 1]  # whole prompts; chunk + decode
    run = getattr(latent, f"latent_attention_{kernel}")
    actual = mla_forward_reference(module, prompts, query_lens, position_embeddings, 4, run)
    expected = torch.cat([module_forward(module, prompt, position_embeddings)[-n:]
                          for prompt, n in zip(prompts, query_lens, strict=True)])
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_absorbed_weights_layout() -> None:
    """``kv_b_proj(c)`` per head is ``[W_UK_h c, W_UV_h^T c]`` (k_nope first, then value)."""
    torch.manual_seed(3)
    module, _ = tiny_module(3)
    w_uk, w_uv = latent.absorbed_weights(module)
    assert w_uk.shape == (4, 16, 16) and w_uv.shape == (4, 16, 16)
    c = torch.randn(5, 16)
    expanded = module.kv_b_proj(c).view(5, 4, 32)
    torch.testing.assert_close(expanded[..., :16], torch.einsum("hnr,tr->thn", w_uk, c))
    torch.testing.assert_close(expanded[..., 16:], torch.einsum("tr,hrv->thv", c, w_uv))
