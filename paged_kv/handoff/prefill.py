"""The prefill engine's side: a finished ``do_remote_decode`` request's full prompt blocks
copied out of the pool as tier values (`paged_kv.tiers.codec`, as the tiers' writer stores
them), leased (`LeaseTable`) and served (`HandoffServer`); the response says where. A
hybrid layout's lease holds exactly what the decode engine's tier fetch asks for: the
leading group's blocks and each other group's under its `group_key`s.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..core.cache import PagedKVCache
from ..core.groups.rules import group_key
from ..keys import block_keys, encode_tokens, root_hash
from ..parts import EnginePart
from ..tiers import codec
from .config import HandoffConfig
from .lease import LeaseTable
from .metrics import HandoffMetrics
from .server import HandoffServer
from .trust import HandoffTrust

MIB = 1 << 20


class PrefillRole(EnginePart):
    """Leases the pages of finished hand-off requests and serves them.

    Parameters
    ----------
    config : HandoffConfig
    cache : PagedKVCache
    fingerprint : codec.Fingerprint
        Of the pool's blocks; every value's header carries its digest.
    """

    role = "prefill"

    def __init__(self, config: HandoffConfig, cache: PagedKVCache,
                 fingerprint: codec.Fingerprint) -> None:
        self.config, self.cache, self._digest = config, cache, fingerprint.digest
        self.leases = LeaseTable(config.lease_s, int(config.max_lease_mib * MIB))
        self.metrics = HandoffMetrics(self.role, self.leases)
        self.trust = HandoffTrust(config.secret)
        self.server = HandoffServer(self.leases, config.host, config.port, self.trust)

    def admit(self, request: Any, params: Any) -> str | None:
        """Note a new request's parameters: only ``do_remote_decode`` matters here."""
        if params is not None and params.do_remote_decode:
            request.handoff = params
        return None

    def finished(self, request: Any) -> None:
        """A request finished: when it asked for a hand-off (and did not fail), lease its
        prompt's full blocks and set its ``kv_transfer_params``, signed."""
        if request.handoff is None or request.error is not None:
            return
        start = time.perf_counter()
        keys, values, starts = self.export(request.prompt_token_ids, request.salt,
                                           request.block_keys)
        lease = self.leases.create(values, request.salt)
        first = request.samples[0].output_token_ids[:1] if request.samples else []
        request.kv_transfer_params = {
            "remote_engine": self.server.endpoint, "lease": lease,
            "block_keys": [key.hex() for key in keys] if lease else [],
            "first_token": first[0] if first else None,
            "num_prompt_tokens": len(request.prompt_token_ids),
            "lease_seconds": self.config.lease_s}
        if starts is not None:  # a hybrid layout's other groups (see HandoffParams)
            request.kv_transfer_params["group_starts"] = starts if lease else []
        request.kv_transfer_params["signature"] = self.trust.sign_params(
            request.kv_transfer_params)
        if lease is not None:
            self.metrics.handoff(sum(len(v) for v in values.values()),
                                 time.perf_counter() - start)

    def export(self, prompt: list[int], salt: str | None, keys: list[bytes] | None = None,
               ) -> tuple[list[bytes], dict[bytes, bytes], list[int] | None]:
        """What a decode engine's fetch of `prompt` asks for, as the tiers' writer stores
        it: the keys of `prompt`'s full blocks the prefix cache holds, from the first on,
        up to the first it lacks; every leased key's encoded value; and, on a hybrid
        layout, ``group_starts`` (else None).

        A fetch never asks for the block holding the prompt's last token (the decode
        engine computes it: `paged_kv.core.step.plan`, `HybridAdmission.missing`), so a
        prompt of whole blocks leases all but its last; a hybrid layout's fetch asks
        each other group for the blocks a hit at the leading run's end reads
        (`_group_run`). `keys`: the prompt's block keys as the request carries them
        (hashed here without them)."""
        size, groups = self.cache.config.block_size, self.cache.groups
        tokens = np.asarray(prompt, dtype=np.int64)
        # the request's keys when it carries them (made once as it arrived)
        keys = (keys or block_keys(tokens, size, root_hash(salt)))[:(len(prompt) - 1) // size]
        ids = self._run(keys, tokens, size)
        keys = keys[:len(ids)]
        keys, states = self._state_end(keys)  # recurrent layers: a run ending at a state
        ids = ids[:len(keys)]
        leased, starts = list(keys), None
        if self.cache.config.layer_kinds:  # a layout of layer kinds: every other group's run
            starts = []
            for group in groups[1:]:
                first, found = self._group_run(group, keys, tokens, size)
                starts.append(first)
                ids += found
                leased += [group_key(key, group.index) for key in keys[first:]]
        if not ids:
            return [], {}, starts
        data = self.cache.pool.read_blocks(np.array(ids, dtype=np.int64)).numpy()
        if states is not None:  # the checkpoint's chunks, after every block
            leased += self.cache.state_group.tier_keys(keys[-1])
            data = np.concatenate([data, states.numpy()])
        return keys, {key: codec.encode(key, self._digest, row)
                      for key, row in zip(leased, data, strict=True)}, starts

    def _state_end(self, keys: list[bytes]) -> tuple[list[bytes], object]:
        """On a layout with recurrent layers, `keys` cut back to the last block after which
        a state checkpoint is written, and that checkpoint's values (the decode engine
        starts from it: blocks without their state would be recomputed there); else `keys`
        and None."""
        states = self.cache.state_group
        if not keys or states is None:
            return keys, None
        for end in range(len(keys), 0, -1):
            values = states.values_at(keys[end - 1])
            if values is not None:
                return keys[:end], values
        return [], None

    def _run(self, keys: list[bytes], tokens: np.ndarray, size: int) -> list[int]:
        """The cached blocks of `keys` from the first on, up to the first not cached."""
        allocator, ids = self.cache.allocator, []
        for i, key in enumerate(keys):
            block = allocator.lookup(key, encode_tokens(tokens[i * size:(i + 1) * size]))
            if block is None:
                break
            ids.append(block)
        return ids

    def _group_run(self, group: Any, keys: list[bytes], tokens: np.ndarray, size: int,
                   ) -> tuple[int, list[int]]:
        """Layer `group`'s cached blocks (under its `group_key`s) of the columns a hit of
        all `keys` reads (a window's or chunk's last ones, `LayerGroup.skipped_blocks`),
        right to left up to the first it lacks: that run's first column and its blocks in order."""
        first, end = group.skipped_blocks(len(keys) * size), len(keys)
        ids: list[int] = []
        for column in range(end - 1, first - 1, -1):
            block = self.cache.allocator.lookup(
                group_key(keys[column], group.index),
                encode_tokens(tokens[column * size:(column + 1) * size]))
            if block is None:
                return column + 1, ids[::-1]
            ids.append(block)
        return first, ids[::-1]

    def tick(self, scheduler: Any) -> list[tuple[int, str]]:
        """Nothing to do between steps (the server's thread sweeps the leases)."""
        return []

    def forget(self, request: Any) -> None:
        """A request aborted: nothing was leased for it yet."""

    def text(self) -> str:
        """The hand-off metrics."""
        return self.metrics.text()

    def close(self) -> None:
        """Stop serving (the leases go with the process)."""
        self.server.close()
