"""paged_kv.integrations.mixers.mamba2 against transformers' own Mamba-2 mixers (torch path).

For each family (Mamba-2, Nemotron-H, Granite 4 hybrid, Bamba) and 1 or 2 groups, one mixer
of a tiny random model runs the packed batch; the reference is the same module's forward on
each sequence alone, without a cache (a prefill) or with transformers' ``DynamicCache`` over
the same chunks (what ``generate`` computes, its one-token cached step included). The time
step limit is set so that it binds, which makes transformers' prefill (clamped) and
one-token step (not clamped) differ: the tests see which path each token took.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.integrations.mixers import Mixer, mixer_of  # noqa: E402
from paged_kv.integrations.mixers.mamba2 import run_mamba2  # noqa: E402
from paged_kv.integrations.recurrent import recurrent_layers  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, STATE, KERNEL, CHUNK = 64, 4, 32, 8, 4, 8  # I = 2 * 64 = 4 * 32
LIMIT = (0.3, 1.2)  # softplus(dt + dt_bias) spreads over ~(0.05, 3): the clamp binds
TOL = dict(atol=2e-4, rtol=1e-4)


def _config(family: str, groups: int, limit: tuple[float, float]) -> object:
    """A one-layer (Mamba-2 only) config of `family`, chunk size 8 so that transformers'
    chunked scan runs several chunks and a padded last one."""
    t = transformers
    granite = dict(hidden_size=HIDDEN, mamba_n_heads=HEADS, mamba_d_head=HEAD_DIM,
                   mamba_expand=2, mamba_d_state=STATE, mamba_n_groups=groups,
                   mamba_d_conv=KERNEL, mamba_chunk_size=CHUNK, time_step_limit=limit,
                   vocab_size=32, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=64)
    if family == "mamba2":
        return t.Mamba2Config(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, expand=2,
                              state_size=STATE, n_groups=groups, conv_kernel=KERNEL,
                              chunk_size=CHUNK, time_step_limit=limit, vocab_size=32,
                              num_hidden_layers=1)
    if family == "nemotron_h":
        return t.NemotronHConfig(hidden_size=HIDDEN, mamba_num_heads=HEADS,
                                 mamba_head_dim=HEAD_DIM, ssm_state_size=STATE,
                                 n_groups=groups, conv_kernel=KERNEL, chunk_size=CHUNK,
                                 time_step_limit=limit, vocab_size=32,
                                 layers_block_type=["mamba"], num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=64)
    if family == "granitemoehybrid":
        return t.GraniteMoeHybridConfig(**granite, layer_types=["mamba"], num_local_experts=2,
                                        num_experts_per_tok=1)
    return t.BambaConfig(**granite, attn_layer_indices=[])


MODELS = {"mamba2": "Mamba2Model", "nemotron_h": "NemotronHModel",
          "granitemoehybrid": "GraniteMoeHybridModel", "bamba": "BambaModel"}
CASES = [(family, groups) for family in MODELS for groups in (1, 2)]


def _mixer(family: str, groups: int, dtype: torch.dtype = torch.float32,
           limit: tuple[float, float] = LIMIT) -> tuple[torch.nn.Module, object]:
    """The model's one mixer, every parameter random (A_log, D, dt_bias and the norm weight
    included: their inits are constants a wrong formula could hide behind)."""
    config = _config(family, groups, limit)
    torch.manual_seed(0)
    model = getattr(transformers, MODELS[family])(config).eval()
    layer = model.layers[0]
    module = layer.mixer if hasattr(layer, "mixer") else layer.mamba
    return redraw(module).to(dtype), config


def redraw(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every parameter redrawn (A_log, D, dt_bias and the norm weight included:
    their inits are constants a wrong formula could hide behind); the torch seed's draws."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn_like(p)
            p.copy_({"A_log": 0.5 * noise, "dt_bias": noise, "D": noise,
                     "norm.weight": 1 + 0.2 * noise}.get(name, 0.2 * noise))
    return module


def _zeros(config: object, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Fresh states of `batch` sequences, shaped by the engine's own state specs."""
    specs = recurrent_layers(config, dtype)[0]
    return tuple(torch.zeros(batch, *spec.shape, dtype=spec.dtype) for spec in specs)


def _packed(module: torch.nn.Module, seqs: list[torch.Tensor], states: tuple[torch.Tensor, ...],
            emit_at: list[int] = (), run: Mixer = run_mamba2,
            ) -> tuple[list[torch.Tensor], tuple, tuple]:
    """`run` (a mixer) over `seqs` packed in one call: per-sequence outputs, final, emitted."""
    lengths = torch.tensor([len(s) for s in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    with torch.no_grad():
        out, final, emitted = run(module, torch.cat(seqs), states, cu,
                                  torch.tensor(list(emit_at), dtype=torch.int64))
    return list(out.split(lengths.tolist())), final, emitted


def assert_emitted_states_resume(module: torch.nn.Module, config: object, packed) -> None:
    """States `packed` (a mixer run over packed sequences, as `_packed`) emits after given
    tokens, used as the initial states of the tokens that follow, give the outputs the
    single call gave them; one emitted at a sequence's last token is its final state."""
    seqs = _inputs([17, 33, 5])
    starts = [0, 17, 50]
    # (sequence, position in it): mid-chunk, chunk boundaries, the first and last tokens
    points = [(0, 7), (1, 15), (1, 8), (2, 0), (0, 16), (1, 30)]
    emit_at = [starts[b] + p for b, p in points]
    outs, final, emitted = packed(module, seqs, _zeros(config, len(seqs), torch.float32),
                                   emit_at)
    assert emitted[0].shape == (len(points), *final[0].shape[1:])
    assert emitted[1].shape == (len(points), *final[1].shape[1:])
    for e, (b, p) in enumerate(points):
        if p == len(seqs[b]) - 1:  # nothing follows: the state is the final one
            torch.testing.assert_close(emitted[0][e], final[0][b], **TOL)
            torch.testing.assert_close(emitted[1][e], final[1][b], **TOL)
            continue
        start = (emitted[0][e:e + 1], emitted[1][e:e + 1])
        rest, rest_final, _ = packed(module, [seqs[b][p + 1:]], start)
        torch.testing.assert_close(rest[0], outs[b][p + 1:], **TOL)
        torch.testing.assert_close(rest_final[1][0], final[1][b], **TOL)


def _forward(module: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
    """The module's forward on one sequence, batch 1, no cache (transformers' prefill)."""
    with torch.no_grad():
        return module(seq[None])[0]


def _generate(module: torch.nn.Module, config: object, chunks: list[torch.Tensor]
              ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The module over `chunks` of one sequence with transformers' own cache (a one-token
    chunk after the first is its cached decode step): outputs, and the states it holds."""
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        outs = [module(chunk[None], cache=cache)[0] for chunk in chunks]
    layer = cache.layers[module.layer_idx]
    return outs, (layer.conv_states[0][0], layer.recurrent_states[0][0])


def _inputs(lengths: list[int], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(n, HIDDEN).to(dtype) for n in lengths]


def test_registered() -> None:
    """Every family's module class is routed to run_mamba2."""
    for family in MODELS:
        module, _ = _mixer(family, 1)
        assert mixer_of(module) is run_mamba2, type(module).__name__


@pytest.mark.parametrize(("family", "groups"), CASES)
def test_packed_prefill_matches_forward(family: str, groups: int) -> None:
    """Sequences of 1, 5, 17, 33 tokens in one call from zero states: each one's outputs are
    the module's forward on it alone, and its final states are what transformers' cache
    holds after that prefill (layout: the conv window of raw inputs, oldest first)."""
    module, config = _mixer(family, groups)
    seqs = _inputs([1, 5, 17, 33])
    outs, final, _ = _packed(module, seqs, _zeros(config, len(seqs), torch.float32))
    for b, (seq, out) in enumerate(zip(seqs, outs, strict=True)):
        torch.testing.assert_close(out, _forward(module, seq), **TOL)
        _, (conv, ssm) = _generate(module, config, [seq])
        torch.testing.assert_close(final[0][b], conv, **TOL)
        torch.testing.assert_close(final[1][b], ssm, **TOL)


@pytest.mark.parametrize(("family", "groups"), CASES)
def test_chunks_then_decode_match_generate(family: str, groups: int) -> None:
    """Each sequence in two chunks over two calls (call 1's final states start call 2; one
    second chunk has a single token), then a one-token decode: outputs and states equal
    transformers' cached forwards over the same chunks; the multi-token chunks also equal the
    whole sequence's prefill, and the one-token steps differ from it (unclamped time step)."""
    module, config = _mixer(family, groups)
    lengths, splits = [5, 17, 33, 3], [2, 9, 20, 2]
    seqs = _inputs([n + 1 for n in lengths])  # the last token of each is its decode
    calls = [[s[:k] for s, k in zip(seqs, splits, strict=True)],
             [s[k:n] for s, k, n in zip(seqs, splits, lengths, strict=True)],
             [s[n:] for s, n in zip(seqs, lengths, strict=True)]]
    states = _zeros(config, len(seqs), torch.float32)
    ours = []
    for chunks in calls:
        outs, states, _ = _packed(module, chunks, states)
        ours.append(outs)
    stepped_differs = False
    for b, seq in enumerate(seqs):
        chunks = [call[b] for call in calls]
        ref, (conv, ssm) = _generate(module, config, chunks)
        prefill = _forward(module, seq)
        for out, expected in zip((call[b] for call in ours), ref, strict=True):
            torch.testing.assert_close(out, expected, **TOL)
        torch.testing.assert_close(states[0][b], conv, **TOL)
        torch.testing.assert_close(states[1][b], ssm, **TOL)
        # the multi-token chunks are prefill: the same as the whole sequence's forward
        if len(chunks[1]) > 1:
            torch.testing.assert_close(torch.cat([ours[0][b], ours[1][b]]),
                                       prefill[:lengths[b]], **TOL)
        stepped_differs |= not torch.allclose(ours[2][b], prefill[-1:], **TOL)
    # the limit binds somewhere: had every step been clamped, this test could not tell
    assert stepped_differs


def test_decode_equals_prefill_without_a_limit() -> None:
    """With the default limit (0, inf) the decode step and the prefill agree: the whole
    sequence's forward equals a prompt then a one-token step."""
    module, config = _mixer("mamba2", 2, limit=(0.0, float("inf")))
    (seq,) = _inputs([12])
    outs, states, _ = _packed(module, [seq[:11]], _zeros(config, 1, torch.float32))
    step, _, _ = _packed(module, [seq[11:]], states)
    torch.testing.assert_close(torch.cat([outs[0], step[0]]), _forward(module, seq), **TOL)


@pytest.mark.parametrize(("family", "groups"), CASES)
def test_emitted_states_resume(family: str, groups: int) -> None:
    """States emitted after given tokens, used as the initial states of the tokens that
    follow, give the outputs the single call gave them; one emitted at a sequence's last
    token is its final state."""
    module, config = _mixer(family, groups)
    assert_emitted_states_resume(module, config, _packed)


def test_bfloat16() -> None:
    """A bfloat16 model (bf16 conv window, float32 SSM state): a packed prefill and a
    chunk + one-token decode against transformers' bf16 forwards, to bf16 rounding."""
    module, config = _mixer("nemotron_h", 2, dtype=torch.bfloat16)
    seqs = _inputs([5, 17, 33], torch.bfloat16)
    states = _zeros(config, len(seqs), torch.bfloat16)
    assert states[0].dtype == torch.bfloat16 and states[1].dtype == torch.float32
    outs, final, _ = _packed(module, seqs, states)
    assert final[0].dtype == torch.bfloat16 and final[1].dtype == torch.float32
    loose = dict(atol=0.06, rtol=0.02)  # seen: 1 bf16 ulp of outputs ~8
    for seq, out in zip(seqs, outs, strict=True):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), _forward(module, seq).float(), **loose)
    steps, _, _ = _packed(module, [s[-1:] for s in seqs], final)
    for seq, step in zip(seqs, steps, strict=True):
        ref, _ = _generate(module, config, [seq, seq[-1:]])
        torch.testing.assert_close(step.float(), ref[1].float(), **loose)


def test_wrong_state_shape_is_refused() -> None:
    module, config = _mixer("bamba", 2)
    conv, ssm = _zeros(config, 1, torch.float32)
    with pytest.raises(ValueError, match="states"):
        _packed(module, _inputs([3]), (conv, ssm.transpose(2, 3).contiguous()))
