"""The manifest: the one contract between the producer (repack) and the readers (pipelines).

Stdlib only. ``pipelines`` imports this package and nothing else from ``repack``.
"""

from repack.manifest.io import (atomic_write_bytes, atomic_write_json, dumps_canonical, parse_manifest, read_manifest,
                                write_manifest)
from repack.manifest.paths import PathEscapeError, safe_join
from repack.manifest.schema import MANIFEST_NAME, SCHEMA, VERSION, Manifest, ManifestError, Shard
from repack.manifest.wids import WIDS_INDEX_NAME, wids_shard_index

__all__ = [
    "MANIFEST_NAME", "SCHEMA", "VERSION", "Manifest", "ManifestError", "Shard", "PathEscapeError",
    "atomic_write_bytes", "atomic_write_json", "dumps_canonical", "parse_manifest", "read_manifest", "safe_join", "write_manifest",
    "WIDS_INDEX_NAME", "wids_shard_index",
]
