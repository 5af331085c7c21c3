"""Image WebDatasets of many tiny samples without packing their inputs: real tar shards and DALI indexes
written with repack's own tar code (``repack.sinks.tar_format``: headers, index lines, end of archive)
and a manifest validated by ``repack.manifest.write_manifest``.

``synthetic_dataset(root, samples, per_shard)`` writes ONE real shard of ``per_shard`` samples (each a
``payload``-byte ``.jpg`` and a ``.cls`` label) and lists it ``samples / per_shard`` times under
further names, hard links to the same tar and index: a 10M-sample dataset takes the disk of one shard.
The samples' keys repeat from shard to shard (the readers do not require distinct keys across shards).
The payloads are not JPEGs: read them raw (``decode=False``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from repack.manifest import write_manifest
from repack.sinks.tar_format import BLOCK, end_of_archive, index_from_lines, ustar_header

CLASSES = 10


META = b'{"height": 32, "mode": "RGB", "source": "c000/00000000.jpg", "width": 32}'  # ~ repack's .json of a tiny JPEG


def write_shard(tar_path: Path, idx_path: Path, samples: int, payload: int = 1, meta: bool = False) -> int:
    """A tar of ``samples`` samples ``%09d`` (``.jpg`` of ``payload`` bytes, ``.cls`` of class i % 10)
    and its index; returns the tar's size. ``meta``: shaped as ``repack images`` packs tiny JPEGs
    instead: keys ``%08d_%08d``, a ``.cls`` of 3 digits and a ``.json`` member of ~100 bytes each (an
    index line of ~227 bytes, 4x the plain one's)."""
    lines, at = [], 0
    data = b"\xff" * payload
    with open(tar_path, "wb") as fh:
        for i in range(samples):
            key = f"{i:08d}_{i * 7:08d}" if meta else f"{i:09d}"
            members = []
            parts = (("jpg", data), ("cls", b"%03d" % (i % CLASSES)), ("json", META)) if meta else \
                (("jpg", data), ("cls", str(i % CLASSES).encode()))
            for ext, body in parts:
                name = f"{key}.{ext}"
                fh.write(ustar_header(name.encode(), len(body)))
                fh.write(body + b"\0" * (-len(body) % BLOCK))
                members.append(f"{ext} {at + BLOCK} {len(body)} {name}")
                at += BLOCK + len(body) + (-len(body) % BLOCK)
            lines.append(" ".join(members))
        fh.write(end_of_archive(at))
        size = fh.tell()
    idx_path.write_text(index_from_lines(lines))
    return size


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def synthetic_dataset(root: str | os.PathLike, samples: int, per_shard: int, payload: int = 1,
                      meta: bool = False) -> Path:
    """An image WebDataset of ``samples`` samples (a multiple of ``per_shard``) under ``root``: one real
    shard (``write_shard``), listed ``samples // per_shard`` times (hard links). Returns ``root``."""
    if samples % per_shard:
        raise ValueError(f"{samples} samples is not a multiple of {per_shard} per shard")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tar, idx = root / "shard-000000.tar", root / "shard-000000.idx"
    size = write_shard(tar, idx, per_shard, payload, meta)
    tar_sha, idx_sha, idx_bytes = _sha256(tar), _sha256(idx), idx.stat().st_size
    shards = []
    for n in range(samples // per_shard):
        name = f"shard-{n:06d}"
        if n:
            for ext in ("tar", "idx"):
                link = root / f"{name}.{ext}"
                if not link.exists():
                    os.link(root / f"shard-000000.{ext}", link)
        shards.append({"path": f"{name}.tar", "samples": per_shard, "bytes": size, "sha256": tar_sha,
                       "index": f"{name}.idx", "index_bytes": idx_bytes, "index_sha256": idx_sha})
    _write_manifest(root, shards, meta)
    return root


def varied_dataset(root: str | os.PathLike, samples: list[int], payloads: list[int]) -> Path:
    """An image WebDataset of ``len(samples)`` distinct shards under ``root``: shard i holds ``samples[i]``
    samples whose ``.jpg`` members are ``payloads[i]`` bytes each (so a sample's shard shows in its size).
    Returns ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    shards = []
    for n, (count, payload) in enumerate(zip(samples, payloads, strict=True)):
        tar, idx = root / f"shard-{n:06d}.tar", root / f"shard-{n:06d}.idx"
        size = write_shard(tar, idx, count, payload)
        shards.append({"path": tar.name, "samples": count, "bytes": size, "sha256": _sha256(tar),
                       "index": idx.name, "index_bytes": idx.stat().st_size, "index_sha256": _sha256(idx)})
    _write_manifest(root, shards, False)
    return root


def _write_manifest(root: Path, shards: list[dict], meta: bool) -> None:
    samples = sum(s["samples"] for s in shards)
    write_manifest(root, {
        "schema": "repack.manifest", "version": 1, "modality": "images", "format": "webdataset",
        "created_by": {"tool": "tests.tools.synthetic_shards", "version": "0", "options": {}},
        "fields": {"jpg": "image", "cls": "int", **({"json": "metadata"} if meta else {})}, "classes": {f"c{c}": c for c in range(CLASSES)},
        "shards": shards, "quarantine": [],
        "totals": {"inputs": samples, "samples": samples, "quarantined": 0, "bytes": sum(s["bytes"] for s in shards),
                   "shards": len(shards)}})
