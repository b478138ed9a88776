"""Every Triton launcher against its torch reference, on CPU through the Triton interpreter.

``@triton.jit`` picks the interpreter when a function is defined, so TRITON_INTERPRET is set
before anything here imports triton or paged_kv (on machines without CUDA only, so that GPU
kernels defined later in a GPU test session stay compiled). If triton was imported without it
(another test module imported paged_kv first, or a CUDA machine), the `interpreted_kernels`
fixture rewraps the kernels for the interpreter, so these CPU tests run either way.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

triton = pytest.importorskip("triton")
interpreter = pytest.importorskip("triton.runtime.interpreter")

from paged_kv.kernels import (  # noqa: E402
    attention,
    attention_prefill,
    attention_tile,
    backend,
    copy,
    gather,
    gather_packed,
    write,
)

from .conftest import TOLERANCES, cdiv  # noqa: E402

KERNELS = [(write, "_write_kv_kernel"), (gather, "_gather_kv_kernel"),
           (copy, "_copy_blocks_kernel"), (attention, "_paged_attention_kernel"),
           (attention_prefill, "_prefill_attention_kernel"),
           # the tile parts both attention kernels call
           (attention_tile, "load_kv_tile"), (attention_tile, "soft_cap"),
           (attention_tile, "online_step")]

# (block_size, num_kv_heads, head_dim, dtype) for the data-movement kernels
LAYOUTS = [
    pytest.param(16, 2, 8, torch.float32, id="bs16-h2-d8-fp32"),
    pytest.param(5, 3, 24, torch.float16, id="bs5-h3-d24-fp16"),
    pytest.param(16, 1, 64, torch.bfloat16, id="bs16-h1-d64-bf16"),
    pytest.param(5, 2, 64, torch.bfloat16, id="bs5-h2-d64-bf16"),
    pytest.param(1, 2, 24, torch.float32, id="bs1-h2-d24-fp32"),
]
BATCHES = [
    pytest.param([1, 15, 16, 17, 33], id="ragged"),
    pytest.param([33, 0, 2], id="with-empty"),
]
DECODE = [1, 15, 16, 17, 33]
# (block_size, num_q_heads, num_kv_heads, head_dim, dtype, seq_lens, query_lens)
ATTENTION_CASES = [
    pytest.param(16, 4, 2, 64, torch.float32, DECODE, [1] * 5, id="decode-gqa-fp32"),
    pytest.param(5, 4, 2, 24, torch.float16, DECODE, [1] * 5, id="decode-bs5-d24-fp16"),
    pytest.param(16, 2, 2, 8, torch.bfloat16, DECODE, [1] * 5, id="decode-mha-d8-bf16"),
    pytest.param(16, 8, 1, 64, torch.bfloat16, [100, 70], [1, 1], id="decode-mqa-multitile-bf16"),
    pytest.param(5, 4, 2, 24, torch.bfloat16, [17, 33, 16], [17, 8, 1], id="prefill-mixed-bf16"),
    pytest.param(16, 4, 2, 64, torch.float16, [33, 100, 1], [10, 3, 1], id="prefill-long-fp16"),
    pytest.param(16, 2, 1, 8, torch.float32, [15, 20, 9], [4, 0, 9], id="prefill-empty-fp32"),
]


@pytest.fixture(autouse=True)
def interpreted_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every kernel in the interpreter, even if triton was imported before the env var.

    Then the kernels and the ``@jit`` library functions they call (``tl.sum``, ``tl.zeros``)
    were made for a GPU; rewrapping them for the test keeps these CPU tests running.
    """
    library = [(module, name) for module in (triton.language, triton.language.standard)
               for name, value in vars(module).items() if isinstance(value, triton.JITFunction)]
    for module, name in [*KERNELS, *library]:
        function = getattr(module, name)
        if not isinstance(function, interpreter.InterpretedFunction):
            monkeypatch.setattr(module, name, interpreter.InterpretedFunction(function.fn))


def make_block_tables(seq_lens: list[int], block_size: int,
                      num_spare: int = 3) -> tuple[torch.Tensor, int]:
    """Random non-contiguous tables (randperm) with a padding column of 0s, and num_blocks."""
    needed = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(needed) + num_spare  # spare blocks are never referenced
    block_ids = torch.randperm(num_blocks)[: sum(needed)].split(needed)
    block_tables = torch.zeros(len(seq_lens), max(needed, default=0) + 1, dtype=torch.int32)
    for row, ids in enumerate(block_ids):
        block_tables[row, : len(ids)] = ids
    return block_tables, num_blocks


def random_pages(num_blocks: int, block_size: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V pages filled with randn, so untouched slots are checked too."""
    pool = torch.randn(2, num_blocks, block_size, num_heads, head_dim).to(dtype)
    return pool[0], pool[1]


def offsets(lengths: list[int]) -> torch.Tensor:
    """[len + 1] int32 prefix sums (cu_seqlens / query_start_loc)."""
    result = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    result[1:] = torch.tensor(lengths).cumsum(0)
    return result


@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize("seq_lens", BATCHES)
def test_write_kv_matches_reference(block_size: int, num_heads: int, head_dim: int,
                                    dtype: torch.dtype, seq_lens: list[int]) -> None:
    torch.manual_seed(0)
    block_tables, num_blocks = make_block_tables(seq_lens, block_size)
    key_cache, value_cache = random_pages(num_blocks, block_size, num_heads, head_dim, dtype)
    slots = torch.cat([block_tables[b, torch.arange(n) // block_size].long() * block_size
                       + torch.arange(n) % block_size for b, n in enumerate(seq_lens)])
    slots = torch.cat([slots, torch.full((3,), -1)])[torch.randperm(slots.shape[0] + 3)]
    key = torch.randn(slots.shape[0], num_heads, head_dim).to(dtype)
    # value is a strided view, as when K and V are slices of one projection
    value = torch.randn(slots.shape[0], 3 * num_heads, head_dim).to(dtype)[:, num_heads:-num_heads]
    expected = key_cache.clone(), value_cache.clone()
    write.write_kv_reference(key, value, *expected, slots)
    actual = key_cache.clone(), value_cache.clone()
    write.write_kv_triton(key, value, *actual, slots)
    for name, got, want, before in zip("kv", actual, expected, (key_cache, value_cache),
                                       strict=True):
        assert torch.equal(got, want), f"{name}_cache differs from the reference"
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[slots[slots >= 0]] = False
        assert torch.equal(got.flatten(0, 1)[untouched], before.flatten(0, 1)[untouched]), (
            f"{name}_cache: a slot outside slot_mapping changed")


@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize("seq_lens", BATCHES)
@pytest.mark.parametrize("pad_to", [None, 40])
def test_gather_kv_matches_reference(block_size: int, num_heads: int, head_dim: int,
                                     dtype: torch.dtype, seq_lens: list[int],
                                     pad_to: int | None) -> None:
    torch.manual_seed(1)
    block_tables, num_blocks = make_block_tables(seq_lens, block_size)
    caches = random_pages(num_blocks, block_size, num_heads, head_dim, dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    expected = gather.gather_kv_reference(*caches, block_tables, seq_lens_t, pad_to)
    out = None
    if pad_to is not None:  # a preallocated output full of noise must come back zero-padded
        shape = (len(seq_lens), pad_to, num_heads, head_dim)
        out = (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    actual = gather.gather_kv_triton(*caches, block_tables, seq_lens_t, pad_to, out)
    assert out is None or all(a is o for a, o in zip(actual, out, strict=True))
    for name, got, want in zip("kv", actual, expected, strict=True):
        assert torch.equal(got, want), f"padded {name} differs from the reference"


@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize("seq_lens", BATCHES)
def test_gather_kv_packed_matches_reference(block_size: int, num_heads: int, head_dim: int,
                                            dtype: torch.dtype, seq_lens: list[int]) -> None:
    torch.manual_seed(2)
    block_tables, num_blocks = make_block_tables(seq_lens, block_size)
    caches = random_pages(num_blocks, block_size, num_heads, head_dim, dtype)
    args = (block_tables, torch.tensor(seq_lens, dtype=torch.int32), offsets(seq_lens))
    expected = gather_packed.gather_kv_packed_reference(*caches, *args)
    shape = (sum(seq_lens), num_heads, head_dim)
    out = (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    actual = gather_packed.gather_kv_packed_triton(*caches, *args, out=out)
    for name, got, want in zip("kv", actual, expected, strict=True):
        assert torch.equal(got, want), f"packed {name} differs from the reference"


@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
def test_copy_blocks_matches_reference(block_size: int, num_heads: int, head_dim: int,
                                       dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    num_blocks, num_copies = 9, 3
    pool = torch.randn(2, 2, num_blocks, block_size, num_heads, head_dim).to(dtype)
    src, dst = torch.randperm(num_blocks)[: 2 * num_copies].split(num_copies)
    expected = pool.clone()
    copy.copy_blocks_reference(expected, src, dst)
    actual = pool.clone()
    copy.copy_blocks_triton(actual, src, dst)
    assert torch.equal(actual, expected), "pool differs from the reference"
    assert torch.equal(actual[:, :, dst], pool[:, :, src]), "dst blocks are not copies of src"
    untouched = torch.ones(num_blocks, dtype=torch.bool)
    untouched[dst] = False
    assert torch.equal(actual[:, :, untouched], pool[:, :, untouched]), "a non-dst block changed"


def test_copy_blocks_rejects_a_strided_pool() -> None:
    pool = torch.randn(1, 2, 4, 2, 3, 16)[..., :8]
    with pytest.raises(ValueError, match="contiguous"):
        copy.copy_blocks_triton(pool, torch.tensor([0]), torch.tensor([1]))


def attention_inputs(block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, seq_lens: list[int],
                     query_lens: list[int]) -> tuple[torch.Tensor, ...]:
    block_tables, num_blocks = make_block_tables(seq_lens, block_size)
    key_cache, value_cache = random_pages(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    query = torch.randn(sum(query_lens), num_q_heads, head_dim).to(dtype)
    return (query, key_cache, value_cache, block_tables,
            torch.tensor(seq_lens, dtype=torch.int32), offsets(query_lens))


@pytest.mark.parametrize(("block_size", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
                          "seq_lens", "query_lens"), ATTENTION_CASES)
def test_paged_attention_matches_reference(block_size: int, num_q_heads: int,
                                           num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                                           seq_lens: list[int], query_lens: list[int]) -> None:
    torch.manual_seed(4)
    inputs = attention_inputs(block_size, num_q_heads, num_kv_heads, head_dim, dtype,
                              seq_lens, query_lens)
    expected = attention.paged_attention_reference(*inputs)
    actual = attention.paged_attention_triton(*inputs)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype],
                               msg=lambda m: f"seq_lens {seq_lens}, query_lens {query_lens}: {m}")


def test_paged_attention_scale_and_out() -> None:
    torch.manual_seed(5)
    inputs = attention_inputs(5, 4, 2, 24, torch.float32, [7, 12], [3, 1])
    expected = attention.paged_attention_reference(*inputs, scale=0.3)
    out = torch.randn_like(inputs[0])
    actual = attention.paged_attention_triton(*inputs, scale=0.3, out=out)
    assert actual is out
    torch.testing.assert_close(actual, expected, **TOLERANCES[torch.float32])


def public_calls() -> list[tuple[str, object, object, tuple]]:
    """(launcher name, module, public op, args) for each dispatched op, on small CPU inputs."""
    torch.manual_seed(6)
    seq_lens = [3, 9]
    block_tables, num_blocks = make_block_tables(seq_lens, 4)
    key_cache, value_cache = random_pages(num_blocks, 4, 2, 24, torch.float16)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    key = torch.randn(2, 2, 24).to(torch.float16)
    pool = torch.randn(1, 2, num_blocks, 4, 2, 24).to(torch.float16)
    query = torch.randn(2, 4, 24).to(torch.float16)
    return [
        ("write_kv_triton", write, write.write_kv,
         (key, -key, key_cache, value_cache, torch.tensor([5, -1]))),
        ("gather_kv_triton", gather, gather.gather_kv,
         (key_cache, value_cache, block_tables, seq_lens_t)),
        ("gather_kv_packed_triton", gather_packed, gather_packed.gather_kv_packed,
         (key_cache, value_cache, block_tables, seq_lens_t, offsets(seq_lens))),
        ("copy_blocks_triton", copy, copy.copy_blocks,
         (pool, torch.tensor([0]), torch.tensor([2]))),
        ("paged_attention_triton", attention, attention.paged_attention,
         (query, key_cache, value_cache, block_tables, seq_lens_t, offsets([1, 1]))),
    ]


def assert_same(got: object, want: object, name: str) -> None:
    """Equal data (attention output: close) for a result or argument, tensors or tuples."""
    if isinstance(got, tuple):
        for g, w in zip(got, want, strict=True):
            assert_same(g, w, name)
    elif name == "paged_attention_triton":
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float16], msg=name)
    elif isinstance(got, torch.Tensor):
        assert torch.equal(got, want), f"{name}: differs from the torch backend"


def run_public_calls(monkeypatch: pytest.MonkeyPatch, *, is_triton_expected: bool) -> None:
    """Run each public op, count launcher calls, compare results and mutated args with torch."""
    for (name, module, op, args), (_, _, _, torch_args) in zip(public_calls(), public_calls(),
                                                               strict=True):
        launcher, calls = getattr(module, name), []

        def spy(*a: object, _launcher=launcher, _calls=calls) -> object:
            _calls.append(a)
            return _launcher(*a)

        monkeypatch.setattr(module, name, spy)
        with monkeypatch.context() as torch_only:
            torch_only.setenv("PAGED_KV_BACKEND", "torch")
            expected = op(*torch_args)
        actual = op(*args)
        assert len(calls) == int(is_triton_expected), f"{name}: called {len(calls)} times"
        assert_same((actual, *args), (expected, *torch_args), name)


def test_forced_triton_backend_runs_the_kernels_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGED_KV_BACKEND", "triton")
    run_public_calls(monkeypatch, is_triton_expected=True)


def test_missing_triton_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGED_KV_BACKEND", "triton")
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    run_public_calls(monkeypatch, is_triton_expected=False)


def test_cpu_tensors_default_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGED_KV_BACKEND", raising=False)
    run_public_calls(monkeypatch, is_triton_expected=False)
