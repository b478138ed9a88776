"""Compiled row loops for the CPU copies: `write_kv`'s scatter, the gathers and `copy_blocks`.

The torch paths (`rows`, `copy`) pay a torch or numpy call per run of rows, or walk
elements one by one (``index_copy_``); a loop compiled by numba (the optional ``fast``
extra) pays nanoseconds a row and moves each row, block or run of blocks as one copy of
bytes, so any dtype moves bit for bit (NaN payloads, signalling ones included: nothing is
computed on). Each loop validates every id before it copies anything, and returns what
it found instead of raising (numba raises without the value); the wrappers here raise
``IndexError`` naming it, with the pool untouched.

Used when numba imports and ``PAGED_KV_NUMBA`` is not ``0`` (read at each call, as
``PAGED_KV_BACKEND`` is); the wrappers return False where they do not apply (numba
missing or switched off, tensors that are not contiguous CPU ones, autograd), and the
caller takes its torch path, which stays the reference. Loops run on one thread
(``nogil``, never ``parallel``: the caller's torch thread count is the setting) and are
compiled on first use, then cached beside this file (``__pycache__``): a process's first
call costs ~0.7 s with the cache (numba's own start), 3-4 s for the four ops without it.

Moving bytes: ``llvm.memcpy``, which becomes a call to the C library's ``memcpy`` when the
size is only known at run time. That is the fastest copy measured here for 8 KiB and more,
but slower than an inlined copy around 2 KiB (25 MB in 2 KiB rows at scattered places: 4.65
ms by ``memcpy``, 2.99 ms by 256-byte inlined chunks), so smaller copies go as 256-byte
chunks of fixed size (vector moves, inlined by LLVM) and a ``memcpy`` of the rest.

Ops that write more than the last-level cache can keep (3/4 of it, glibc's rule for its
own ``memcpy``; `streaming_bytes`) store with non-temporal (streaming) stores: a normal
store first reads the line it writes (read for ownership), so a copy moves three bytes
for each one copied; streaming stores skip that read and do not evict the cache for data
that would not fit in it anyway. One fence after the loop orders them as normal stores
for whatever reads the output next (another thread included). ``dst.copy_(src)`` stores
normally: on the kernels workload it took 1.4x a streaming copy's time of the same bytes,
which is why these ops can pass it (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import os
import pathlib
import platform

import numpy as np
import torch

try:
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # the `fast` extra is not installed: the torch paths
    numba = None

# copies of this many bytes or more call memcpy whole; smaller ones go in inlined chunks
_MEMCPY_BYTES = 8 << 10
_CHUNK_BYTES = 256
# the gathers and copy_blocks read blocks at scattered places: the first lines of the next
# one are asked for before the current one is copied (the hardware prefetcher starts each
# block cold). 512 bytes measured best of 512 B - 32 KiB (+7-9% on the kernels workload)
_PREFETCH_BYTES = 512


@functools.cache
def streaming_bytes() -> int:
    """Writes of this many bytes or more (an op's, K and V together) use streaming stores:
    3/4 of the largest CPU cache Linux reports (sysfs), or of 32 MiB where it reports
    none."""
    sizes = [32 << 20]
    for index in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes[1:] or sizes) * 3 // 4


def stream_alignment(tensor: torch.Tensor, nbytes: int) -> int:
    """The loops' `stream_align` argument for writing `nbytes` into `tensor`: its address
    modulo 64 when the write is large enough to stream (`streaming_bytes`), else -1."""
    return tensor.data_ptr() % 64 if nbytes >= streaming_bytes() else -1


def is_enabled() -> bool:
    """Whether the compiled loops run: numba imports and ``PAGED_KV_NUMBA`` is not ``0``."""
    return numba is not None and os.environ.get("PAGED_KV_NUMBA", "1") != "0"


def as_bytes(tensor: torch.Tensor) -> np.ndarray | None:
    """A contiguous CPU tensor's memory as a one-dimensional uint8 numpy array (the same
    memory, no copy), or None where the compiled loops may not touch it."""
    if not tensor.is_cpu or not tensor.is_contiguous() or tensor.requires_grad \
            or tensor.is_conj() or tensor.is_neg():
        return None
    # numpy's own dtypes go through numpy's views (a µs less than torch's, per call and
    # tensor); bfloat16 and float8, which numpy lacks, through torch's
    array = tensor.numpy() if tensor.dtype in _NUMPY_DTYPES else tensor.view(torch.uint8).numpy()
    return array.reshape(-1).view(np.uint8)


_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.uint8,
                           torch.int8, torch.int16, torch.int32, torch.int64})


if numba is not None:

    def _copy_intrinsic(fixed_bytes: int):
        """An intrinsic ``(dst, dst_start, src, src_start, nbytes)`` copying bytes of two
        uint8 arrays with ``llvm.memcpy``; ``nbytes`` is ignored when `fixed_bytes` is
        nonzero (a size known at compile time, which LLVM inlines as vector moves)."""

        @intrinsic
        def copy(typingctx, dst, dst_start, src, src_start, nbytes):
            signature = types.void(dst, types.intp, src, types.intp, types.intp)

            def codegen(context, builder, sig, args):
                dst_array = context.make_array(sig.args[0])(context, builder, args[0])
                src_array = context.make_array(sig.args[2])(context, builder, args[2])
                count = ir.Constant(ir.IntType(64), fixed_bytes) if fixed_bytes else args[4]
                cgutils.raw_memcpy(builder, builder.gep(dst_array.data, [args[1]]),
                                   builder.gep(src_array.data, [args[3]]), count, 1)
                return context.get_dummy_value()

            return signature, codegen

        return copy

    _memcpy = _copy_intrinsic(0)
    _chunk = _copy_intrinsic(_CHUNK_BYTES)
    _jit = numba.njit(cache=True, nogil=True)

    @intrinsic
    def _stream64(typingctx, dst, dst_start, src, src_start, nbytes):
        """Copy `nbytes` (a multiple of 64) from `src` to a 64-byte aligned place of `dst`
        in 64-byte vectors, stored non-temporally (``!nontemporal``: ``vmovntdq`` on x86)."""
        signature = types.void(dst, types.intp, src, types.intp, types.intp)

        def codegen(context, builder, sig, args):
            dst_array = context.make_array(sig.args[0])(context, builder, args[0])
            src_array = context.make_array(sig.args[2])(context, builder, args[2])
            first_dst = builder.gep(dst_array.data, [args[1]])
            first_src = builder.gep(src_array.data, [args[3]])
            vector = ir.VectorType(ir.IntType(64), 8)
            nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
            count = builder.udiv(args[4], ir.Constant(ir.IntType(64), 64))
            with cgutils.for_range(builder, count) as loop:
                offset = builder.mul(loop.index, ir.Constant(ir.IntType(64), 64))
                source = builder.bitcast(builder.gep(first_src, [offset]), vector.as_pointer())
                target = builder.bitcast(builder.gep(first_dst, [offset]), vector.as_pointer())
                store = builder.store(builder.load(source, align=1), target, align=64)
                store.set_metadata("nontemporal", nontemporal)
            return context.get_dummy_value()

        return signature, codegen

    @intrinsic
    def _store_fence(typingctx):
        """Order the streaming stores before later stores: ``sfence`` on x86, a full
        fence elsewhere."""

        def codegen(context, builder, sig, args):
            if platform.machine().lower() in ("x86_64", "amd64"):
                fence = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence")
                builder.call(fence, [])
            else:
                builder.fence("seq_cst")
            return context.get_dummy_value()

        return types.void(), codegen

    @intrinsic
    def _prefetch(typingctx, array, start):
        """Ask for the cache line of ``array[start]`` ahead of its read (``llvm.prefetch``:
        read, keep in all levels)."""

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            byte_pointer = ir.IntType(8).as_pointer()
            signature = ir.FunctionType(ir.VoidType(), [byte_pointer, *[ir.IntType(32)] * 3])
            prefetch = cgutils.get_or_insert_function(builder.module, signature,
                                                      "llvm.prefetch.p0i8")
            builder.call(prefetch, [builder.bitcast(builder.gep(data, [args[1]]), byte_pointer),
                                    *(ir.Constant(ir.IntType(32), flag) for flag in (0, 3, 1))])
            return context.get_dummy_value()

        return types.void(array, types.intp), codegen

    @_jit
    def _prefetch_start(array, start):  # pragma: no cover - compiled
        """The first `_PREFETCH_BYTES` of the copy that starts at ``array[start]``."""
        for line in range(0, _PREFETCH_BYTES, 64):
            _prefetch(array, start + line)

    @_jit
    def _copy_bytes(dst, dst_start, src, src_start, nbytes):  # pragma: no cover - compiled
        """``dst[dst_start:][:nbytes] = src[src_start:][:nbytes]`` (no overlap)."""
        if nbytes < _MEMCPY_BYTES:
            while nbytes >= _CHUNK_BYTES:
                _chunk(dst, dst_start, src, src_start, 0)
                dst_start += _CHUNK_BYTES
                src_start += _CHUNK_BYTES
                nbytes -= _CHUNK_BYTES
        if nbytes > 0:
            _memcpy(dst, dst_start, src, src_start, nbytes)

    @_jit
    def _move(dst, dst_start, src, src_start, nbytes, stream_align):  # pragma: no cover
        """`_copy_bytes`, or with streaming stores when `stream_align` (the address of
        `dst` modulo 64) is not -1: the bytes before the first 64-byte boundary and after
        the last go by `_copy_bytes`."""
        if stream_align < 0:
            _copy_bytes(dst, dst_start, src, src_start, nbytes)
            return
        head = min((64 - (stream_align + dst_start) % 64) % 64, nbytes)
        body = (nbytes - head) // 64 * 64
        if head:
            _copy_bytes(dst, dst_start, src, src_start, head)
        if body:
            _stream64(dst, dst_start + head, src, src_start + head, body)
        if nbytes > head + body:
            _copy_bytes(dst, dst_start + head + body, src, src_start + head + body,
                        nbytes - head - body)

    @_jit
    def _scatter_loop(target, slots, source, row_bytes, skip_negative,
                      stream_align):  # pragma: no cover - compiled
        """Row ``i`` of `source` into row ``slots[i]`` of `target` (rows of `row_bytes`);
        negative slots are skipped when `skip_negative`; `stream_align` as `_move` takes it.
        Returns the index of the first bad slot, before copying anything, or -1.

        Consecutive slots (a prefill's tokens within a block, or a fresh pool's blocks) move
        as one copy: a 32 KiB block in one ``memcpy`` instead of 16 rows of 2 KiB."""
        num_slots = target.size // row_bytes
        for i in range(slots.size):
            slot = slots[i]
            if slot >= num_slots or (slot < 0 and not skip_negative):
                return i
        i = 0
        while i < slots.size:
            if slots[i] < 0:
                i += 1
                continue
            end = i + 1
            while end < slots.size and slots[end] == slots[end - 1] + 1:
                end += 1
            _move(target, slots[i] * row_bytes, source, i * row_bytes, (end - i) * row_bytes,
                  stream_align)
            i = end
        if stream_align >= 0:
            _store_fence()
        return -1

    @_jit
    def _gather_check(num_blocks, block_tables, seq_lens, starts, num_rows, block_size,
                      span):  # pragma: no cover - compiled
        """0 when every sequence's blocks lie in the pool and its rows (`span` of them, or
        its length when `span` is 0) in the output; 1 for a block past the pool (the
        caller raises), 2 for what the torch path decides (lengths past the table, spans
        past the output)."""
        for b in range(seq_lens.size):
            length = seq_lens[b]
            rows = span if span else length
            if length < 0 or length > rows or starts[b] < 0 or starts[b] + rows > num_rows \
                    or length > block_tables.shape[1] * block_size:
                return 2
            for column in range((length + block_size - 1) // block_size):
                if block_tables[b, column] < 0 or block_tables[b, column] >= num_blocks:
                    return 1
        return 0

    @_jit
    def _gather_loop(key_cache, value_cache, block_tables, seq_lens, starts, key_out,
                     value_out, block_size, row_bytes, span,
                     stream_align):  # pragma: no cover - compiled
        """Each sequence's tokens, a block's worth (or the last block's tokens) a copy, from
        the pages into its rows of the outputs (rows of `row_bytes`), K then V; with a
        `span`, the rows from its length to `span` are zeroed (the padded form). Checked
        with `_gather_check` first (returned here: nothing is copied unless 0).
        `stream_align`: as `_move` takes it, the outputs' (both: K's and V's addresses
        agree modulo 64, or the caller passes -1)."""
        status = _gather_check(key_cache.size // (block_size * row_bytes), block_tables,
                               seq_lens, starts, key_out.size // row_bytes, block_size, span)
        if status:
            return status
        block_bytes = block_size * row_bytes
        for b in range(seq_lens.size):
            length = seq_lens[b]
            for cache, out in ((key_cache, key_out), (value_cache, value_out)):
                position = starts[b] * row_bytes
                num_columns = (length + block_size - 1) // block_size
                for column in range(num_columns):
                    if column + 1 < num_columns:
                        _prefetch_start(cache, block_tables[b, column + 1] * block_bytes)
                    nbytes = min(block_size, length - column * block_size) * row_bytes
                    _move(out, position, cache, block_tables[b, column] * block_bytes, nbytes,
                          stream_align)
                    position += nbytes
                if span > length:
                    out[position:(starts[b] + span) * row_bytes] = 0
        if stream_align >= 0:
            _store_fence()
        return 0

    @_jit
    def _copy_blocks_loop(pool, src_block_ids, dst_block_ids, num_planes, block_bytes,
                          stream_align):  # pragma: no cover - compiled
        """Block ``dst[i]`` <- block ``src[i]`` in each of the `num_planes` planes of
        `pool`, ids that step by one on both sides moved as one copy; `stream_align` as
        `_move` takes it. Returns the index of the first pair with an id past the pool,
        before copying anything, or -1."""
        plane_bytes = pool.size // num_planes
        num_blocks = plane_bytes // block_bytes
        for i in range(src_block_ids.size):
            if min(src_block_ids[i], dst_block_ids[i]) < 0 \
                    or max(src_block_ids[i], dst_block_ids[i]) >= num_blocks:
                return i
        for plane in range(num_planes):
            base = plane * plane_bytes
            i = 0
            while i < src_block_ids.size:
                end = i + 1
                while end < src_block_ids.size \
                        and src_block_ids[end] == src_block_ids[end - 1] + 1 \
                        and dst_block_ids[end] == dst_block_ids[end - 1] + 1:
                    end += 1
                if end < src_block_ids.size:
                    _prefetch_start(pool, base + src_block_ids[end] * block_bytes)
                _move(pool, base + dst_block_ids[i] * block_bytes, pool,
                      base + src_block_ids[i] * block_bytes, (end - i) * block_bytes,
                      stream_align)
                i = end
        if stream_align >= 0:
            _store_fence()
        return -1


def _ids(ids: torch.Tensor) -> np.ndarray | None:
    """Integer ids as a one-dimensional (or table) numpy array, or None off the CPU."""
    if not ids.is_cpu or ids.dtype not in (torch.int64, torch.int32):
        return None
    return ids.contiguous().numpy()


def scatter_rows(target: torch.Tensor, index: torch.Tensor, source: torch.Tensor, *,
                 skip_negative: bool = False, op_bytes: int | None = None) -> bool:
    """``target[index[i]] = source[i]`` for each row, bit for bit, in a compiled loop;
    returns whether it ran (False: the caller's torch path).

    Parameters
    ----------
    target : torch.Tensor
        ``[num_slots, ...]`` contiguous CPU rows (a layer's pages viewed as slots).
    index : torch.Tensor
        ``[N]`` int64 or int32 rows of `target`.
    source : torch.Tensor
        ``[N, ...]`` contiguous, `target`'s dtype and row shape.
    skip_negative : bool
        Negative indices skip their row (`write_kv`'s padding) instead of raising.
    op_bytes : int, optional
        Bytes the whole op writes (`write_kv`: K and V), which decide streaming stores
        (`streaming_bytes`); default `source`'s.

    Raises
    ------
    IndexError
        An index past `target` (or negative, unless skipped), before anything is copied.

    Mutates
    -------
    target at the indexed rows only.
    """
    if not is_enabled() or source.dtype != target.dtype or source.dim() != target.dim() \
            or source.shape[1:] != target.shape[1:] or index.dim() != 1 \
            or index.shape[0] != source.shape[0]:
        return False
    target_bytes, source_bytes, slots = as_bytes(target), as_bytes(source), _ids(index)
    if target_bytes is None or source_bytes is None or slots is None:
        return False
    if target.numel() == 0 or index.numel() == 0:  # nothing to move: the torch path's
        return False
    row_bytes = target_bytes.size // target.shape[0]
    stream_align = stream_alignment(target, source_bytes.size if op_bytes is None else op_bytes)
    bad = _scatter_loop(target_bytes, slots, source_bytes, row_bytes, skip_negative,
                        stream_align)
    if bad >= 0:
        raise IndexError(f"index {int(slots[bad])} (entry {bad}) is out of bounds for "
                         f"{target.shape[0]} rows; nothing was copied")
    return True


def gather_rows(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, starts: torch.Tensor | None,
                out: tuple[torch.Tensor, torch.Tensor], span: int = 0) -> bool:
    """Copy each sequence's K and V tokens from the pages into its rows of `out`, a block's
    worth of tokens a copy, in a compiled loop; returns whether it ran (False: the torch
    path, which also decides lengths past the table and spans past the output).

    Parameters
    ----------
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, H, D]`` contiguous CPU pages.
    block_tables : torch.Tensor
        ``[B, max_blocks]`` int32 (or int64).
    seq_lens : torch.Tensor
        ``[B]`` int32 (or int64).
    starts : torch.Tensor, optional
        ``[B]`` int32 (or int64): each sequence's first row of `out` (packed:
        ``cu_seqlens[:-1]``); None: ``b * span`` (padded).
    out : (torch.Tensor, torch.Tensor)
        Contiguous, the pages' dtype, rows of ``[H, D]``: packed ``[total_tokens, H, D]``
        or padded ``[B, T, H, D]``.
    span : int
        0: only the tokens are written (packed). ``T``: rows from each length to ``T`` are
        zeroed as well (padded, with ``starts = b * T``).

    Raises
    ------
    IndexError
        A block id past the pool in a sequence's blocks, before anything is copied.

    Mutates
    -------
    out at each sequence's rows (and its padding when `span`).
    """
    if not is_enabled() or len({key_cache.dtype, value_cache.dtype, *(o.dtype for o in out)}) != 1 \
            or value_cache.shape != key_cache.shape \
            or any(o.shape[-2:] != key_cache.shape[2:] or o.shape != out[0].shape for o in out):
        return False
    arrays = [as_bytes(t) for t in (key_cache, value_cache, *out)]
    tables, lens = _ids(block_tables), _ids(seq_lens)
    firsts = np.arange(seq_lens.shape[0], dtype=np.int64) * span if starts is None \
        else _ids(starts)
    if any(a is None for a in arrays) or tables is None or lens is None or firsts is None \
            or tables.ndim != 2 or not tables.shape[0] == lens.size == firsts.size \
            or key_cache.numel() == 0 or out[0].shape[:-2] != ((lens.size, span) if span
                                                               else out[0].shape[:1]):
        return False
    row_bytes = key_cache[0, 0].numel() * key_cache.element_size()
    stream_align = stream_alignment(out[0], arrays[2].size + arrays[3].size)
    if stream_align != stream_alignment(out[1], arrays[2].size + arrays[3].size):
        stream_align = -1  # one loop streams both or neither
    status = _gather_loop(arrays[0], arrays[1], tables, lens, firsts, arrays[2], arrays[3],
                          key_cache.shape[1], row_bytes, span, stream_align)
    if status == 1:
        raise IndexError(f"gather: a block id of the tables lies past the pool's "
                         f"{key_cache.shape[0]} blocks; nothing was copied")
    return status == 0


def copy_blocks_compiled(kv_cache: torch.Tensor, src_block_ids: torch.Tensor,
                         dst_block_ids: torch.Tensor) -> bool:
    """`copy_blocks` in a compiled loop: each pair's block, every (layer, K/V) plane, one
    copy of bytes (a run of pairs whose ids step by one: one copy); returns whether it ran
    (False: the torch paths).

    Parameters
    ----------
    kv_cache : torch.Tensor
        ``[num_layers, 2, num_blocks, block_size, H, D]`` contiguous CPU pool.
    src_block_ids, dst_block_ids : torch.Tensor
        ``[num_copies]`` int64; no dst appears twice or among the srcs.

    Raises
    ------
    IndexError
        An id past the pool, before anything is copied.

    Mutates
    -------
    kv_cache at the dst blocks only.
    """
    if not is_enabled() or kv_cache.dim() < 3 or src_block_ids.shape != dst_block_ids.shape \
            or src_block_ids.dim() != 1 or kv_cache.numel() == 0:
        return False
    pool, src, dst = as_bytes(kv_cache), _ids(src_block_ids), _ids(dst_block_ids)
    if pool is None or src is None or dst is None:
        return False
    num_planes, num_blocks = kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[2]
    block_bytes = pool.size // (num_planes * num_blocks)
    bad = _copy_blocks_loop(pool, src, dst, num_planes, block_bytes,
                            stream_alignment(kv_cache, src.size * num_planes * block_bytes))
    if bad >= 0:
        raise IndexError(f"copy_blocks: block ids must lie in [0, {num_blocks}), got "
                         f"{int(src[bad])} -> {int(dst[bad])} (pair {bad}); nothing was copied")
    return True
