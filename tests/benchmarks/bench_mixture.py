"""Benchmark of issue 18 (items 1 and 4): a mixture's throughput against its sources read alone,
and what checkpointing costs the LMDB, text and video readers (state size, resume time).

Data (generated once into OUT/mixture-data by the real CLI): two LMDB image datasets of
REPACK_BENCH_MIX_PHOTOS (default 30) photos per class (4 and 3 classes), two token memmaps
(1,200 and 600 documents), two VP8 clips. One process, ``num_workers=0`` for the throughput
rows (the machine may have 2 cores shared with others); A, B and the mixture are timed in
turns, best of REPACK_BENCH_MIX_REPEATS (default 5) each.

Rows:
  mix <kind>   samples/s of ``Mixture([(A, 2), (B, 1)])`` against the rate its sources' own rates
               predict for that blend (1 / (2/3 / rate_A + 1/3 / rate_B)); target ratio >= 0.95
  state        bytes of ``json.dumps(StatefulDataLoader.state_dict())`` mid-epoch, and the time
               from a new dataset + loader + ``load_state_dict`` to the first batch, against the
               same without a state (resume skips by index: the two should be equal); and a
               ResumableSampler of 10M samples resumed half-way (8 -> 8 ranks, and 8 -> 4 through
               elastic_state)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from tests.tools.reader_data import reader_datasets

TARGET = 0.95


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def drain(dataset, limit: int) -> int:
    n = 0
    for _ in dataset:
        n += 1
        if n == limit:
            break
    return n


def throughput(data: dict, repeats: int) -> list[dict]:
    from pipelines.mixture import Mixture
    from pipelines.torch_lmdb import LmdbImageDataset
    from pipelines.torch_text import PackedTokenDataset

    rows = []
    kinds = {
        "images (LMDB + LMDB, PIL decode)": lambda r: LmdbImageDataset(r),
        "tokens (packed + packed, 256-token windows)": lambda r: PackedTokenDataset(r, 256, shuffle=False),
    }
    pairs = {"images (LMDB + LMDB, PIL decode)": ("lmdb_a", "lmdb_b"),
             "tokens (packed + packed, 256-token windows)": ("text_a", "text_b")}
    for kind, make in kinds.items():
        a, b = make(data[pairs[kind][0]]), make(data[pairs[kind][1]])
        n = 100_000 if "tokens" in kind else 3000
        mix = Mixture([(a, 2), (b, 1)], seed=0, exhausted="repeat", samples=n)
        order_a, order_b = (np.random.default_rng(0).permutation(len(x)).tolist() for x in (a, b))
        runs = {"A": lambda: drain((a[order_a[i % len(a)]] for i in range(n)), n),  # alone, shuffled as in the mix
                "B": lambda: drain((b[order_b[i % len(b)]] for i in range(n)), n), "mix": lambda: drain(mix, n)}
        seconds = {name: [] for name in runs}
        for _ in range(repeats):  # interleaved, so a busy moment of a shared machine hits all three
            for name, fn in runs.items():
                seconds[name].append(best(fn, 1))
        rate = {name: n / min(times) for name, times in seconds.items()}
        predicted = 1 / (2 / 3 / rate["A"] + 1 / 3 / rate["B"])
        rows.append({"measure": f"mix {kind}", "rate": round(rate["mix"], 1), "baseline": "blend of the sources alone",
                     "baseline_rate": round(predicted, 1), "ratio": round(rate["mix"] / predicted, 3),
                     "source_rates": {k: round(v, 1) for k, v in rate.items()}, "target": TARGET})
    return rows


def checkpoint_costs(data: dict) -> list[dict]:
    from tests.tools.resume_check import build

    rows = []
    cases = [("lmdb", ["lmdb_a"], 8), ("packed", ["text_a"], 8), ("documents", ["text_a"], 8),
             ("grouped", ["text_a"], 8), ("video", ["video"], 2), ("mixture-images", ["lmdb_a", "lmdb_b"], 8),
             ("mixture-tokens", ["text_a", "text_b"], 8)]
    for reader, roots, batch in cases:
        if any(r not in data for r in roots):
            continue
        for workers in (0, 2):
            spec = {"reader": reader, "roots": [data[r] for r in roots], "num_workers": workers,
                    "batch_size": batch, "seed": 1, "weights": [2, 1]}
            loader, _, _ = build(spec)
            it = iter(loader)
            for _ in range(3):
                next(it)
            state = json.loads(json.dumps(loader.state_dict()))
            del it, loader
            timings = {}
            for label, saved in (("fresh", None), ("resumed", state)):
                started = time.perf_counter()
                loader, _, _ = build(spec)
                if saved is not None:
                    loader.load_state_dict(saved)
                next(iter(loader))
                timings[label] = time.perf_counter() - started
                del loader
            rows.append({"measure": f"state {reader} ({workers} workers)", "state_bytes": len(json.dumps(state)),
                         "resume_s": round(timings["resumed"], 3), "fresh_s": round(timings["fresh"], 3)})
    return rows


def sampler_scale() -> list[dict]:
    """Resume cost where it grows: the order of a large epoch is rebuilt from (seed, epoch), so a
    resume costs one permutation (and, after an elastic fold, one pass over the consumed marks)."""
    from pipelines.sampler_resume import ResumableSampler, elastic_state

    size, rows = 10_000_000, []
    for world_from, world_to in ((8, 8), (8, 4)):
        states = []
        for rank in range(world_from):
            sampler = ResumableSampler(size, seed=1, rank=rank, world_size=world_from)
            sampler.position.yielded = size // world_from // 2  # half-way through the epoch
            states.append(sampler.state_dict())
        started = time.perf_counter()
        state = states[0] if world_from == world_to else elastic_state(states)
        resumed = ResumableSampler(size, seed=1, rank=0, world_size=world_to)
        resumed.load_state_dict(state)
        next(iter(resumed))
        rows.append({"measure": f"state ResumableSampler, 10M samples, {world_from}->{world_to} ranks",
                     "state_bytes": len(json.dumps(state)), "resume_s": round(time.perf_counter() - started, 3),
                     "fresh_s": round(best(lambda: next(iter(ResumableSampler(size, seed=1, world_size=world_to))),
                                           1), 3)})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'measure':<58} {'value':>14} {'baseline':>14} {'ratio':>7}"]
    for r in rows:
        if "rate" in r:
            lines.append(f"{r['measure']:<58} {r['rate']:>10.1f} s/s {r['baseline_rate']:>10.1f} s/s "
                         f"{r['ratio']:>7.3f}")
        else:
            lines.append(f"{r['measure']:<58} {r['state_bytes']:>8} bytes resume {r['resume_s']:.3f} s "
                         f"(fresh {r['fresh_s']:.3f} s)")
    return "\n".join(lines)


def main(out_dir) -> dict:
    import torch

    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    base = out_dir / "mixture-data"
    marker = base / "datasets.json"
    if marker.exists():
        data = json.loads(marker.read_text())
    else:
        base.mkdir(parents=True, exist_ok=True)
        data = reader_datasets(base, photos_per_class=int(os.environ.get("REPACK_BENCH_MIX_PHOTOS") or 30),
                               documents_scale=10)
        marker.write_text(json.dumps(data))
    repeats = int(os.environ.get("REPACK_BENCH_MIX_REPEATS") or 5)
    rows = throughput(data, repeats) + checkpoint_costs(data) + sampler_scale()
    text = table(rows)
    print(text)
    return {"rows": rows, "table": text}


if __name__ == "__main__":
    import sys

    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "bench-out"), indent=1))
