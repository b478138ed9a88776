"""The argument types of the ``paged-kv`` command line: each parses a flag's text or
raises `argparse.ArgumentTypeError` naming what was wrong, so a bad flag exits 2 before
anything starts."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["api_keys", "at_least", "model_dir", "redis_url", "writable_dir"]


def at_least(kind: Callable[[str], float], low: float, strict: bool = False):
    """An argparse type: `kind` of the text, at least `low` (above it with `strict`)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(
                f"expected {'>' if strict else '>='} {low}, got {text}")
        return value
    return parse


def model_dir(text: str) -> str:
    """An argparse type: a local checkpoint directory whose config the engine serves."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory (a local Hugging Face "
                                         "checkpoint: config.json and weights)")
    try:  # refuse a model the kernels would serve wrong tokens, before anything starts
        from .engine.hf import UnsupportedModelError, check_checkpoint
    except ImportError:  # no hf extra: loading the model says so
        return text
    try:
        check_checkpoint(text)
    except UnsupportedModelError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except (OSError, ValueError):  # no readable config.json: loading it names the problem
        pass
    return text


def api_keys(text: str):
    """An argparse type: the tenants file's parsed keys and policy."""
    from .server.tenants_file import read_tenants_file

    try:
        return read_tenants_file(text)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def writable_dir(text: str) -> str:
    """An argparse type: a directory made if missing, that this process may write."""
    try:
        os.makedirs(text, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: {exc.strerror}") from None
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not a writable directory")
    return text


def redis_url(text: str) -> str:
    """An argparse type: a ``redis://`` or ``rediss://`` URL with a host."""
    if not text.startswith(("redis://", "rediss://")) or len(text.split("://", 1)[1]) == 0:
        raise argparse.ArgumentTypeError(f"expected redis://HOST:PORT/DB, got {text!r}")
    return text
