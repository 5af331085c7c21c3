"""`repack verify`: check a dataset against its manifest."""

from __future__ import annotations

import os
from pathlib import Path

from repack.jobs.base import STATE_DIR
from repack.manifest import MANIFEST_NAME, ManifestError, read_manifest
from repack.manifest.paths import PathEscapeError
from repack.sinks import SINKS, get_sink
from repack.sinks.checks import sha256_file


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
