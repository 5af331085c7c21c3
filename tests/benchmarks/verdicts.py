"""The target column of the benchmark tables."""

from __future__ import annotations


def verdict(ratio: float, target: float | None) -> str:
    """``'>= 1.8x ok'`` / ``'>= 10x MISSED'`` for a ratio against its target; empty without one."""
    if target is None:
        return ""
    return f">= {target:g}x " + ("ok" if ratio >= target else "MISSED")
