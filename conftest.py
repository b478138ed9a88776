"""Doctest collection: skip the modules whose optional extra is not installed."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("transformers") else [
    "paged_kv/integrations/transformers.py"]
if not importlib.util.find_spec("redis"):  # the tiers extra
    collect_ignore.append("paged_kv/tiers/remote.py")
