"""A test hook for the engine-core process: ``python -m tests.server.faulty_model serve ...``
runs ``paged-kv serve`` whose model raises on any step holding token `POISON`."""

from __future__ import annotations

import importlib
import sys

import torch

from paged_kv.engine import TinyLlama

POISON = 299


class FailOn(torch.nn.Module):
    """`TinyLlama()`, except that a forward holding `POISON` raises."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyLlama()
        self.config = self.inner.config

    def cache_config(self, **kwargs):
        return self.inner.cache_config(**kwargs)

    def forward(self, token_ids, *args):
        if (token_ids == POISON).any():
            raise RuntimeError("poisoned input")
        return self.inner(token_ids, *args)


def main() -> int:
    from paged_kv.cli import build_parser
    from paged_kv.server.serve import serve

    args = build_parser().parse_args(sys.argv[1:])
    # pickled by name, so by the module's importable name: the spawned core imports it
    args.model_factory = importlib.import_module("tests.server.faulty_model").FailOn
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
