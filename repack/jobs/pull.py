"""`repack pull`: copy a dataset from object storage into a local folder, checked as verify checks.

Every object the manifest names is downloaded (size and sha256 checked on the way; an intact file
already in DEST is kept), then the copy is checked as ``repack verify`` checks a folder (each
shard's structure against its index, the side files' sha256); only then is the manifest written,
last: a readable manifest in DEST means a complete, checked copy. A file of the copy that fails
raises VerificationError (exit 5); DEST holding a symlink where a file goes is a UsageError.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from repack.errors import UsageError, VerificationError
from repack.jobs.verify import check_contents
from repack.manifest import MANIFEST_NAME, Manifest, atomic_write_bytes, safe_join
from repack.sinks.checks import sha256_file
from repack.store.files import LocalFiles, RemoteFiles

THREADS = 16


@dataclass(frozen=True)
class Expected:
    """One object the manifest names, with its size and sha256 when the manifest records them."""

    rel: str
    size: int | None
    sha256: str | None


def expected_objects(manifest: Manifest) -> list[Expected]:
    """Every object of the dataset: shards and their index files, then side files (the tokenizer
    with the sha256 the manifest records for it)."""
    found = []
    for shard in manifest.data["shards"]:
        found.append(Expected(shard["path"], shard.get("bytes"), shard.get("sha256")))
        if shard.get("index"):
            found.append(Expected(shard["index"], shard.get("index_bytes"), shard.get("index_sha256")))
        if shard.get("checksums"):
            found.append(Expected(shard["checksums"], shard.get("checksums_bytes"), shard.get("checksums_sha256")))
    for name, rel in manifest.data.get("files", {}).items():
        sha = manifest.data.get("tokenizer", {}).get("sha256") if name == "tokenizer" else None
        found.append(Expected(rel, None, sha))
    return found


def refuse_links(root: Path, rel: str) -> Path:
    """``root/rel``, refusing a symlink at the file or any folder on the way (a copy never writes
    through a link, wherever it points)."""
    path = root
    for part in rel.split("/"):
        path = path / part
        if path.is_symlink():
            raise UsageError(f"{path}: a symbolic link in the destination; pull writes plain files only "
                             "(remove the link, or pull into another folder)")
    return safe_join(root, rel)


def pull(url: str, dest: str | os.PathLike) -> Manifest:
    """Copy the dataset under ``url`` into the folder ``dest`` (see the module docstring)."""
    remote = RemoteFiles(url)
    manifest = remote.manifest()
    root = Path(dest)
    if root.exists() and not root.is_dir():
        raise UsageError(f"{str(root)!r} exists and is not a folder")
    root.mkdir(parents=True, exist_ok=True)
    items = expected_objects(manifest)
    targets = {item.rel: refuse_links(root, item.rel) for item in items}
    (root / MANIFEST_NAME).unlink(missing_ok=True)  # a readable manifest = a complete copy

    def copy(item: Expected) -> None:
        local = targets[item.rel]
        if item.sha256 and local.is_file() and (item.size is None or local.stat().st_size == item.size) \
                and sha256_file(local) == item.sha256:
            return
        remote.store.fetch(item.rel, local, item.sha256)
        if item.size is not None and local.stat().st_size != item.size:
            raise VerificationError(f"{remote.store.where(item.rel)}: {local.stat().st_size} bytes, "
                                    f"manifest says {item.size}")

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(copy, items))
    copy_manifest = Manifest(root, manifest.data)
    problems = check_contents(LocalFiles(root, copy_manifest), copy_manifest)
    if problems:
        raise VerificationError(f"{url}: the copy in {dest} fails {len(problems)} check(s), no manifest written: "
                                + "; ".join(problems[:5]))
    atomic_write_bytes(root / MANIFEST_NAME, remote.store.read_bytes(MANIFEST_NAME))
    return copy_manifest
