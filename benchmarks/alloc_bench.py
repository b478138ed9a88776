#!/usr/bin/env python3
"""Trace-driven benchmark for paged KV-cache *block allocators* (bookkeeping only).

paged_kv's copy of the workplace anchor harness (shared/anchors/alloc_bench.py), with
adapters for the array decode step added; the anchors' own code stays outside the repo.
Run: ``python benchmarks/alloc_bench.py --anchors DIR --impls null,vllm,vllm_nocache,``
``paged_kv,paged_kv_nocache,paged_kv_arrays,paged_kv_arrays_nocache``.

Replays one deterministic synthetic serving trace against several third-party
block managers ("anchors") and reports wall time, block alloc+free throughput
and per-decode-step bookkeeping latency.  The anchors' code is NOT part of this
file: it is imported from an extraction directory given by ``--anchors DIR`` or
the ``ALLOC_ANCHORS_DIR`` environment variable.  That directory must contain

    nanovllm/engine/block_manager.py, nanovllm/engine/sequence.py,
    nanovllm/sampling_params.py                      (GeeeekExplorer/nano-vllm)
    vllm/v1/core/block_pool.py, vllm/v1/core/kv_cache_utils.py,
    vllm/utils/hashing.py, vllm/utils/math_utils.py  (vllm-project/vllm)
    + stub modules for their unrelated imports, and optionally _deps/ with
      xxhash and cbor2 (added to sys.path if present).

Implementations ("impls") replayed, interleaved, in a rotating order per repeat:

  null             harness loop only, no allocator (measures harness overhead)
  nanovllm         nano-vllm BlockManager, driven like nano-vllm's Scheduler
                   (can_allocate/allocate at admission, can_append/may_append
                   then hash_blocks each decode step, deallocate at finish).
                   nano-vllm always hashes full blocks (xxh64), i.e. prefix
                   caching is always on.
  nanovllm_nohash  same BlockManager, but the adapter skips can_allocate and
                   hash_blocks (pure allocator; NOT a mode nano-vllm offers).
  vllm             vLLM v1 BlockPool, enable_caching=True, default hash
                   (sha256 over pickle), driven like FullAttentionManager /
                   KVCacheManager.allocate_slots + Request.append_output_token_ids.
  vllm_xxhash      as vllm but prefix_caching_hash_algo="xxhash" (xxh3_128).
  vllm_nocache     vLLM v1 BlockPool, enable_caching=False, no block hashing.

The manager-level adapter code below (cache-hit lookup loop, "allocate up to
cdiv(num_tokens, block_size)", "cache newly full blocks", "free in reverse
order") is ours; it reproduces the calling pattern of the engines' schedulers
and calls only the anchors' public methods.

Trace (identical for every impl; fixed seed):
  * N requests, closed loop with C concurrent slots (default 256): whenever a
    slot is free the next request is admitted (prefill bookkeeping) and then
    takes part in every decode step, one token per step, until it has
    produced its output length; then its blocks are freed.
  * prompt length ~ lognormal (median 341, sigma 0.9 -> mean ~512), clipped
    to [32, 4096]; output length ~ lognormal (median 128, sigma 0.8), clipped
    to [2, 1024].  Token ids uniform in [0, 32000).
  * scenario "noshare": all prompts unique.  Scenario "share": 50% of the
    prompts (fixed-seed choice) start with the same 256-token system prompt
    (16 full blocks at block_size 16); prompt lengths are identical in both
    scenarios (shared prompts are clipped below at 257 tokens).
  * pool size = ceil(1.1 * peak blocks in use of the noshare trace); vLLM gets
    one extra block for its reserved null block so usable capacity is equal.
    With this size no allocation ever fails, so every impl sees the exact same
    schedule.

Metrics (per replay; reported as min / median over repeats):
  wall_s          whole replay: admissions + decode steps + frees + harness loop
  ops_per_s       (fresh block allocations + block references released) / wall
  step_us         median over the decode steps that ran a full batch of C
                  sequences of the bookkeeping time of that step (both passes:
                  schedule/allocate and post-model hash/append)
  admit_us        median bookkeeping time per admitted request (prefill)

Usage:
  python alloc_bench.py --anchors $ANCHORS [--repeats 5] [--json out.json]
  python alloc_bench.py --anchors $ANCHORS --impls null,vllm,paged_kv_arrays_kept \
      --scenarios share --instructions      # each step's instructions (valgrind), not time
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import math
import operator
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque

import numpy as np

ALL_IMPLS = ["null", "nanovllm", "nanovllm_nohash", "vllm", "vllm_xxhash", "vllm_nocache"]

SYS_PROMPT_LEN = 256
VOCAB = 32000


# --------------------------------------------------------------------------
# Trace generation (ours)
# --------------------------------------------------------------------------
class Trace:
    def __init__(self, name, prompts, outputs, block_size, concurrency, shared_mask):
        self.name = name
        self.prompts = prompts          # list[list[int]]
        self.outputs = outputs          # list[list[int]]  (len >= 2)
        self.block_size = block_size
        self.concurrency = concurrency
        self.shared_mask = shared_mask  # list[bool]


def make_traces(num_requests, concurrency, block_size, seed, share_frac):
    rng = np.random.default_rng(seed)
    plen = np.clip(np.round(rng.lognormal(np.log(341.0), 0.9, num_requests)), 32, 4096).astype(int)
    olen = np.clip(np.round(rng.lognormal(np.log(128.0), 0.8, num_requests)), 2, 1024).astype(int)
    shared = rng.random(num_requests) < share_frac
    # Shared prompts need at least one token after the 256-token system prompt.
    plen = np.where(shared, np.maximum(plen, SYS_PROMPT_LEN + 1), plen)
    sys_prompt = rng.integers(0, VOCAB, SYS_PROMPT_LEN).tolist()
    outputs = [rng.integers(0, VOCAB, int(n)).tolist() for n in olen]
    uniq = [rng.integers(0, VOCAB, int(n)).tolist() for n in plen]
    noshare = Trace("noshare", uniq, outputs, block_size, concurrency, [False] * num_requests)
    share_prompts = [
        (sys_prompt + u[SYS_PROMPT_LEN:]) if s else u for u, s in zip(uniq, shared.tolist(), strict=False)
    ]
    share = Trace("share", share_prompts, outputs, block_size, concurrency, shared.tolist())
    return noshare, share


def peak_blocks(trace):
    """Offline replay of the schedule: peak of sum(cdiv(kv tokens, bs))."""
    bs, C = trace.block_size, trace.concurrency
    waiting = deque(range(len(trace.prompts)))
    running = []  # [req_idx, num_tokens, produced]
    peak = 0
    while waiting or running:
        while len(running) < C and waiting:
            i = waiting.popleft()
            running.append([i, len(trace.prompts[i]) + 1, 1])
        # decode step: each seq needs slots for num_tokens (incl. newest)
        peak = max(peak, sum(-(-r[1] // bs) for r in running))
        nxt = []
        for r in running:
            r[1] += 1
            r[2] += 1
            if r[2] < len(trace.outputs[r[0]]):
                nxt.append(r)
        running = nxt
    return peak


# --------------------------------------------------------------------------
# Adapters (ours): drive each anchor with its engine's calling pattern
# --------------------------------------------------------------------------
class NullAdapter:
    """No allocator: the same loop with trivial per-request state."""

    name = "null"

    def __init__(self, mods, num_blocks, bs):
        self.bs = bs

    def admit(self, rid, prompt, first_tok):
        toks = list(prompt)
        toks.append(first_tok)
        return [toks, len(prompt)]

    def decode_schedule(self, r):
        pass

    def decode_post(self, r, tok):
        r[0].append(tok)
        r[1] += 1

    def free(self, r):
        return 0, 0  # (block refs released, prefix-hit blocks)

    def check_all_free(self):
        return True


class NanoAdapter:
    """nano-vllm BlockManager driven like nanovllm/engine/scheduler.py.

    hash_blocks is invoked right after allocation in the same admission call
    (nano-vllm does it in Scheduler.postprocess after the model step), so a
    request admitted later in the same step can already hit the blocks.
    """

    name = "nanovllm"
    use_hash = True

    def __init__(self, mods, num_blocks, bs):
        self.Sequence = mods["nano_seq"].Sequence
        self.Sequence.block_size = bs  # nano-vllm's LLMEngine sets this class attribute too
        self.bm = mods["nano_bm"].BlockManager(num_blocks, bs)
        self.bs = bs
        self.num_blocks = num_blocks

    def admit(self, rid, prompt, first_tok):
        bm = self.bm
        seq = self.Sequence(prompt)
        if self.use_hash:
            ncb = bm.can_allocate(seq)
            if ncb == -1:
                raise RuntimeError("nanovllm: pool exhausted (trace should never do this)")
        else:
            ncb = 0
            if len(bm.free_block_ids) < seq.num_blocks:
                raise RuntimeError("nanovllm: pool exhausted")
        bm.allocate(seq, ncb)
        seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
        # --- postprocess of the prefill step ---
        if self.use_hash:
            bm.hash_blocks(seq)
        seq.num_cached_tokens += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        seq.is_prefill = False
        seq.append_token(first_tok)
        seq._bench_hits = ncb
        return seq

    def decode_schedule(self, seq):
        bm = self.bm
        if not bm.can_append(seq):
            raise RuntimeError("nanovllm: cannot append (trace should never do this)")
        seq.num_scheduled_tokens = 1
        bm.may_append(seq)

    def decode_post(self, seq, tok):
        if self.use_hash:
            self.bm.hash_blocks(seq)
        seq.num_cached_tokens += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        seq.append_token(tok)

    def free(self, seq):
        n = len(seq.block_table)
        self.bm.deallocate(seq)
        return n, seq._bench_hits

    def check_all_free(self):
        return len(self.bm.free_block_ids) == self.num_blocks and not self.bm.used_block_ids


class NanoNoHashAdapter(NanoAdapter):
    name = "nanovllm_nohash"
    use_hash = False


class _VReq:
    """Duck-typed stand-in for vllm.v1.request.Request with exactly the
    attributes BlockPool / kv_cache_utils read for a text-only request."""

    __slots__ = (
        "_prompt_embeds_per_block_hashes",
        "all_token_ids",
        "block_hashes",
        "blocks",
        "cache_salt",
        "hits",
        "lora_request",
        "mm_features",
        "num_cached_block",
        "num_computed_tokens",
        "num_prompt_tokens",
        "prompt_embeds",
        "request_id",
        "session_id",
    )

    def __init__(self, rid, prompt):
        self.request_id = rid
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.block_hashes = []
        self.mm_features = []
        self.lora_request = None
        self.cache_salt = None
        self.prompt_embeds = None
        self.session_id = None
        self._prompt_embeds_per_block_hashes = {}
        self.blocks = []
        self.num_cached_block = 0
        self.num_computed_tokens = 0
        self.hits = 0

    @property
    def num_tokens(self):
        return len(self.all_token_ids)


class VllmAdapter:
    """vLLM v1 BlockPool driven like FullAttentionManager (single KV-cache
    group, block_size == hash_block_size) + KVCacheManager.allocate_slots, with
    block hashes computed on token append like Request.update_block_hashes."""

    name = "vllm"
    enable_caching = True
    hash_algo = "sha256"

    def __init__(self, mods, num_blocks, bs):
        ku = mods["vllm_ku"]
        self.pool = mods["vllm_bp"].BlockPool(
            num_gpu_blocks=num_blocks + 1,  # +1: block 0 becomes the null block
            enable_caching=self.enable_caching,
            hash_block_size=bs,
        )
        self.bs = bs
        self.num_blocks = num_blocks
        if self.enable_caching:
            hash_fn = mods["vllm_hashing"].get_hash_fn_by_name(self.hash_algo)
            ku.init_none_hash(hash_fn)
            self.hasher = ku.get_request_block_hasher(bs, hash_fn)
        else:
            self.hasher = None

    def admit(self, rid, prompt, first_tok):
        pool, bs = self.pool, self.bs
        r = _VReq(rid, prompt)
        hits = []
        if self.hasher is not None:
            r.block_hashes.extend(self.hasher(r))  # Request.__init__ -> update_block_hashes
            # FullAttentionManager.find_longest_cache_hit, max_length = num_tokens - 1
            max_blocks = (r.num_tokens - 1) // bs
            gid = [0]
            for h in r.block_hashes[:max_blocks]:
                cached = pool.get_cached_block(h, gid)
                if not cached:
                    break
                hits.append(cached[0])
        n = r.num_tokens
        need = -(-n // bs) - len(hits)
        evictable = sum(1 for b in hits if b.ref_cnt == 0)
        if pool.get_num_free_blocks() < need + evictable:
            raise RuntimeError("vllm: pool exhausted (trace should never do this)")
        if hits:
            pool.touch(hits)
            r.blocks.extend(hits)
            r.num_cached_block = len(hits)
            r.hits = len(hits)
        if need > 0:
            r.blocks.extend(pool.get_new_blocks(need))
        if self.enable_caching:
            nfull = min(n, len(r.block_hashes) * bs) // bs
            if nfull > r.num_cached_block:
                pool.cache_full_blocks(r, r.blocks, r.num_cached_block, nfull, bs, 0)
                r.num_cached_block = nfull
        # --- update_from_output of the prefill step ---
        r.num_computed_tokens = n
        r.all_token_ids.append(first_tok)
        if self.hasher is not None:
            r.block_hashes.extend(self.hasher(r))
        return r

    def decode_schedule(self, r):
        pool, bs = self.pool, self.bs
        n = r.num_computed_tokens + 1
        blocks = r.blocks
        need = -(-n // bs) - len(blocks)
        if need > 0:
            if pool.get_num_free_blocks() < need:
                raise RuntimeError("vllm: pool exhausted")
            blocks.extend(pool.get_new_blocks(need))
        if self.enable_caching:
            nfull = min(n, len(r.block_hashes) * bs) // bs
            if nfull > r.num_cached_block:
                pool.cache_full_blocks(r, blocks, r.num_cached_block, nfull, bs, 0)
                r.num_cached_block = nfull

    def decode_post(self, r, tok):
        r.num_computed_tokens += 1
        r.all_token_ids.append(tok)
        if self.hasher is not None:
            r.block_hashes.extend(self.hasher(r))

    def free(self, r):
        n = len(r.blocks)
        self.pool.free_blocks(reversed(r.blocks))
        r.blocks = []
        return n, r.hits

    def check_all_free(self):
        return self.pool.get_num_free_blocks() == self.num_blocks


class VllmXxhashAdapter(VllmAdapter):
    name = "vllm_xxhash"
    hash_algo = "xxhash"


class VllmNoCacheAdapter(VllmAdapter):
    name = "vllm_nocache"
    enable_caching = False


class PagedKvAdapter:
    """paged_kv through its public contract (shared/DESIGN.md section 2): one batched
    prepare() per decode step for all running sequences; the step time therefore also
    includes building the step's block tables and slot mapping, which the other rows omit."""

    name = "paged_kv"
    enable_caching = True
    reuse_block_tables = False  # the `_kept` adapters: block tables kept, as the engine's

    def __init__(self, mods, num_blocks, bs):
        import torch

        import paged_kv
        cfg = paged_kv.CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, block_size=bs,
                                   num_blocks=num_blocks + 1, dtype=torch.float32, device="cpu",
                                   enable_prefix_caching=self.enable_caching,
                                   reuse_block_tables=self.reuse_block_tables)
        self.cache = paged_kv.PagedKVCache(cfg)
        self.bs = bs

    def admit(self, rid, prompt, first_tok):
        hit = self.cache.add_sequence(rid, prompt)
        self.cache.prepare({rid: prompt[hit:]})
        return [rid, first_tok, hit // self.bs]

    def decode_step(self, states):
        self.cache.prepare({st[0]: [st[1]] for st in states})

    def decode_schedule(self, st):  # unused: decode_step batches the whole step
        raise AssertionError

    def decode_post(self, st, tok):
        st[1] = tok

    def free(self, st):
        n = -(-self.cache.tables.num_tokens_of(st[0]) // self.bs)
        self.cache.free(st[0])
        return n, st[2]

    def check_all_free(self):
        return self.cache.stats().num_live_blocks == 0


class PagedKvNoCacheAdapter(PagedKvAdapter):
    name = "paged_kv_nocache"
    enable_caching = False


_ROW, _TOKEN = operator.itemgetter(3), operator.itemgetter(1)


class PagedKvArraysAdapter(PagedKvAdapter):
    """paged_kv through its array API: admission is one `admit(rid, prompt)` (add +
    prepare, the prompt converted and hashed once); each decode step turns the harness's
    per-request states into one rows array and one token array (built here, inside the
    timed step) for `prepare_decode(rows, tokens)`; free as `PagedKvAdapter`."""

    name = "paged_kv_arrays"

    def admit(self, rid, prompt, first_tok):
        hit, _ = self.cache.admit(rid, prompt)
        return [rid, first_tok, hit // self.bs, self.cache.tables.row_of[rid]]

    def decode_step(self, states):
        # itemgetter maps in C (a generator costs ~2x); int32 ids as the scheduler's sampler gives
        rows = np.fromiter(map(_ROW, states), dtype=np.int64, count=len(states))
        tokens = np.fromiter(map(_TOKEN, states), dtype=np.int32, count=len(states))
        self.cache.prepare_decode(rows, tokens)


class PagedKvArraysNoCacheAdapter(PagedKvArraysAdapter):
    name = "paged_kv_arrays_nocache"
    enable_caching = False


class PagedKvGroupsAdapter(PagedKvArraysAdapter):
    """The array API over three layer groups (issue 42): full attention, a sliding window of
    256 tokens and a recurrent state layer, one pool. Each step also gives back the blocks
    windows left, indexes the window group's filled blocks under the leading group's keys
    and offers a state checkpoint at every filled block; the pool is twice the trace's (sized
    for full attention alone: a window row holds its whole prompt until its first decode
    step gives the window's leftovers back) plus a window per request, and state slots for 64 per
    running request: an admission offers a checkpoint at each block its prompt fills (~33 a
    prompt), pending until the request's next step confirms them, and the first burst of
    256+ admissions comes before any step (with 2 slots a request, as the adapter was
    written, an admission in that burst found no live slot: 2026-12-06's state.py); past
    that the checkpoints evict one another."""

    name = "paged_kv_groups"

    def __init__(self, mods, num_blocks, bs):
        import torch

        import paged_kv
        from paged_kv.config import StateSpec
        kinds = (paged_kv.LayerKind(), paged_kv.LayerKind.sliding(256),
                 paged_kv.LayerKind.recurrent((StateSpec("ssm", (1,), torch.float32),)))
        slots = 64 * self.concurrency
        cfg = paged_kv.CacheConfig(num_layers=3, num_kv_heads=1, head_dim=8, block_size=bs,
                                   num_blocks=2 * num_blocks + 1 + self.concurrency * (256 // bs + 2),
                                   dtype=torch.float32, device="cpu", enable_prefix_caching=True,
                                   layer_kinds=kinds, num_state_slots=slots,
                                   reuse_block_tables=self.reuse_block_tables)
        self.cache = paged_kv.PagedKVCache(cfg)
        self.bs = bs

    concurrency = 256  # set from --concurrency by main()


class PagedKvArraysKeptAdapter(PagedKvArraysAdapter):
    """`paged_kv_arrays` with `CacheConfig.reuse_block_tables`, as the engine's cache: a
    decode step of the same requests updates the last step's block tables in place (the
    harness drops each batch), instead of writing new ones."""

    name = "paged_kv_arrays_kept"
    reuse_block_tables = True


class PagedKvGroupsKeptAdapter(PagedKvGroupsAdapter):
    """`paged_kv_groups` with `CacheConfig.reuse_block_tables` (see
    `PagedKvArraysKeptAdapter`)."""

    name = "paged_kv_groups_kept"
    reuse_block_tables = True


NUM_TENANTS = 4


class PagedKvSaltedAdapter(PagedKvArraysAdapter):
    """The array API with each request salted by one of `NUM_TENANTS` tenants (request id
    modulo), no tenant policy: the baseline of `paged_kv_tenants` (the same hits)."""

    name = "paged_kv_salted"
    policy = False
    reserved_pool = False  # the tenants adapter's pool (plus the reservations), no policy

    def __init__(self, mods, num_blocks, bs):
        import torch

        import paged_kv
        from paged_kv.tenants import TenantLimits, TenantPolicy
        # each a quarter of the pool at most, a sixty-fourth kept from the others; the
        # pool grows by the reservations, which the trace (sized for a pool any cached
        # block of which may be evicted) cannot count on
        limits = TenantLimits(quota=num_blocks // NUM_TENANTS,
                              reservation=num_blocks // (16 * NUM_TENANTS))
        tenants = TenantPolicy({f"t{i}": limits for i in range(NUM_TENANTS)})
        extra = tenants.reserved_blocks if self.policy or self.reserved_pool else 0
        cfg = paged_kv.CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, block_size=bs,
                                   num_blocks=num_blocks + 1 + extra, dtype=torch.float32, device="cpu",
                                   enable_prefix_caching=True,
                                   tenants=tenants if self.policy else None)
        self.cache = paged_kv.PagedKVCache(cfg)
        self.bs = bs

    def admit(self, rid, prompt, first_tok):
        hit, _ = self.cache.admit(rid, prompt, salt=f"t{rid % NUM_TENANTS}")
        return [rid, first_tok, hit // self.bs, self.cache.tables.row_of[rid]]


class PagedKvSaltedPoolAdapter(PagedKvSaltedAdapter):
    """`paged_kv_salted` over `paged_kv_tenants`' pool (the trace's plus the reservations,
    ~6% more blocks), no policy: the tenant ledger's own cost is `paged_kv_tenants` over this
    one, the pool's size apart (on a quiet machine it made no difference: 0.99x of
    `paged_kv_salted`'s wall time, the same instructions within 0.2%, 2026-12-06)."""

    name = "paged_kv_salted_pool"
    reserved_pool = True


class PagedKvTenantsAdapter(PagedKvSaltedAdapter):
    """`paged_kv_salted` under a tenant policy (quota and reservation per tenant): the
    ledger's bookkeeping on every cached block and every eviction."""

    name = "paged_kv_tenants"
    policy = True


ADAPTERS = {
    "null": NullAdapter,
    "nanovllm": NanoAdapter,
    "nanovllm_nohash": NanoNoHashAdapter,
    "vllm": VllmAdapter,
    "vllm_xxhash": VllmXxhashAdapter,
    "vllm_nocache": VllmNoCacheAdapter,
    "paged_kv": PagedKvAdapter,
    "paged_kv_nocache": PagedKvNoCacheAdapter,
    "paged_kv_arrays": PagedKvArraysAdapter,
    "paged_kv_arrays_nocache": PagedKvArraysNoCacheAdapter,
    "paged_kv_groups": PagedKvGroupsAdapter,
    "paged_kv_arrays_kept": PagedKvArraysKeptAdapter,
    "paged_kv_groups_kept": PagedKvGroupsKeptAdapter,
    "paged_kv_salted": PagedKvSaltedAdapter,
    "paged_kv_salted_pool": PagedKvSaltedPoolAdapter,
    "paged_kv_tenants": PagedKvTenantsAdapter,
}


# --------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------
def replay(adapter, trace, counted=False):
    """Replay `trace`; returns a dict of raw measurements. `counted`: each full decode step
    runs inside a one-item `functools.reduce`, the call `--instructions` has callgrind
    count inside (and nothing else: the rest of the replay is off the count)."""
    pc = time.perf_counter
    prompts, outputs, C = trace.prompts, trace.outputs, trace.concurrency
    waiting = deque(range(len(prompts)))
    running = []  # list of [state, req_idx, produced]
    step_times = []
    admit_times = []
    refs_released = 0
    hit_blocks = 0
    decode_tokens = 0
    admit = adapter.admit
    dsched = adapter.decode_schedule
    dstep = getattr(adapter, "decode_step", None)
    dpost = adapter.decode_post
    free = adapter.free

    t_start = pc()
    while waiting or running:
        # admissions (prefill bookkeeping)
        while len(running) < C and waiting:
            i = waiting.popleft()
            ta = pc()
            st = admit(i, prompts[i], outputs[i][0])
            admit_times.append(pc() - ta)
            running.append([st, i, 1])
        # decode step: pass 1 = schedule/allocate, pass 2 = post-model append/hash
        full = len(running) == C
        t0 = pc()
        if counted and full:
            functools.reduce(lambda _, __: decode_once(running, outputs, dstep, dsched, dpost),
                             range(1), None)
        else:
            decode_once(running, outputs, dstep, dsched, dpost)
        t1 = pc()
        if full:
            step_times.append(t1 - t0)
        decode_tokens += len(running)
        # finishes
        nxt = []
        for ent in running:
            if ent[2] >= len(outputs[ent[1]]):
                n, h = free(ent[0])
                refs_released += n
                hit_blocks += h
            else:
                nxt.append(ent)
        running = nxt
    wall = pc() - t_start
    if not adapter.check_all_free():
        raise RuntimeError(f"{adapter.name}: blocks leaked after replay")
    fresh_allocs = refs_released - hit_blocks
    return {
        "wall_s": wall,
        "fresh_allocs": fresh_allocs,
        "refs_released": refs_released,
        "hit_blocks": hit_blocks,
        "ops_per_s": (fresh_allocs + refs_released) / wall if refs_released else float("nan"),
        "step_us_median": statistics.median(step_times) * 1e6 if step_times else float("nan"),
        "step_us_p90": float(np.percentile(step_times, 90)) * 1e6 if step_times else float("nan"),
        "full_steps": len(step_times),
        "admit_us_median": statistics.median(admit_times) * 1e6,
        "decode_tokens": decode_tokens,
        "admissions": len(admit_times),
    }


def decode_once(running, outputs, dstep, dsched, dpost):
    """One decode step of `running`: pass 1 = schedule/allocate, pass 2 = post-model
    append/hash."""
    if dstep is not None:
        dstep([ent[0] for ent in running])
    else:
        for ent in running:
            dsched(ent[0])
    for ent in running:
        dpost(ent[0], outputs[ent[1]][ent[2]])
        ent[2] += 1


def count_instructions(args, impls, scen):
    """`--instructions`: each (scenario, impl) replayed in a process of its own under
    valgrind's callgrind, after one uncounted replay (imports, numba's compiled loops,
    the anchors' first calls), with the cyclic GC off and ``PYTHONHASHSEED=0``; prints the
    instructions of one full decode step (the same two passes `step_us` times), the mean
    over the replay's full steps. A count does not move with the machine's load, as wall
    time does (up to 2x between processes on a shared machine)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("alloc_bench: --instructions needs valgrind on the PATH "
                         "(Debian: apt-get install valgrind)")
    counts = {s: {} for s in scen}
    for s in scen:
        for impl in impls:
            counts[s][impl] = _count_one(valgrind, impl, s)
    print(f"\ninstructions per full decode step ({args.concurrency} sequences), callgrind; "
          "ratios against vllm (net: both less the null harness's own)")
    for s in scen:
        found = counts[s]
        base, floor = found.get("vllm"), found.get("null", 0.0)
        for impl, per_step in found.items():
            ratio = f"{per_step / base:6.3f}x" if base else "      -"
            net = (f"{(per_step - floor) / (base - floor):6.3f}x"
                   if base and "null" in found and impl != "null" else "      -")
            print(f"{s:8} {impl:22} {per_step / 1e6:8.3f} M  {ratio}  net {net}")


def _count_one(valgrind, impl, scenario):
    """The mean instructions of one full decode step of `impl` in `scenario`: this script
    again under callgrind (`counted_run`), collecting inside `functools.reduce` alone."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "callgrind.out"
        argv = [a for a in sys.argv[1:] if a != "--instructions"]
        run = subprocess.run(
            [valgrind, "--tool=callgrind", "--collect-atstart=no",
             "--toggle-collect=functools_reduce", f"--callgrind-out-file={out}",
             sys.executable, os.path.abspath(__file__), *argv, "--impls", impl,
             "--scenarios", scenario, "--counted-run"],
            capture_output=True, text=True, check=False,
            env={**os.environ, "PYTHONHASHSEED": "0"})
        steps = re.search(r"^counted full steps: (\d+)$", run.stdout, re.M)
        total = (re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.M)
                 if out.exists() else None)
        if run.returncode or steps is None or total is None:
            raise SystemExit(f"alloc_bench: the counted run of {impl} failed:\n"
                             f"{run.stderr[-3000:]}")
    return int(total.group(1)) / int(steps.group(1))


def counted_run(args, impls, scen, mods, traces, num_blocks):
    """The process `count_instructions` runs under callgrind: one uncounted replay, then
    one whose full decode steps are counted."""
    impl, trace = impls[0], traces[scen[0]]
    replay(ADAPTERS[impl](mods, num_blocks, args.block_size), trace)
    gc.collect()
    gc.disable()
    result = replay(ADAPTERS[impl](mods, num_blocks, args.block_size), trace, counted=True)
    print(f"counted full steps: {result['full_steps']}")


# --------------------------------------------------------------------------
def load_anchor_modules(anchors_dir, impls):
    anchors_dir = os.path.abspath(anchors_dir)
    deps = os.path.join(anchors_dir, "_deps")
    for p in (deps, anchors_dir):
        if os.path.isdir(p) and p not in sys.path:
            sys.path.insert(0, p)
    mods = {}
    if any(i.startswith("nanovllm") for i in impls):
        import nanovllm.engine.block_manager as nano_bm
        import nanovllm.engine.sequence as nano_seq
        mods["nano_bm"], mods["nano_seq"] = nano_bm, nano_seq
    if any(i.startswith("vllm") for i in impls):
        import vllm.utils.hashing as vllm_hashing
        import vllm.v1.core.block_pool as vllm_bp
        import vllm.v1.core.kv_cache_utils as vllm_ku
        mods["vllm_bp"], mods["vllm_ku"], mods["vllm_hashing"] = vllm_bp, vllm_ku, vllm_hashing
        # xxhash NONE_HASH seeding logs a warning when PYTHONHASHSEED is unset.
        logging.getLogger(vllm_ku.__name__).setLevel(logging.ERROR)
    for k, m in mods.items():
        if not os.path.abspath(m.__file__).startswith(anchors_dir):
            raise RuntimeError(f"{k} imported from {m.__file__}, not from {anchors_dir}")
    return mods


def trace_stats(tr):
    pl = np.array([len(p) for p in tr.prompts])
    ol = np.array([len(o) for o in tr.outputs])
    return {
        "requests": len(pl),
        "prompt_mean": float(pl.mean()), "prompt_p50": float(np.median(pl)),
        "prompt_p99": float(np.percentile(pl, 99)), "prompt_max": int(pl.max()),
        "output_mean": float(ol.mean()), "output_p50": float(np.median(ol)),
        "output_max": int(ol.max()),
        "shared_prompts": int(sum(tr.shared_mask)),
    }


def print_paired(results, scen, impls):
    """Each impl's wall time over the first impl's in the same repeat: median [min-max]."""
    base = impls[0]
    print(f"\nwall time over {base}, paired by repeat: median [min-max]")
    for s in scen:
        for impl in impls[1:]:
            ratios = sorted(r["wall_s"] / b["wall_s"]
                            for r, b in zip(results[s][impl], results[s][base], strict=True))
            print(f"{s:8} {impl:16} {statistics.median(ratios):.3f} "
                  f"[{ratios[0]:.3f}-{ratios[-1]:.3f}] over {len(ratios)} repeats")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--anchors", default=os.environ.get("ALLOC_ANCHORS_DIR"),
                    help="extraction dir of the anchor sources (or env ALLOC_ANCHORS_DIR)")
    ap.add_argument("--impls", default=",".join(ALL_IMPLS))
    ap.add_argument("--scenarios", default="noshare,share")
    ap.add_argument("--requests", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--share-frac", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up replays per (impl, scenario)")
    ap.add_argument("--no-gc", action="store_true", help="disable the cyclic GC during replays")
    ap.add_argument("--json", help="write raw results here")
    ap.add_argument("--paired", action="store_true",
                    help="also print each impl's wall time over the first impl's, paired by repeat "
                         "(adjacent replays: drift and a neighbour's load cancel more than in a "
                         "ratio of medians)")
    ap.add_argument("--instructions", action="store_true",
                    help="instead of timing, count the instructions of one full decode step "
                         "of each impl under valgrind's callgrind (one process each)")
    ap.add_argument("--counted-run", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    impls = [s for s in args.impls.split(",") if s]
    for i in impls:
        if i not in ADAPTERS:
            ap.error(f"unknown impl {i}; choose from {ALL_IMPLS}")
    if any(i != "null" for i in impls) and not args.anchors:
        ap.error("--anchors DIR (or ALLOC_ANCHORS_DIR) is required")
    mods = load_anchor_modules(args.anchors, impls) if args.anchors else {}
    PagedKvGroupsAdapter.concurrency = args.concurrency

    noshare, share = make_traces(args.requests, args.concurrency, args.block_size,
                                 args.seed, args.share_frac)
    traces = {"noshare": noshare, "share": share}
    scen = [s for s in args.scenarios.split(",") if s]
    peak = peak_blocks(noshare)
    num_blocks = math.ceil(peak * 1.1)

    print(f"python {platform.python_version()} on {platform.machine()}, "
          f"nproc={os.cpu_count()}, gc={'off' if args.no_gc else 'on'}")
    for s in scen:
        print(f"trace {s}: {trace_stats(traces[s])}")
    print(f"peak blocks in use (noshare) = {peak}; pool num_blocks = {num_blocks} "
          f"(vLLM: +1 null block); block_size = {args.block_size}; concurrency = {args.concurrency}")

    if args.instructions:
        count_instructions(args, impls, scen)
        return
    if args.counted_run:
        counted_run(args, impls, scen, mods, traces, num_blocks)
        return
    results = {s: {i: [] for i in impls} for s in scen}

    def one(impl, s):
        gc.collect()
        ad = ADAPTERS[impl](mods, num_blocks, args.block_size)
        if args.no_gc:
            gc.disable()
        try:
            return replay(ad, traces[s])
        finally:
            gc.enable()

    for _ in range(args.warmup):
        for s in scen:
            for impl in impls:
                one(impl, s)
    for rep in range(args.repeats):
        order = impls[rep % len(impls):] + impls[:rep % len(impls)]  # rotate to spread drift
        for s in scen:
            for impl in order:
                results[s][impl].append(one(impl, s))
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)

    def mm(vals, lo_is_best=True):
        return (min(vals) if lo_is_best else max(vals)), statistics.median(vals)

    print()
    hdr = (f"{'scenario':8} {'impl':16} {'wall_s min/med':>17} {'alloc+free ops/s best/med':>27} "
           f"{'step_us min/med (p90)':>26} {'admit_us min/med':>17} {'allocs':>8} {'frees':>8} {'hits':>7}")
    print(hdr)
    print("-" * len(hdr))
    summary = {}
    for s in scen:
        for impl in impls:
            rs = results[s][impl]
            w = mm([r["wall_s"] for r in rs])
            o = mm([r["ops_per_s"] for r in rs], lo_is_best=False)
            st = mm([r["step_us_median"] for r in rs])
            p90 = statistics.median([r["step_us_p90"] for r in rs])
            ad = mm([r["admit_us_median"] for r in rs])
            r0 = rs[0]
            summary.setdefault(s, {})[impl] = {
                "wall_s_min": w[0], "wall_s_median": w[1],
                "ops_per_s_best": o[0], "ops_per_s_median": o[1],
                "step_us_min": st[0], "step_us_median": st[1], "step_us_p90_median": p90,
                "admit_us_min": ad[0], "admit_us_median": ad[1],
                "fresh_allocs": r0["fresh_allocs"], "refs_released": r0["refs_released"],
                "hit_blocks": r0["hit_blocks"], "full_steps": r0["full_steps"],
                "decode_tokens": r0["decode_tokens"],
            }
            print(f"{s:8} {impl:16} {w[0]:8.3f}/{w[1]:8.3f} {o[0]:13.3e}/{o[1]:13.3e} "
                  f"{st[0]:9.1f}/{st[1]:9.1f} ({p90:7.1f}) {ad[0]:8.1f}/{ad[1]:8.1f} "
                  f"{r0['fresh_allocs']:8d} {r0['refs_released']:8d} {r0['hit_blocks']:7d}")
    if args.paired:
        print_paired(results, scen, impls)
    print(f"\nfull-batch ({args.concurrency}) decode steps per replay: "
          + ", ".join(f"{s}={results[s][impls[0]][0]['full_steps']}" for s in scen))

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "peak_blocks": peak, "num_blocks": num_blocks,
                       "trace_stats": {s: trace_stats(traces[s]) for s in scen},
                       "summary": summary, "raw": results}, f, indent=1)


if __name__ == "__main__":
    main()
