"""The facade's admissions: adding a sequence with its longest cached prefix, planned once.

`PagedKVCache` inherits them (as it inherits the worker side from `LayerAccess`): one half
of the facade, kept apart because an admission is its own small protocol — plan (the
prompt's keys and its cached prefix, every layer group agreeing), check (the one capacity
test), commit (the row with its hits, and with `admit` its first step) — and the
scheduler drives it in two calls (`plan_admission`, then `commit_admission`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._checks import require_new
from ..config import CacheConfig
from ..keys import KEY_BYTES, root_hash
from .allocator import BlockAllocator
from .batch import SeqId, StepBatch
from .groups.admission import plan_groups, row_only
from .groups.groups import LayerGroup
from .groups.layout import GroupLayout
from .page_table import PageTables
from .step.commit import StepCommitter
from .step.parse import tokens_to_array
from .step.plan import Admission, StepPlanner


class Admissions:
    """`add_sequence`, `admit`, `plan_admission` and `commit_admission` over the owners of
    a `PagedKVCache` (the attributes below are the cache's)."""

    config: CacheConfig
    _allocator: BlockAllocator
    _tables: PageTables
    _planner: StepPlanner
    _committer: StepCommitter
    _groups: tuple[LayerGroup, ...]
    _layout: GroupLayout | None
    _generation: int

    def _after_mutation(self) -> None:
        raise NotImplementedError

    def add_sequence(self, seq_id: SeqId, prompt_token_ids: Sequence[int] | None = None, *,
                     salt: str | None = None, keys: Sequence[bytes] = ()) -> int:
        """Register a sequence and map its longest cached prefix of full blocks.

        Parameters
        ----------
        seq_id : hashable
            New, unique id.
        prompt_token_ids : sequence of int, optional
            The prompt, only looked up here; its tokens arrive through `prepare`.
        salt : str, optional
            Isolates prefix reuse between tenants.
        keys : sequence of bytes, optional
            The prompt's block keys as the request carries them (`paged_kv.keys.block_keys`
            of the prompt under the salt's root), so they are not hashed again: the lookup
            and the indexing of the prompt's blocks as `prepare` fills them use them (the
            indexing checks a key against the tokens it was hashed from; the lookup trusts
            them, as it trusts the prompt: keys of other tokens or of another salt would
            find other prompts' blocks). Missing ones are hashed here.

        Returns
        -------
        int
            Tokens already cached (a multiple of ``block_size``, always below the prompt's
            length so the last prompt token is computed); the sequence holds that many now.
        """
        require_new(self._tables, "add_sequence()", seq_id)
        tokens = (None if prompt_token_ids is None
                  else tokens_to_array("prompt_token_ids", prompt_token_ids))
        plan = self._plan_admission("add_sequence()", seq_id, tokens, salt, keys, 0)
        self._commit_admission(plan, "add_sequence()")  # takes no block: its hits only
        return plan.num_hit

    def admit(self, seq_id: SeqId, prompt_token_ids: Sequence[int], *,
              max_tokens: int | None = None, salt: str | None = None,
              keys: Sequence[bytes] = ()) -> tuple[int, StepBatch]:
        """`add_sequence` and the `prepare` of the prompt's next tokens, as one call: the
        prompt is converted and hashed once, and the admission is all or nothing.

        Parameters
        ----------
        seq_id : hashable
            New, unique id.
        prompt_token_ids : sequence of int
            The prompt (at least one token).
        max_tokens : int, optional
            Prepare at most this many tokens after the cached prefix (a prefill chunk);
            default: the rest of the prompt.
        salt : str, optional
            Isolates prefix reuse between tenants.
        keys : sequence of bytes, optional
            As for `add_sequence`.

        Returns
        -------
        (int, StepBatch)
            Tokens found cached, and the step batch of the tokens prepared after them.

        Raises
        ------
        OutOfBlocksError
            Not enough blocks for the prepared tokens; the sequence was not added and
            nothing changed.

        Examples
        --------
        >>> from paged_kv import CacheConfig, PagedKVCache
        >>> cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4,
        ...                                  block_size=4, num_blocks=8))
        >>> hit, batch = cache.admit("a", [1, 2, 3, 4, 5])
        >>> hit, batch.slot_mapping.tolist()
        (0, [4, 5, 6, 7, 8])
        """
        require_new(self._tables, "admit()", seq_id)
        tokens = tokens_to_array("admit(): prompt_token_ids", prompt_token_ids)
        if not len(tokens):
            raise ValueError("admit(): empty prompt; give at least one token")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(
                max_tokens, int) or max_tokens < 1):
            raise ValueError(f"admit(): max_tokens must be an int >= 1, got {max_tokens!r}")
        plan = self._plan_admission("admit()", seq_id, tokens, salt, keys, max_tokens)
        return plan.num_hit, self._commit_admission(plan, "admit()", prepare=True)

    def plan_admission(self, seq_id: SeqId, prompt_token_ids: Sequence[int], *,
                       salt: str | None = None, keys: Sequence[bytes] = (),
                       max_tokens: int | None = None, lookup: bool = True) -> Admission:
        """What adding `seq_id` with this prompt and preparing its next `max_tokens` tokens
        would take now (every key of the prompt's full blocks, its cached prefix, the
        blocks); changes nothing. A scheduler tests it with `paged_kv.core.step.plan.fits`,
        then adds the sequence with `commit_admission` (`lookup=False`: the prompt is not
        looked up, as for a request that wants every position's log-probabilities: add
        it with `add_sequence` and no prompt, so its blocks are indexed as they fill)."""
        require_new(self._tables, "plan_admission()", seq_id)
        tokens = tokens_to_array("plan_admission(): prompt_token_ids", prompt_token_ids)
        plan = self._plan_admission("plan_admission()", seq_id, tokens, salt, keys,
                                    max_tokens, lookup=lookup, complete=True)
        return plan._replace(generation=self._generation)

    def commit_admission(self, plan: Admission) -> int:
        """Add the sequence `plan_admission` planned, with its prefix hits (its next tokens
        come through `prepare`, as after `add_sequence`): exactly that plan while the cache
        has not changed since (no second lookup, no hashing), else planned again from the
        plan's prompt and keys. Returns the tokens found cached.

        Raises
        ------
        TypeError
            `plan` is not a plan of this cache's `plan_admission`.
        OutOfBlocksError
            Its cached hits cannot be revived now; nothing changed.
        """
        if getattr(plan, "generation", -1) < 0:
            raise TypeError("commit_admission(): expected a plan from plan_admission(), got "
                            f"{type(plan).__name__}")
        require_new(self._tables, "commit_admission()", plan.seq_id)
        if plan.generation != self._generation:  # the cache changed: plan the same again
            plan = self._plan_admission("commit_admission()", plan.seq_id, plan.tokens, None,
                                        plan.keys, 0, root=plan.root,
                                        lookup=plan.root is not None)
        # the row and its hits only, as `add_sequence`: its tokens' blocks come with its
        # step, so it takes no block now and always fits
        self._commit_admission(row_only(plan), "commit_admission()")
        return plan.num_hit

    def _plan_admission(self, what: str, seq_id: SeqId, tokens: np.ndarray | None,
                        salt: str | None, keys: Sequence[bytes], max_tokens: int | None,
                        *, lookup: bool = True, complete: bool = False,
                        root: bytes | None = None) -> Admission:
        """Validate the rest of an admission's arguments, then plan it (changes nothing;
        `root`, when given, is the salt's, already checked)."""
        root = root or root_hash(salt)  # also the salt's check, with prefix caching off too
        # counted in C: a request's keys come with every admission
        if keys and not (isinstance(keys, list | tuple) and [*map(type, keys)].count(bytes)
                         == len(keys) == [*map(len, keys)].count(KEY_BYTES)):
            raise TypeError(f"{what}: keys must be a list of {KEY_BYTES}-byte block keys")
        # a leader that gives blocks back finds its hit right to left: it needs every key
        plan = self._planner.plan_admission(seq_id, tokens, root if lookup else None,
                                            keys=keys, max_tokens=max_tokens,
                                            complete=complete or self._groups[0].gives_back)
        if self._layout is None:
            return plan
        return plan_groups(list(self._groups), self._allocator, plan,
                           self.config.block_size, max_tokens)

    def _commit_admission(self, plan: Admission, what: str, *, prepare: bool = False,
                          ) -> StepBatch | None:
        """Check an admission's plan, then commit its row (and, with `prepare`, its next
        tokens' step); a layout's groups check their own part first (the state slots of
        recurrent layers)."""
        self._planner.check(plan, what, root=plan.root)
        if self._layout is not None:
            batch = self._layout.commit_admission(plan, prepare, what)
        else:
            batch = self._committer.admit(plan) if prepare else self._committer.add_row(plan)
        self._after_mutation()
        return batch if prepare else None
