"""A dataset with many quarantined inputs, packed and read by each tree: the manifest's size and what it costs.

    python -m tests.tools.quarantine_scale WORK [--files N] [--bad B] [--tree DIR ...] [--rounds R]
    python -m tests.tools.quarantine_scale --synthetic N

``--synthetic N``: N records as a crawl's (``cNNN/NNNNNNNN.jpg``, three reasons) in memory only: the side file's
bytes, ``encode``, ``decode`` and the report's ``summary`` (reason counts and the first 50 records) in seconds,
beside the bytes and ``json.dumps`` seconds of the same records listed in a manifest.

WORK holds SOURCE (N tiny JPEGs from ``tests.benchmarks.tiny_files`` plus B files of 12 bytes that are no image,
spread over the same 1,000 class folders; made once) and each tree's OUT. Per tree (a checkout run as ``python -m
repack`` with that PYTHONPATH; default: this one) and round, one at a time: ``repack images SOURCE OUT --quiet``,
``repack verify OUT``, ``repack inspect OUT --json`` and, in a fresh process, ``ImageShardDataset(OUT,
decode=False, batch_size=256)``'s open and first batch; wall seconds and the process tree's peak RSS
(``bench_scale.run_tree``), the manifest's and the quarantine side file's bytes. One JSON line per run; the best
over the rounds per tree at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from tests.benchmarks.bench_scale import run_tree

ROOT = Path(__file__).resolve().parents[2]
FIRST_BATCH = ("import sys, time; t = time.perf_counter(); from pipelines.torch_webdataset import ImageShardDataset; "
               "batch = next(iter(ImageShardDataset(sys.argv[1], decode=False, batch_size=256))); "
               "print(round(time.perf_counter() - t, 3))")


def prepare(work: Path, files: int, bad: int) -> Path:
    """SOURCE: ``files`` tiny JPEGs and ``bad`` non-images in 1,000 class folders, made once."""
    from tests.benchmarks.tiny_files import tiny_jpegs

    src, marker = work / f"src-{files}-{bad}", work / f"src-{files}-{bad}.complete"
    if not marker.exists():
        shutil.rmtree(src, ignore_errors=True)
        tiny_jpegs(src, 0, files)
        for i in range(bad):
            (src / f"c{i % 1000:03d}" / f"bad{i:08d}.jpg").write_bytes(b"no image %03d" % (i % 1000))
        marker.write_text("ok\n")
    return src


def measure(tree: Path, src: Path, out: Path) -> dict:
    """One round of ``tree`` on ``src`` into ``out``."""
    shutil.rmtree(out, ignore_errors=True)
    env = {"PYTHONPATH": str(tree)}
    repack = [sys.executable, "-m", "repack"]
    pack = run_tree([*repack, "images", str(src), str(out), "--quiet"], quiet_stdout=True, cwd=tree, env=env)
    verify = run_tree([*repack, "verify", str(out)], quiet_stdout=True, cwd=tree, env=env)
    inspect = run_tree([*repack, "inspect", str(out), "--json"], quiet_stdout=True, cwd=tree, env=env)
    read = run_tree([sys.executable, "-c", FIRST_BATCH, str(out)], cwd=tree, env=env)
    manifest = json.loads((out / "manifest.json").read_text())
    side = out / "quarantine.records"
    return {"tree": str(tree), "quarantined": manifest["totals"]["quarantined"],
            "manifest_bytes": (out / "manifest.json").stat().st_size,
            "side_file_bytes": side.stat().st_size if side.exists() else 0,
            "pack_s": round(pack.wall, 3), "pack_peak_rss_mb": round(pack.peak_rss / 1e6, 1),
            "pack_peak_pss_mb": round(pack.peak_pss / 1e6, 1),
            "verify_s": round(verify.wall, 3), "inspect_json_s": round(inspect.wall, 3),
            "open_first_batch_s": float(read.stdout.strip().splitlines()[-1]),
            "reader_process_s": round(read.wall, 3), "reader_peak_rss_mb": round(read.peak_rss / 1e6, 1)}


def synthetic(count: int) -> dict:
    """The side file's costs for ``count`` records made in memory (see the module docstring)."""
    import time

    from repack.manifest.quarantine_records import decode, encode, summary

    reasons = ["not a recognized image format (checked the content, not the name)", "truncated JPEG",
               "image file is empty"]
    records = [{"source": f"c{i % 1000:03d}/{i:08d}.jpg", "reason": reasons[i % 7 % 3]} for i in range(count)]
    started = time.perf_counter()
    listed = json.dumps(records, sort_keys=True, separators=(",", ":"))
    as_json = time.perf_counter() - started
    started = time.perf_counter()
    raw = encode(records)
    encoded = time.perf_counter() - started
    started = time.perf_counter()
    back = decode(raw, "synthetic")
    decoded = time.perf_counter() - started
    assert back == records
    del back
    started = time.perf_counter()
    summary({"quarantine": [], "files": {"quarantine": "q"}, "file_digests": {"quarantine": {
        "bytes": len(raw), "sha256": __import__("hashlib").sha256(raw).hexdigest()}}}, lambda rel: raw, "synthetic", 50)
    summarized = time.perf_counter() - started
    return {"records": count, "side_file_bytes": len(raw), "bytes_per_record": round(len(raw) / count, 1),
            "listed_json_bytes": len(listed), "json_dumps_s": round(as_json, 3), "encode_s": round(encoded, 3),
            "decode_s": round(decoded, 3), "summary_s": round(summarized, 3)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", type=Path, nargs="?")
    parser.add_argument("--synthetic", type=int, help="N records in memory only (no WORK)")
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--bad", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tree", action="append", type=Path, help="a checkout to run (repeatable); default: this")
    args = parser.parse_args(argv)
    if args.synthetic:
        found = synthetic(args.synthetic)
        print(json.dumps(found))
        return [found]
    if args.work is None:
        parser.error("WORK is needed without --synthetic")
    args.work.mkdir(parents=True, exist_ok=True)
    src = prepare(args.work, args.files, args.bad)
    trees = [t.resolve() for t in args.tree or [ROOT]]
    runs = []
    for round_number in range(args.rounds):
        for number, tree in enumerate(trees):
            run = {"round": round_number, **measure(tree, src, args.work / f"out-{number}")}
            print(json.dumps(run), flush=True)
            runs.append(run)
    for tree in trees:
        mine = [r for r in runs if r["tree"] == str(tree)]
        best = {key: min(r[key] for r in mine) for key in mine[0] if key.endswith(("_s", "_mb"))}
        print(json.dumps({"tree": str(tree), "best": best, "manifest_bytes": mine[0]["manifest_bytes"],
                          "side_file_bytes": mine[0]["side_file_bytes"], "quarantined": mine[0]["quarantined"]}))
    return runs


if __name__ == "__main__":
    main()
