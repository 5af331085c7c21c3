"""Which file names are text inputs, and of what kind: the one rule the folder scan
(``repack.sources.text_scan``) and the listing and reading code (``repack.sources.text_docs``) share."""

from __future__ import annotations

JSONL_EXTS = (".jsonl", ".ndjson", ".json")
TXT_EXTS = (".txt",)
PARQUET_EXTS = (".parquet",)
COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
# compressions repack does not read: a text input under one is quarantined by name, not skipped (``unread_reason``)
OTHER_COMPRESSIONS = frozenset({".xz", ".bz2", ".bzip2", ".gzip", ".lz4", ".lzma", ".lzo", ".br", ".zip", ".7z", ".z",
                                ".lz", ".sz", ".snappy", ".zlib", ".tgz", ".tar"})

_KINDS = {**{ext: "jsonl" for ext in JSONL_EXTS}, **{ext: "txt" for ext in TXT_EXTS},
          **{ext: "parquet" for ext in PARQUET_EXTS}}


def classify(name: str) -> tuple[str, str] | None:
    """(kind, compression) from a file name, or None for a file that is not a text input (two dict
    look-ups: it runs once per file of the corpus)."""
    stem, dot, ext = name.lower().rpartition(".")
    compression = COMPRESSIONS.get(dot + ext, "")
    if compression:
        stem, dot, ext = stem.rpartition(".")
    kind = _KINDS.get(dot + ext) if dot else None
    if kind is None or (kind == "parquet" and compression):
        return None
    return kind, compression


def unread_reason(name: str) -> str | None:
    """Why a file ``classify`` takes for no text input still looks like one, named so (its quarantine reason):
    a text input's name under a compression repack does not read (``a.jsonl.xz``), or a compressed parquet
    file. None for any other name (skipped, as a README or a .csv is)."""
    stem, dot, ext = name.lower().rpartition(".")
    inner, inner_dot, inner_ext = stem.rpartition(".")
    compressed = f".{ext}" in OTHER_COMPRESSIONS or f".{ext}" in COMPRESSIONS  # a.jsonl.sha256, a.txt.bak: side files
    if not (dot and inner_dot and inner and compressed) or f".{inner_ext}" not in _KINDS:
        return None
    if _KINDS[f".{inner_ext}"] == "parquet":
        return f"a .parquet file under .{ext}: parquet is read as it is (it compresses inside), not compressed again"
    return (f"a .{inner_ext} file under .{ext}: repack reads .{inner_ext} as it is or compressed as .gz or .zst; "
            "decompress it or compress it as .zst")
