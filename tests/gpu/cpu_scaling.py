"""Issue 10's 16-core figures, on the device machine's CPUs (no GPU needed); prints each table.

    python -m tests.gpu.cpu_scaling --out DIR [--images 6000] [--parts pack,check,sweep,text,video]

  pack    `repack images --verify none` (default options) vs `tar cf && sync FILE`: wall and CPU ratios
  check   `repack images --verify decode` (all CPUs) vs one process ShardWriter + PIL decode
  sweep   `--verify decode` at 1, 2, 4, 8, 16 workers: images/s and scaling efficiency (and the
          machine's own: bare decode processes)
  dispatch `--verify none` CPU and wall with the engine's dispatch order vs plain plan order
  text    `repack text` vs bare ``encode_batch_fast`` tokens per CPU-second x the CPUs (bench_text)
  video   `repack video --transcode --threads 1` frames/s at 1 .. 16 workers (skipped without ffmpeg)

The photos (real-photo JPEGs, 400-2200 px, ~110 KB) are generated in parallel (tests.gpu.gpu_images)
into DIR/images-data once and reused; the text corpus (REPACK_BENCH_TEXT_MB, default 50) likewise.
Each part runs the `make bench` module that owns it (tests/benchmarks), so the figures are the
same measurements as there. Parts run one after another; `--parts` splits them across commands
(pack+check+sweep take ~3 minutes on 16 cores, text ~2, video ~2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

PARTS = ("pack", "check", "sweep", "dispatch", "text", "video")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="data and results folder (reused across runs)")
    parser.add_argument("--images", type=int, default=6000)
    parser.add_argument("--parts", default=",".join(PARTS))
    args = parser.parse_args(argv)
    out = Path(args.out).absolute()
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    os.environ.setdefault("REPACK_BENCH_IMAGES", str(args.images))
    os.environ.setdefault("REPACK_BENCH_REPEATS", "2")
    cpus = len(os.sched_getaffinity(0))
    print(f"cpu_scaling: {cpus} usable CPUs, python {sys.version.split()[0]}, parts {','.join(parts)}", flush=True)
    results: dict = {}
    image_parts = [p for p in parts if p in ("pack", "check", "sweep", "dispatch")]
    if image_parts:
        from tests.gpu.gpu_images import make_photos

        started = time.perf_counter()
        made = make_photos(out / "images-data" / f"photos-{args.images}", args.images, cpus)
        print(f"photos: {made} in {time.perf_counter() - started:.0f} s", flush=True)
        results["images"] = run_part("images", lambda: _producer(out, image_parts))
    if "text" in parts:
        results["text"] = run_part("text", lambda: _module("bench_text", out))
    if "video" in parts:
        if shutil.which("ffmpeg") and shutil.which("ffprobe"):
            results["video"] = run_part("video", lambda: _module("bench_video", out))
        else:
            print("video: skipped (ffmpeg/ffprobe not on PATH)", flush=True)
    (out / "cpu_scaling.json").write_text(json.dumps(results, indent=1, sort_keys=True, default=str) + "\n")
    print("\n=== summary ===")
    for name, result in results.items():
        print(f"\n[{name}]\n{result.get('table') or json.dumps(result, indent=1, default=str)}")
    print(f"\nresults: {out / 'cpu_scaling.json'}")
    return 1 if any("error" in r for r in results.values()) else 0


def run_part(name: str, fn) -> dict:
    print(f"\n=== {name} ===", flush=True)
    started = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - one failing part must not hide the others
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(f"[{name}] {time.perf_counter() - started:.0f} s", flush=True)
    return result


def _producer(out: Path, parts: list[str]) -> dict:
    os.environ["REPACK_BENCH_PARTS"] = ",".join(parts)
    from tests.benchmarks import bench_producer

    return bench_producer.main(out)


def _module(name: str, out: Path) -> dict:
    import importlib

    return importlib.import_module(f"tests.benchmarks.{name}").main(out)


if __name__ == "__main__":
    sys.exit(main())
