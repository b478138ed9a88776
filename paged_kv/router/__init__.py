"""``paged-kv route``: a cache-aware router in front of ``paged-kv serve`` replicas.

Each replica publishes its prefix index's changes (`paged_kv.events`); the router keeps an
exact map block key → replicas (with the tier), computes a request's keys the way the
replicas do (same tokenizer, same chained sha256, same tenant salt), and sends it where
the longest prefix is cached unless that would unbalance the load.
"""

from .index import PrefixIndex, prompt_keys
from .policy import POLICIES, Choice, choose

__all__ = ["POLICIES", "Choice", "PrefixIndex", "choose", "prompt_keys"]
