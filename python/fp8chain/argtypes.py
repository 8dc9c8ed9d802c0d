"""argparse value types shared by the ``fp8chain`` commands and the benchmark scripts (no torch
import, so ``--help`` stays fast)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

__all__ = ["positive_int", "non_negative_int", "seed_int", "int_in", "output_dir", "output_dir_problem"]


def _int_at_least(least: int, what: str, most: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"{value} is not {what}")
        return value
    parse.__name__ = what.replace(" ", "_")
    return parse


def int_in(least: int, most: int):
    """An integer from ``least`` to ``most``."""
    return _int_at_least(least, f"an integer from {least} to {most}", most=most)


def output_dir_problem(path) -> str | None:
    """Why ``path`` cannot be a directory a command creates or writes into, or None: it exists and
    is not a directory, or the nearest existing folder above it is not a writable directory."""
    if str(path) == "":  # Path("") is the current directory
        return "'': an empty path"
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{path}: exists and is not a directory"
    parent = next(p for p in (path, *path.parents) if p.exists())  # where mkdir would start
    if not parent.is_dir():
        return f"{path}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path}: {parent} is not writable"
    return None


def output_dir(text: str) -> str:
    """argparse type of an output directory (``output_dir_problem``), checked before any work."""
    problem = output_dir_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"cannot write to {problem}")
    return text


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "a non-negative integer")
# torch.Generator takes seeds below 2**64 and folds negative ones onto them: one name per checkpoint
seed_int = _int_at_least(0, "a seed in [0, 2**63)", most=2**63 - 1)
