"""`LayerKind` and `CacheConfig.layer_kinds`: validated, and all-full is the default layout."""

import pytest
import torch

from paged_kv import CacheConfig, LayerKind


def _config(**overrides):
    fields = dict(num_layers=3, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    fields.update(overrides)
    return CacheConfig(**fields)


def test_kinds_read_back_per_layer():
    kinds = (LayerKind.sliding(8), LayerKind.chunked(32), LayerKind.full())
    config = _config(layer_kinds=list(kinds))
    assert config.layer_kinds == kinds
    assert [config.kind_of(i).window for i in range(3)] == [8, 0, 0]
    assert [config.kind_of(i).chunk for i in range(3)] == [0, 32, 0]
    assert [str(k) for k in kinds] == ["sliding:8", "chunked:32", "full"]


def test_all_full_is_the_default_layout():
    assert _config(layer_kinds=(LayerKind(),) * 3) == _config()
    assert _config().kind_of(2).is_full


@pytest.mark.parametrize("kwargs, message", [
    (dict(attention="window", span=4), "LayerKind.attention"),
    (dict(attention="sliding", span=0), "span >= 1"),
    (dict(attention="chunked", span=-2), "span >= 1"),
    (dict(attention="full", span=4), "full attention has no span"),
    (dict(attention="sliding", span=4.0), "expected an int"),
])
def test_bad_kinds_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerKind(**kwargs)


def test_bad_layer_kinds_are_named():
    with pytest.raises(ValueError, match=r"one per layer \(3\), got 2"):
        _config(layer_kinds=(LayerKind.sliding(4),) * 2)
    with pytest.raises(ValueError, match="tuple of LayerKind"):
        _config(layer_kinds=("sliding",) * 3)
