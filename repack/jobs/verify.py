"""`repack verify` and `repack inspect`: check a dataset against its manifest; summarize it."""

from __future__ import annotations

import os
from pathlib import Path

from repack.jobs.engine import STATE_DIR
from repack.manifest import MANIFEST_NAME, ManifestError, read_manifest
from repack.manifest.paths import PathEscapeError
from repack.sinks import SINKS, get_sink
from repack.sinks.checks import sha256_file

LONG_SIDE_HINT = 2048  # px: beyond this, decode dominates a DataLoader step


def verify_dataset(root: str | Path) -> list[str]:
    """Every problem found (empty list = the dataset matches its manifest)."""
    problems: list[str] = []

    def check(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    try:
        manifest = read_manifest(root)
    except ManifestError as exc:
        return [str(exc)]
    if manifest.format not in SINKS:
        return [f"unknown format {manifest.format!r} in manifest"]
    sink = get_sink(manifest.format)
    for shard in manifest.data["shards"]:
        try:
            manifest.path(shard["path"])
        except PathEscapeError as exc:
            problems.append(str(exc))
            continue
        sink.verify_shard(manifest.root, shard, check)
    check_side_files(manifest, check)
    listed = set(manifest.relative_paths()) | {v["path"] for v in manifest.data.get("videos", [])}
    for rel in unlisted_files(manifest.root, listed):
        problems.append(f"{rel}: a file the manifest does not name (added after the job, or left by another tool)")
    totals = manifest.totals
    check(totals.get("samples") == manifest.num_samples,
          f"totals.samples {totals.get('samples')} != sum over shards {manifest.num_samples}")
    check(totals.get("quarantined") == len(manifest.quarantine),
          f"totals.quarantined {totals.get('quarantined')} != {len(manifest.quarantine)} quarantine records")
    return problems


def check_side_files(manifest, check) -> None:
    """The manifest's side files exist; the tokenizer copy still has the sha256 the manifest records."""
    for name, rel in manifest.data.get("files", {}).items():
        path = manifest.path(rel)
        if not path.is_file():
            check(False, f"{rel}: missing (the manifest's {name} file)")
        elif name == "tokenizer" and manifest.data.get("tokenizer", {}).get("sha256"):
            check(sha256_file(path) == manifest.data["tokenizer"]["sha256"],
                  f"{rel}: sha256 differs from the tokenizer the dataset was made with")


def unlisted_files(root: Path, listed: set[str]) -> list[str]:
    """Files under ``root`` (not following links; the job state ``.repack/`` and the manifest aside)
    that the manifest does not name."""
    found = []
    for folder, dirs, files in os.walk(root):
        rel_folder = os.path.relpath(folder, root)
        if rel_folder == ".":
            dirs[:] = [d for d in dirs if d != STATE_DIR]
        for name in files:
            rel = name if rel_folder == "." else f"{rel_folder}/{name}"
            if rel not in listed and rel != MANIFEST_NAME:
                found.append(rel)
    return sorted(found)


def inspect_lines(root: str | Path) -> list[str]:
    """A short human summary of a dataset."""
    manifest = read_manifest(root)
    data = manifest.data
    shards = data["shards"]
    sizes = sorted(s["bytes"] for s in shards)
    lines = [f"{manifest.root}: {data['modality']} / {data['format']}, manifest v{data['version']} "
             f"(repack {data.get('created_by', {}).get('version', '?')})",
             f"samples {manifest.num_samples} in {len(shards)} shard(s), {sum(sizes) / 1e6:.1f} MB"]
    if sizes:
        lines.append(f"shard bytes: min {sizes[0] / 1e6:.1f} MB, median {sizes[len(sizes) // 2] / 1e6:.1f} MB, "
                     f"max {sizes[-1] / 1e6:.1f} MB")
    if data.get("fields"):
        lines.append("fields: " + ", ".join(f"{k} ({v})" for k, v in data["fields"].items()))
    classes = manifest.classes
    if classes:
        shown = ", ".join(f"{name}={idx}" for name, idx in list(classes.items())[:20])
        lines.append(f"classes ({len(classes)}): {shown}{' ...' if len(classes) > 20 else ''}")
    reasons: dict[str, int] = {}
    for q in manifest.quarantine:
        reasons[q["reason"]] = reasons.get(q["reason"], 0) + 1
    lines.append(f"quarantined: {len(manifest.quarantine)}")
    lines += [f"  {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:15]]
    timing = data.get("run", {}).get("timing", {})
    labels = {"read_ms": "read", "check_ms": "decode/check (+normalize)"}
    for name in ("read_ms", "check_ms"):
        if timing.get(name):
            t = timing[name]
            lines.append(f"{labels[name]} time per sample (ms): p50 {t['p50']} p90 {t['p90']} p99 {t['p99']} max {t['max']}")
    if timing.get("slowest"):
        lines.append("slowest inputs:")
        lines += [f"  {s['us'] / 1000:.1f} ms  {s['source']}  {s['bytes']} B  {s['width']}x{s['height']}"
                  for s in timing["slowest"][:5]]
        longest = max(max(s.get("width", 0), s.get("height", 0)) for s in timing["slowest"])
        options = data.get("created_by", {}).get("options", {})
        if longest > LONG_SIDE_HINT and options.get("max_side") is None and data.get("modality") == "images":
            lines.append(f"hint: the slowest inputs are up to {longest} px on the longer side; every epoch decodes "
                         f"them in full. Repack with --normalize --max-side {LONG_SIDE_HINT // 2} to cap decode cost.")
    lines += image_report_lines(data.get("stats", {}))
    hook = getattr(get_sink(manifest.format), "inspect_lines", None) if manifest.format in SINKS else None
    if hook is not None:  # format-specific lines (e.g. text stats and the first document decoded)
        lines += hook(manifest)
    return lines


def image_report_lines(stats: dict) -> list[str]:
    """--normalize conversions and exact duplicates, from the manifest's stats."""
    lines = []
    norm = stats.get("normalize")
    if norm:
        lines.append(f"normalize: {norm['converted']} converted, {norm['passed_through']} passed through unchanged")
        lines += [f"  {n} x {reason}" for reason, n in sorted(norm["reasons"].items(), key=lambda kv: -kv[1])]
    dups = stats.get("duplicates")
    if dups and dups.get("groups"):
        dropped = f", {dups['dropped']} dropped by --dedup" if dups.get("dropped") else " (--dedup drops them)"
        lines.append(f"exact duplicates: {dups['groups']} group(s), {dups['extra_copies']} extra cop(ies){dropped}")
        lines += [f"  {' = '.join(g['paths'][:4])}{' ...' if len(g['paths']) > 4 else ''}" for g in dups["list"][:5]]
    return lines
