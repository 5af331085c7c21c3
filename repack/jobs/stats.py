"""Small statistics helpers shared by jobs: percentiles, a bounded slowest-N list and
half-octave histograms (deterministic integer bucket edges: 1, 2, 3, 4, 6, 8, 12, 16, 24, ...)."""

from __future__ import annotations


def percentiles(values, scale: float = 1.0) -> dict[str, float]:
    """p50/p90/p99/max (nearest-rank) of ``values`` (a sequence or a numpy array) times ``scale``; empty -> {}."""
    import numpy as np

    n = len(values)
    if not n:
        return {}
    ordered = np.sort(np.asarray(values))

    def at(i: int) -> float:
        return round(ordered[i].item() * scale, 3)

    def rank(q: float) -> float:
        return at(min(n - 1, max(0, int(q * n + 0.999999) - 1)))

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": at(n - 1), "count": n}


def merge_slowest(current: list[dict], new: list[dict], limit: int, key: str = "us") -> list[dict]:
    """Keep the ``limit`` entries with the largest ``key`` (ties by source, deterministic)."""
    if new and len(current) >= limit:  # a new entry below every kept one never enters (the driver folds ~8,000 lists)
        floor = min(e[key] for e in current)
        new = [e for e in new if e[key] >= floor]
    merged = sorted(current + new, key=lambda e: (-e[key], e.get("source", "")))
    return merged[:limit]


def bucket(value: int) -> int:
    """The lower edge of ``value``'s half-octave bucket: 2**k or 1.5 * 2**k (0 for values < 1)."""
    value = int(value)
    if value < 1:
        return 0
    base = 1 << (value.bit_length() - 1)
    half = base + (base >> 1)
    return half if base > 1 and value >= half else base


def bucket_edges(values):
    """``bucket`` of each value of an integer numpy array, vectorized."""
    import numpy as np

    values = np.asarray(values, dtype=np.int64)
    positive = np.maximum(values, 1)
    base = np.left_shift(1, np.floor(np.log2(positive)).astype(np.int64))
    base = np.where(base > positive, base >> 1, base)  # float rounding near powers of two
    base = np.where(base * 2 <= positive, base * 2, base)
    half = base + (base >> 1)
    edges = np.where((base > 1) & (positive >= half), half, base)
    return np.where(values < 1, 0, edges)


def count_into(counts: dict[str, int], value: int) -> None:
    """Add ``value`` to a histogram kept as {str(bucket lower edge): count} (JSON-friendly, mergeable)."""
    key = str(bucket(value))
    counts[key] = counts.get(key, 0) + 1


def merge_counts(many) -> dict[str, int]:
    """Sum several {key: count} dicts."""
    total: dict[str, int] = {}
    for counts in many:
        for key, n in counts.items():
            total[key] = total.get(key, 0) + n
    return total


def _next_edge(lower: int) -> int:
    if lower < 2:
        return lower + 1
    return lower + (lower >> 1) if lower & (lower - 1) == 0 else lower * 4 // 3


def histogram(counts: dict[str, int]) -> list[dict]:
    """[{from, to, count}] in bucket order from {str(lower edge): count}; ``to`` is inclusive."""
    return [{"from": lower, "to": _next_edge(lower) - 1, "count": counts[str(lower)]}
            for lower in sorted(int(k) for k in counts)]
