"""argparse value types shared by the ``fp8chain`` commands and the benchmark scripts (no torch
import, so ``--help`` stays fast)."""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "non_negative_int", "seed_int"]


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


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "a non-negative integer")
# torch.Generator takes seeds below 2**64 and folds negative ones onto them: one name per checkpoint
seed_int = _int_at_least(0, "a seed in [0, 2**63)", most=2**63 - 1)
