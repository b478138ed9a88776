"""Adapters that let other libraries run on a `PagedKVCache`.

Each submodule imports its library on import, so ``import paged_kv`` never needs them:

- `paged_kv.integrations.transformers`: `PagedCache`, a Hugging Face ``Cache`` for
  ``model.generate`` (needs ``transformers>=5,<6``).
"""
