"""Size the KV pool from the memory free on its device, as vLLM's ``gpu_memory_utilization``.

The reading is taken once, after the model is loaded, so its weights are already excluded:
the pool gets ``memory_fraction`` of what is free at that moment (vLLM's fraction is of the
device's total, weights included; with nothing else on the device the two agree up to the
weights). CUDA reads ``torch.cuda.mem_get_info``; CPU reads ``MemAvailable`` in
``/proc/meminfo`` (Linux), the RAM the kernel can hand out without swapping.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import CacheConfig

logger = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
DEFAULT_MEMORY_FRACTION = 0.9


def free_memory_bytes(device: str | torch.device) -> int:
    """Bytes free on `device` now: CUDA's free memory, or the host's available RAM.

    Raises
    ------
    ValueError
        For a device kind with no reading (give the engine a `CacheConfig` instead).
    OSError
        On a host without ``/proc/meminfo``.

    Examples
    --------
    >>> free_memory_bytes("cpu") > 0
    True
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        raise ValueError(f"device: cannot read the free memory of a {device.type!r} device; "
                         f"give the engine a CacheConfig instead of memory_fraction")
    for line in MEMINFO.read_text(encoding="ascii").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the file counts kB
    raise OSError(f"{MEMINFO} has no MemAvailable line; give the engine a CacheConfig")


def check_memory_fraction(memory_fraction: float) -> None:
    """Raise ValueError, naming it, unless `memory_fraction` is a number in (0, 1]."""
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, int | float) \
            or not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction: expected a number in (0, 1], got {memory_fraction!r}")


def cache_config_for_free_memory(model: torch.nn.Module,
                                 memory_fraction: float = DEFAULT_MEMORY_FRACTION, *,
                                 block_size: int = 16, device: str | torch.device | None = None,
                                 **overrides) -> CacheConfig:
    """The `model`'s cache config with as many blocks as `memory_fraction` of free memory holds.

    Parameters
    ----------
    model : torch.nn.Module
        Has ``cache_config(num_blocks, block_size, **overrides) -> CacheConfig``.
    memory_fraction : float
        Share of the free memory the pool may take, in (0, 1].
    block_size : int
        Tokens per block.
    device : str or torch.device, optional
        Where the pool goes (default: where the model's parameters are).
    **overrides
        Further `CacheConfig` fields (e.g. ``enable_prefix_caching``).

    Returns
    -------
    CacheConfig
        ``num_blocks = floor(memory_fraction * free / bytes_per_block)``; logged, in blocks and
        tokens, at INFO.

    Raises
    ------
    ValueError
        A fraction outside (0, 1], or too little memory for two blocks (one is the null block).
    """
    check_memory_fraction(memory_fraction)
    if device is None:
        parameter = next(model.parameters(), None)
        device = parameter.device if parameter is not None else torch.device("cpu")
    probe = model.cache_config(num_blocks=2, block_size=block_size, device=device, **overrides)
    free = free_memory_bytes(probe.device)
    # a model with recurrent layers: its state slab comes out of the same budget first
    num_blocks = (int(memory_fraction * free) - probe.state_bytes) // probe.bytes_per_block
    if num_blocks < 2:
        slab = f" beside a state slab of {probe.state_bytes} bytes" if probe.state_bytes else ""
        raise ValueError(f"memory_fraction={memory_fraction} of the {free} bytes free on "
                         f"{probe.device} holds {num_blocks} blocks of {probe.bytes_per_block} "
                         f"bytes{slab}; at least 2 are needed: raise memory_fraction or free "
                         f"memory")
    config = model.cache_config(num_blocks=num_blocks, block_size=block_size,
                                device=probe.device, **overrides)
    logger.info("# %s blocks: %d of %d tokens = %d tokens, %.2f GiB (memory_fraction %g of "
                "%.2f GiB free)", probe.device.type.upper(), config.num_usable_blocks,
                block_size, config.num_usable_blocks * block_size, config.total_bytes / 2**30,
                memory_fraction, free / 2**30)
    if config.layer_kinds:  # blocks x block_size says little when windows give blocks back
        logger.info("# fits: %s", capacity(config))
    if config.num_state_slots:
        logger.info("# %s", state_line(config))
    return config


def state_line(config: CacheConfig, max_num_seqs: int | None = None) -> str:
    """One line on the state slab of a model with recurrent layers: its slots, their
    bytes, and how many prefix checkpoints fit beside the live states of `max_num_seqs`
    sequences (each a slot).

    Examples
    --------
    >>> import torch
    >>> from paged_kv.config import LayerKind, StateSpec
    >>> rec = LayerKind.recurrent((StateSpec("ssm", (64, 1024), torch.float32),))
    >>> cfg = CacheConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=16,
    ...                   num_blocks=64, num_state_slots=128, layer_kinds=(rec, LayerKind()))
    >>> head, tail = state_line(cfg, max_num_seqs=64).split(": live ")
    >>> head
    'state slab: 128 slots of 0.25 MiB (32.0 MiB)'
    >>> tail
    'states of 64 sequences, 64 prefix checkpoints'
    """
    slots, per_slot = config.num_state_slots, config.state_bytes_per_slot
    live = slots if max_num_seqs is None else min(max_num_seqs, slots)
    return (f"state slab: {slots} slots of {per_slot / 2**20:.2f} MiB "
            f"({config.state_bytes / 2**20:.1f} MiB): live states of {live} sequences, "
            f"{slots - live} prefix checkpoints")


def capacity(config: CacheConfig, lengths: tuple[int, ...] = (2048, 8192, 32768, 131072),
             ) -> str:
    """How many sequences of each length the pool holds at once in decode, every layer
    group's blocks counted (window groups only their window's): a hybrid layout's real
    capacity, which ``blocks x block_size`` understates.

    Examples
    --------
    >>> from paged_kv.config import LayerKind
    >>> cfg = CacheConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=16,
    ...                   num_blocks=1025, layer_kinds=(LayerKind.sliding(64), LayerKind()))
    >>> capacity(cfg, (1024,))
    '14 sequences of 1024 tokens (14336 tokens)'
    """
    fits = [(config.num_usable_blocks // config.blocks_for_sequence(length, 1), length)
            for length in lengths]
    return ", ".join(f"{count} sequences of {length} tokens ({count * length} tokens)"
                     for count, length in fits if count)


def pool_config(model: torch.nn.Module, *, block_size: int, memory_mib: float,
                memory_fraction: float | None = None, preemption: str = "recompute",
                kv_cache_dtype: str = "auto") -> tuple[CacheConfig, int]:
    """The pool `paged-kv demo` and `serve` run on, and its byte budget: `memory_mib` of
    K/V, or `memory_fraction` of the free memory; a host pool as large for swap.

    Raises
    ------
    ValueError
        `memory_mib` holds fewer than 2 blocks (one is the null block).
    """
    probe = model.cache_config(num_blocks=2, block_size=block_size, kv_cache_dtype=kv_cache_dtype)
    if memory_fraction is not None:
        num_blocks = cache_config_for_free_memory(model, memory_fraction, block_size=block_size,
                                                  kv_cache_dtype=kv_cache_dtype).num_blocks
        budget = num_blocks * probe.bytes_per_block
    else:
        budget = int(memory_mib * 2**20)
        num_blocks = (budget - probe.state_bytes) // probe.bytes_per_block
    if num_blocks < 2:
        raise ValueError(f"argument --memory-mib: {memory_mib} MiB holds {num_blocks} KV "
                         f"blocks of {probe.bytes_per_block} bytes; need at least 2")
    config = model.cache_config(num_blocks=num_blocks, block_size=block_size,
                                num_host_blocks=num_blocks if preemption == "swap" else 0,
                                kv_cache_dtype=kv_cache_dtype)
    return config, budget


def given_or_sized(model: torch.nn.Module, cache_config: CacheConfig | None,
                   memory_fraction: float | None) -> CacheConfig:
    """The engine's cache config: `cache_config` as given, or (None) sized from
    `memory_fraction` of the free memory (`cache_config_for_free_memory`; default
    `DEFAULT_MEMORY_FRACTION`).

    Raises
    ------
    ValueError
        When both are given.
    """
    if cache_config is not None and memory_fraction is not None:
        raise ValueError("memory_fraction: give it or cache_config, not both")
    if cache_config is not None:
        return cache_config
    return cache_config_for_free_memory(
        model, DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction)
