"""Doctest collection: skip the modules whose optional extra is not installed."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("transformers") else [
    "paged_kv/integrations/transformers.py"]
