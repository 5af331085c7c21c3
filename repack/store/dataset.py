"""A finished dataset in an object store: check every object against the manifest
(`repack verify s3://...`) and copy it to a local folder (`repack pull`)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from repack.errors import UsageError
from repack.manifest import MANIFEST_NAME, Manifest, ManifestError, atomic_write_bytes, safe_join
from repack.store.s3 import S3Store, sha256_file

THREADS = 16


@dataclass(frozen=True)
class Expected:
    """One object the manifest names, with its size and sha256 when the manifest records them."""

    rel: str
    size: int | None
    sha256: str | None


def open_remote_manifest(store: S3Store) -> Manifest:
    """The validated manifest of the dataset under ``store`` (ManifestError when missing or bad)."""
    raw = store.read_bytes(MANIFEST_NAME)
    if raw is None:
        raise ManifestError(f"{store.where(MANIFEST_NAME)}: no manifest (the job has not finished, or this is "
                            "not a repack output)")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{store.where(MANIFEST_NAME)}: not valid JSON ({exc})") from None
    manifest = Manifest(store.scratch, data)
    manifest.validate()  # confinement: every path stays under the prefix
    return manifest


def expected_objects(manifest: Manifest) -> list[Expected]:
    """Every object of the dataset: shards and their index files, then side files."""
    found = []
    for shard in manifest.data["shards"]:
        found.append(Expected(shard["path"], shard.get("bytes"), shard.get("sha256")))
        if shard.get("index"):
            found.append(Expected(shard["index"], shard.get("index_bytes"), shard.get("index_sha256")))
    for rel in manifest.data.get("files", {}).values():
        found.append(Expected(rel, None, None))
    return found


def verify_remote(url: str) -> list[str]:
    """Every problem found (empty = each object has the manifest's size and sha256)."""
    store = S3Store(url)
    try:
        manifest = open_remote_manifest(store)
    except ManifestError as exc:
        return [str(exc)]

    def check(item: Expected) -> list[str]:
        got = store.digest(item.rel)
        if got is None:
            return [f"{item.rel}: missing"]
        size, digest, meta = got
        problems = []
        if item.size is not None and size != item.size:
            problems.append(f"{item.rel}: {size} bytes, manifest says {item.size}")
        if item.sha256 is not None and digest != item.sha256:
            problems.append(f"{item.rel}: sha256 mismatch")
        if meta is not None and digest != meta:
            problems.append(f"{item.rel}: content does not match the sha256 stored at upload")
        return problems

    with ThreadPoolExecutor(THREADS) as pool:
        problems = [p for found in pool.map(check, expected_objects(manifest)) for p in found]
    totals = manifest.totals
    if totals.get("samples") != manifest.num_samples:
        problems.append(f"totals.samples {totals.get('samples')} != sum over shards {manifest.num_samples}")
    return problems


def pull(url: str, dest: str | os.PathLike) -> Manifest:
    """Copy the dataset under ``url`` into the local folder ``dest``: every object checked (size and
    sha256) while downloading, files already there and intact kept, the manifest written last."""
    store = S3Store(url)
    manifest = open_remote_manifest(store)
    root = Path(dest)
    if root.exists() and not root.is_dir():
        raise UsageError(f"{str(root)!r} exists and is not a folder")
    root.mkdir(parents=True, exist_ok=True)
    (root / MANIFEST_NAME).unlink(missing_ok=True)  # a readable manifest = a complete copy

    def copy(item: Expected) -> None:
        local = safe_join(root, item.rel)
        if item.sha256 and local.is_file() and local.stat().st_size == item.size and sha256_file(local) == item.sha256:
            return
        store.fetch(item.rel, local, item.sha256)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(copy, expected_objects(manifest)))
    atomic_write_bytes(root / MANIFEST_NAME, store.read_bytes(MANIFEST_NAME))
    return Manifest(root, manifest.data)
