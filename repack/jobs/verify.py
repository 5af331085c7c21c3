"""`repack verify`: check a dataset against its manifest."""

from __future__ import annotations

from pathlib import Path

from repack.manifest import ManifestError, read_manifest
from repack.manifest.paths import PathEscapeError
from repack.sinks import SINKS, get_sink


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
    totals = manifest.totals
    check(totals.get("samples") == manifest.num_samples,
          f"totals.samples {totals.get('samples')} != sum over shards {manifest.num_samples}")
    check(totals.get("quarantined") == len(manifest.quarantine),
          f"totals.quarantined {totals.get('quarantined')} != {len(manifest.quarantine)} quarantine records")
    return problems
