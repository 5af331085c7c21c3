"""Caps on what a manifest can make its reader allocate (stdlib only; the readers call these).

- A manifest file over ``MAX_MANIFEST_BYTES`` is refused before it is read (parsed JSON costs several
  times its bytes). ``REPACK_MAX_MANIFEST_BYTES`` raises the cap for a dataset that needs more.
- The sample counts a manifest declares are checked against the files before any memory is sized from
  them: a shard's count times the least bytes one sample takes in its file (``MIN_SAMPLE_BYTES``: a tar
  member's header block, an LMDB entry, a Megatron index's per-document entries) must fit in the file's
  actual size. A manifest declaring 10^15 samples for a 50 KB shard is refused by name, not allocated.
"""

from __future__ import annotations

import os
from typing import Callable

from repack.manifest.schema import ManifestError

MAX_MANIFEST_BYTES = 256 * 2**20
MIN_SAMPLE_BYTES = {"webdataset": 512, "lmdb": 32, "memmap": 12}  # per sample, in the counted file
COUNTED_FILE = {"memmap": "index"}  # the shard entry key naming the file whose size bounds the count


def manifest_cap() -> int:
    """The manifest size cap in bytes (``REPACK_MAX_MANIFEST_BYTES``, else MAX_MANIFEST_BYTES)."""
    raw = os.environ.get("REPACK_MAX_MANIFEST_BYTES", "")
    if not raw.strip():
        return MAX_MANIFEST_BYTES
    from repack.sizes import parse_size
    from repack.errors import UsageError

    try:
        return parse_size(raw)
    except UsageError as exc:  # never the default in silence: the user meant to raise it
        raise ManifestError(f"REPACK_MAX_MANIFEST_BYTES={raw!r}: {exc}") from None


def listed_limit(variable: str, default: int, unit: str) -> int:
    """How many entries of a kind a manifest lists itself, the rest in a side file: ``variable`` (a whole number,
    0 or more), else ``default``; UsageError naming the variable and ``unit`` for another value."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        from repack.errors import UsageError

        raise UsageError(f"{variable}={raw!r}: a whole number of {unit}, 0 or more")
    return value


def check_manifest_size(size: int | None, where: str) -> None:
    """ManifestError when a manifest of ``size`` bytes is over the cap (None: absent, the reader says so)."""
    cap = manifest_cap()
    if size is not None and size > cap:
        raise ManifestError(f"{where}: the manifest is over the {cap}-byte cap (REPACK_MAX_MANIFEST_BYTES "
                            "raises it)")


def check_written_size(raw: bytes, data: dict, where: str) -> None:
    """ManifestError before a manifest of ``raw`` bytes (``data`` parsed) is written over the cap that every
    reader refuses it at: a dataset published so would be unreadable. Names the largest parts (a ``--dedup``
    run's duplicate groups and the quarantine list hold an entry per input)."""
    cap = manifest_cap()
    if len(raw) <= cap:
        return
    import json

    def size(value) -> int:
        return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())

    parts = {key: size(value) for key, value in data.items()}
    parts.update({f"stats.{key}": size(value) for key, value in (data.get("stats") or {}).items()})
    parts.pop("stats", None)
    largest = ", ".join(f"{key} {size:,} B" for key, size in sorted(parts.items(), key=lambda kv: -kv[1])[:3])
    raise ManifestError(f"{where}: the manifest would be {len(raw):,} bytes, over the {cap:,}-byte cap every "
                        f"reader refuses (largest: {largest}); nothing is published. Raise "
                        "REPACK_MAX_MANIFEST_BYTES here and where the dataset is read, and run again")


def check_declared_counts(data: dict, size_of: Callable[[str], int | None], where: str) -> None:
    """ManifestError naming the shard whose declared sample count its file cannot hold (``size_of(rel)``:
    the file's actual bytes, None when missing), or whose count is not a non-negative integer."""
    least = MIN_SAMPLE_BYTES.get(data.get("format"))
    for shard in data.get("shards", ()):
        samples = shard.get("samples")
        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
            raise ManifestError(f"{where}: shard {shard.get('path')!r} declares {samples!r} samples, not a "
                                "non-negative integer")
        if least is None or samples == 0:
            continue
        rel = shard.get(COUNTED_FILE.get(data.get("format"), "path"))
        size = size_of(rel) if isinstance(rel, str) else None
        if size is None:
            raise ManifestError(f"{where}: {rel!r} is missing (its shard declares {samples} samples)")
        if samples * least > size:
            raise ManifestError(f"{where}: {rel} declares {samples} samples, more than its {size} bytes can hold "
                                f"(at least {least} bytes a sample): a damaged or forged manifest (run `repack "
                                "verify`)")
    totals = data.get("totals")
    held = sum(shard.get("samples", 0) for shard in data.get("shards", ()))
    if isinstance(totals, dict) and "samples" in totals and totals["samples"] != held:
        raise ManifestError(f"{where}: totals.samples is {totals['samples']!r}, its shards hold {held}: a shard "
                            "entry was dropped or edited (run `repack verify`)")
