"""Statistics of token datasets, apart from the text job so that the readers' side (the Megatron sink's
``inspect``, `repack remove`, the report) uses them without importing it: document lengths (percentiles, a
power-of-two histogram) and the per-file token table."""

from __future__ import annotations

from typing import Callable

import numpy as np

from repack.jobs.stats import bucket_edges
from repack.jobs.stats import histogram as half_octave_histogram

FILES_LISTED = 20  # stats.files.largest: the files with the most tokens


def file_table(documents: np.ndarray, tokens: np.ndarray, name: Callable[[int], str]) -> dict:
    """``stats.files`` of files with ``documents`` and ``tokens`` each (``name(i)``: file ``i``'s source): their
    count, a half-octave histogram of their tokens and the largest files."""
    edges, counts = np.unique(bucket_edges(tokens), return_counts=True) if len(tokens) else ([], [])
    top = np.zeros(0, np.int64)
    if len(tokens):  # ties on the last place listed by name: every file with at least that many tokens
        listed = min(FILES_LISTED, len(tokens))
        floor = np.partition(tokens, len(tokens) - listed)[len(tokens) - listed]  # O(n), not a sort of every file
        top = np.flatnonzero(tokens >= floor)
    largest = sorted(((-int(tokens[i]), name(i), int(documents[i])) for i in top.tolist()))
    return {"count": len(tokens),
            "tokens_histogram": half_octave_histogram({str(int(e)): int(c) for e, c in zip(edges, counts)}),
            "largest": [{"source": rel, "documents": d, "tokens": -t} for t, rel, d in largest[:FILES_LISTED]]}


def token_stats(lengths: np.ndarray) -> tuple[dict, list[dict]]:
    """Nearest-rank p50/p90/p99/max/mean of document lengths, and a power-of-two histogram."""
    if not len(lengths):
        return {}, []
    n = len(lengths)
    ranks = sorted({min(n - 1, max(0, int(np.ceil(q * n)) - 1)) for q in (0.5, 0.9, 0.99)})
    part = np.partition(lengths, ranks)
    value = {r: int(part[r]) for r in ranks}

    def rank(q: float) -> int:
        return value[min(n - 1, max(0, int(np.ceil(q * n)) - 1))]

    stats = {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": int(lengths.max()),
             "min": int(lengths.min()), "mean": round(float(lengths.mean(dtype=np.float64)), 3), "count": n}
    buckets = np.bincount(np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64))
    histogram = [{"from": 2**k, "to": 2 ** (k + 1) - 1, "documents": int(c)}
                 for k, c in enumerate(buckets) if c]
    return stats, histogram
