"""The recurrent layers' Triton kernels (paged_kv.kernels.recurrent_triton, _scan) against the
torch references (paged_kv.kernels.recurrent), on CPU through the Triton interpreter.

TRITON_INTERPRET is set before triton is imported, and the kernels are rewrapped for the
interpreter if it was imported earlier, as `test_triton_kernels` does. Shapes stay tiny (the
interpreter runs each op in numpy) but the cases many: ragged batches with empty sequences,
non-zero initial states, emissions at first / middle / last tokens (repeated, unsorted),
float32 and bfloat16 inputs, GQA ratios, groups, time-step options, and blocks of state rows
lowered below the layer's width so that several programs share a sequence.

Tolerances: `conftest.TOLERANCES` of the inputs' dtype for the outputs; float32 states (the
recurrences keep float32 whatever the inputs) to the float32 table. Observed: float32
outputs and states within ~2e-6; bfloat16 states within ~1e-6 (the time step is rounded to
bfloat16 exactly as torch rounds it) and outputs one bfloat16 ulp apart (the interpreter's
float32 -> bfloat16 cast truncates where torch rounds).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch.nn.functional as F

triton = pytest.importorskip("triton")
interpreter = pytest.importorskip("triton.runtime.interpreter")

from paged_kv.kernels import recurrent, recurrent_triton, recurrent_triton_scan  # noqa: E402

from .conftest import TOLERANCES  # noqa: E402

KERNELS = [(recurrent_triton, name) for name in ("_stream", "_causal_conv1d_kernel",
                                                  "_gated_delta_rule_kernel")] + \
    [(recurrent_triton_scan, name) for name in ("_rounded", "_time_step", "_ssd_kernel",
                                                 "_selective_scan_kernel")]
BATCHES = [
    pytest.param([0, 1, 5, 17], id="ragged"),
    pytest.param([5, 0, 1, 0, 17], id="empties-between"),
]
FLOAT32 = TOLERANCES[torch.float32]


@pytest.fixture(autouse=True)
def interpreted_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every kernel and helper in the interpreter, even if triton was imported first."""
    library = [(module, name) for module in (triton.language, triton.language.standard)
               for name, value in vars(module).items() if isinstance(value, triton.JITFunction)]
    for module, name in [*KERNELS, *library]:
        function = getattr(module, name)
        if not isinstance(function, interpreter.InterpretedFunction):
            monkeypatch.setattr(module, name, interpreter.InterpretedFunction(function.fn))


@pytest.fixture
def narrow_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of state rows narrower than the test layers: several programs per sequence,
    and a partial last block (masked lanes)."""
    monkeypatch.setattr(recurrent_triton, "MAX_BLOCK_C", 4)
    monkeypatch.setattr(recurrent_triton, "MAX_BLOCK_V", 4)
    monkeypatch.setattr(recurrent_triton_scan, "MAX_BLOCK_ROWS", 2)


def cu_of(lengths: list[int]) -> torch.Tensor:
    return F.pad(torch.tensor(lengths, dtype=torch.int64).cumsum(0), (1, 0))


def emissions(lengths: list[int]) -> torch.Tensor:
    """Each non-empty sequence's first, middle and last token, one repeated, out of order."""
    cu, picked = cu_of(lengths), []
    for b, length in enumerate(lengths):
        if length:
            start = int(cu[b])
            picked += sorted({start, start + length // 2, start + length - 1})
    picked.append(picked[len(picked) // 2])
    return torch.tensor(picked[::-1], dtype=torch.int64)


def view_of(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Random ``shape`` as a strided view (every other column of a wider tensor), as a
    projection's split hands the kernels."""
    wide = torch.randn(*shape[:-1], 2 * shape[-1]).to(dtype)
    return wide[..., ::2]


def compare(reference, triton_fn, args: dict, dtype: torch.dtype, lengths: list[int],
            state_tolerance: dict | None = None) -> None:
    """Both functions on `args` with emissions; outputs to `dtype`'s tolerance, states to
    `state_tolerance` (float32's by default), dtypes and shapes equal."""
    args = {**args, "cu_seqlens": cu_of(lengths), "emit_at": emissions(lengths)}
    want, got = reference(**args), triton_fn(**args)
    assert got[2].shape[0] == args["emit_at"].numel()
    names = ("out", "final", "emitted")
    for name, tolerance, expected, actual in zip(
            names, (TOLERANCES[dtype], state_tolerance or FLOAT32, state_tolerance or FLOAT32),
            want, got, strict=True):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
        torch.testing.assert_close(actual, expected, **tolerance, msg=lambda m, n=name: f"{n}: {m}")


# -- causal_conv1d ---------------------------------------------------------------------------

@pytest.mark.parametrize("lengths", BATCHES)
@pytest.mark.parametrize(("dtype", "window", "activation", "has_bias"), [
    pytest.param(torch.float32, 3, "silu", True, id="fp32-w3-silu"),
    pytest.param(torch.float32, 4, None, False, id="fp32-w4-lfm2"),
    pytest.param(torch.bfloat16, 3, "swish", True, id="bf16-w3-swish"),
    pytest.param(torch.bfloat16, 4, "silu", False, id="bf16-w4-silu"),
])
def test_causal_conv1d_matches_reference(torch_backend, narrow_blocks, lengths, dtype, window,
                                         activation, has_bias):
    channels, width = 6, 4
    args = {"x": view_of(sum(lengths), channels, dtype=dtype),
            "weight": torch.randn(channels, width).to(dtype),
            "bias": torch.randn(channels).to(dtype) if has_bias else None,
            # the window in the inputs' dtype, as the models keep it
            "conv_state": torch.randn(len(lengths), channels, window).to(dtype),
            "activation": activation}
    # the window holds copies of inputs: exact in any dtype
    compare(recurrent.causal_conv1d, recurrent_triton.triton_causal_conv1d, args, dtype,
            lengths, state_tolerance={"atol": 0.0, "rtol": 0.0})


# -- gated_delta_rule -----------------------------------------------------------------------

@pytest.mark.parametrize("lengths", BATCHES)
@pytest.mark.parametrize(("dtype", "key_heads", "heads", "l2norm", "scale"), [
    pytest.param(torch.float32, 2, 2, True, None, id="fp32-mha"),
    pytest.param(torch.float32, 1, 4, True, None, id="fp32-gqa4"),
    pytest.param(torch.float32, 2, 4, False, 0.3, id="fp32-gqa2-raw-scaled"),
    pytest.param(torch.bfloat16, 2, 4, True, None, id="bf16-gqa2"),
    pytest.param(torch.bfloat16, 1, 2, True, 0.5, id="bf16-gqa2-scaled"),
])
def test_gated_delta_rule_matches_reference(torch_backend, narrow_blocks, lengths, dtype,
                                            key_heads, heads, l2norm, scale):
    tokens, key_dim, value_dim = sum(lengths), 8, 6
    args = {"q": view_of(tokens, key_heads, key_dim, dtype=dtype),
            "k": view_of(tokens, key_heads, key_dim, dtype=dtype),
            "v": view_of(tokens, heads, value_dim, dtype=dtype),
            "g": -F.softplus(torch.randn(tokens, heads)).to(dtype),
            "beta": torch.sigmoid(torch.randn(tokens, heads)).to(dtype),
            "state": torch.randn(len(lengths), heads, key_dim, value_dim),
            "use_qk_l2norm": l2norm, "scale": scale}
    compare(recurrent.gated_delta_rule, recurrent_triton.triton_gated_delta_rule, args, dtype,
            lengths)


# -- ssd --------------------------------------------------------------------------------------

SSD_OPTIONS = {
    "bias-softplus": {"dt_bias": True},
    "limit": {"dt_bias": True, "dt_limit": (0.05, 0.8)},
    "no-bias-no-D": {"D": None},
    "raw-dt": {"dt_softplus": False},
}


@pytest.mark.parametrize("lengths", BATCHES)
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("option", list(SSD_OPTIONS))
def test_ssd_matches_reference(torch_backend, narrow_blocks, lengths, groups, dtype, option):
    tokens, heads, head_dim, state_dim = sum(lengths), 4, 3, 5
    chosen = SSD_OPTIONS[option]
    dt = torch.randn(tokens, heads)
    if chosen.get("dt_softplus") is False:
        dt = F.softplus(dt)  # a raw time step must already be positive
    args = {"x": view_of(tokens, heads, head_dim, dtype=dtype), "dt": dt.to(dtype),
            "A": -torch.exp(torch.randn(heads) * 0.5),
            "B": view_of(tokens, groups, state_dim, dtype=dtype),
            "C": view_of(tokens, groups, state_dim, dtype=dtype),
            "D": torch.randn(heads) if "D" not in chosen else None,
            "state": torch.randn(len(lengths), heads, head_dim, state_dim),
            "dt_bias": torch.randn(heads) if chosen.get("dt_bias") else None,
            "dt_softplus": chosen.get("dt_softplus", True),
            "dt_limit": chosen.get("dt_limit", (0.0, float("inf")))}
    compare(recurrent.ssd, recurrent_triton_scan.triton_ssd, args, dtype, lengths)


# -- selective_scan ---------------------------------------------------------------------------

@pytest.mark.parametrize("lengths", BATCHES)
@pytest.mark.parametrize(("dtype", "has_bias", "softplus", "has_dz"), [
    pytest.param(torch.float32, True, True, True, id="fp32-bias-gate"),
    pytest.param(torch.float32, False, True, False, id="fp32-no-D-no-gate"),
    pytest.param(torch.float32, False, False, True, id="fp32-raw-delta"),
    pytest.param(torch.bfloat16, True, True, True, id="bf16-bias-gate"),
    pytest.param(torch.bfloat16, False, True, True, id="bf16-gate"),
])
def test_selective_scan_matches_reference(torch_backend, narrow_blocks, lengths, dtype,
                                          has_bias, softplus, has_dz):
    tokens, channels, state_dim = sum(lengths), 6, 4
    delta = torch.randn(tokens, channels)
    args = {"u": view_of(tokens, channels, dtype=dtype),
            "delta": (delta if softplus else F.softplus(delta)).to(dtype),
            "A": -torch.exp(torch.randn(channels, state_dim) * 0.5),
            "B": view_of(tokens, state_dim, dtype=dtype),
            "C": view_of(tokens, state_dim, dtype=dtype),
            "D": torch.randn(channels) if has_dz else None,
            "z": view_of(tokens, channels, dtype=dtype) if has_dz else None,
            "state": torch.randn(len(lengths), channels, state_dim),
            "delta_bias": torch.randn(channels) if has_bias else None,
            "delta_softplus": softplus}
    compare(recurrent.selective_scan, recurrent_triton_scan.triton_selective_scan, args, dtype,
            lengths)


# -- every family: edge batches at the default block sizes, and the public dispatch ----------

def conv_args(tokens: int, batch: int) -> dict:
    return {"x": torch.randn(tokens, 6), "weight": torch.randn(6, 4), "bias": torch.randn(6),
            "conv_state": torch.randn(batch, 6, 3)}


def delta_args(tokens: int, batch: int) -> dict:
    return {"q": torch.randn(tokens, 1, 4), "k": torch.randn(tokens, 1, 4),
            "v": torch.randn(tokens, 2, 4), "g": -F.softplus(torch.randn(tokens, 2)),
            "beta": torch.sigmoid(torch.randn(tokens, 2)), "state": torch.randn(batch, 2, 4, 4)}


def ssd_args(tokens: int, batch: int) -> dict:
    return {"x": torch.randn(tokens, 2, 4), "dt": torch.randn(tokens, 2),
            "A": -torch.rand(2) - 0.5, "B": torch.randn(tokens, 1, 4),
            "C": torch.randn(tokens, 1, 4), "D": torch.randn(2),
            "state": torch.randn(batch, 2, 4, 4), "dt_bias": torch.randn(2)}


def scan_args(tokens: int, batch: int) -> dict:
    return {"u": torch.randn(tokens, 4), "delta": torch.randn(tokens, 4),
            "A": -torch.rand(4, 4) - 0.5, "B": torch.randn(tokens, 4), "C": torch.randn(tokens, 4),
            "D": torch.randn(4), "z": torch.randn(tokens, 4), "state": torch.randn(batch, 4, 4),
            "delta_bias": torch.randn(4)}


# name: (public function, module of its launcher, launcher, random arguments)
FAMILIES = {
    "conv": (recurrent.causal_conv1d, recurrent_triton, "triton_causal_conv1d", conv_args),
    "delta": (recurrent.gated_delta_rule, recurrent_triton, "triton_gated_delta_rule",
              delta_args),
    "ssd": (recurrent.ssd, recurrent_triton_scan, "triton_ssd", ssd_args),
    "scan": (recurrent.selective_scan, recurrent_triton_scan, "triton_selective_scan",
             scan_args),
}
families = pytest.mark.parametrize("family", list(FAMILIES))


@families
@pytest.mark.parametrize("lengths", [
    pytest.param([1, 1, 1], id="decodes"),
    pytest.param([0, 0], id="all-empty"),
    pytest.param([], id="no-sequences"),
])
def test_edge_batches_match_reference(torch_backend, family, lengths):
    reference, module, launcher, make = FAMILIES[family]
    args = {**make(sum(lengths), len(lengths)), "cu_seqlens": cu_of(lengths)}
    compare_results(reference(**args), getattr(module, launcher)(**args))


@families
def test_no_emissions_give_an_empty_batch_of_states(torch_backend, family):
    reference, module, launcher, make = FAMILIES[family]
    args = {**make(9, 2), "cu_seqlens": cu_of([4, 5])}
    got = getattr(module, launcher)(**args)
    assert got[2].shape == (0, *got[1].shape[1:])
    compare_results(reference(**args), got)


def compare_results(want: tuple, got: tuple) -> None:
    """Float32 results equal within float32's tolerance, shapes and dtypes too."""
    for expected, actual in zip(want, got, strict=True):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, **FLOAT32)


def spy_on(monkeypatch: pytest.MonkeyPatch, family: str) -> list[dict]:
    """Count the calls of `family`'s launcher, which still runs."""
    _, module, launcher, _ = FAMILIES[family]
    calls, run = [], getattr(module, launcher)

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return run(*args, **kwargs)

    monkeypatch.setattr(module, launcher, spy)
    return calls


@families
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_public_function_dispatches_on_the_backend(monkeypatch, family, backend):
    reference, _, _, make = FAMILIES[family]
    torch.manual_seed(0)
    lengths = [0, 3, 1]
    args = {**make(sum(lengths), len(lengths)), "cu_seqlens": cu_of(lengths),
            "emit_at": torch.tensor([3, 1])}
    with monkeypatch.context() as torch_only:
        torch_only.setenv("PAGED_KV_BACKEND", "torch")
        want = reference(**args)
    calls = spy_on(monkeypatch, family)
    monkeypatch.setenv("PAGED_KV_BACKEND", backend)
    got = reference(**args)
    assert len(calls) == (backend == "triton")
    compare_results(want, got)


@families
def test_checks_run_before_the_triton_path(monkeypatch, family):
    reference, _, _, make = FAMILIES[family]
    calls = spy_on(monkeypatch, family)
    monkeypatch.setenv("PAGED_KV_BACKEND", "triton")
    args = {**make(4, 2), "cu_seqlens": cu_of([1, 3])}
    state_name = "conv_state" if family == "conv" else "state"
    wrong = {**args, state_name: args[state_name][..., :1]}  # a state of the wrong shape
    with pytest.raises(ValueError):
        reference(**wrong)
    assert not calls
    # the offsets and emissions are checked on the Triton path too
    for bad in ({"cu_seqlens": cu_of([1, 2])}, {"emit_at": torch.tensor([4])}):
        with pytest.raises(ValueError):
            reference(**{**args, **bad})
    assert len(calls) == 2
