"""Small statistics helpers shared by jobs: percentiles and a bounded slowest-N list."""

from __future__ import annotations


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """p50/p90/p99/max (nearest-rank) of ``values`` times ``scale``; empty -> {}."""
    if not values:
        return {}
    ordered = sorted(values)
    n = len(ordered)

    def rank(q: float) -> float:
        return round(ordered[min(n - 1, max(0, int(q * n + 0.999999) - 1))] * scale, 3)

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": round(ordered[-1] * scale, 3), "count": n}


def merge_slowest(current: list[dict], new: list[dict], limit: int, key: str = "us") -> list[dict]:
    """Keep the ``limit`` entries with the largest ``key`` (ties by source, deterministic)."""
    merged = sorted(current + new, key=lambda e: (-e[key], e.get("source", "")))
    return merged[:limit]
