"""A dataset's quarantine records (every input that was not packed, with its reason) as columns in a side file.

The manifest listed every record, ~120 B of JSON each, parsed by every reader at open: a crawl with a few million
broken files made a manifest over the cap every reader refuses (``repack.manifest.caps``), and the job was refused
at publish after all its work (exit 5). Now a manifest lists at most ``listed_records()`` records
(``REPACK_QUARANTINE_LISTED``, default 1,000: what summaries and reports show one by one); beyond that every record
is in a side file (``quarantine.records``, a later version's ``quarantine-vN.records``) that the manifest's
``files``/``file_digests`` name under the role ``quarantine`` with its size and sha256 (``repack verify`` checks them;
gc, pull and s3:// publish move it with its version). ``totals.quarantined`` counts them all. Writers hold the full
list in memory as before: ``compact`` turns it into the manifest's form at publish, ``expand`` reads it back for the
commands that need every record (an --append's, a remove's, the reports' reason counts).

Layout (integers little-endian; no pickle):
  b"repack-quarantine 1\\n"
  one JSON line     {"records": R, "reasons": K, "source_bytes": S, "reason_bytes": B, "extra_bytes": E}
  source_ends       R x int64   end (exclusive) of each record's source in ``sources``
  has_source        R x uint8   1 where the record has a ``source``
  line_kind         R x uint8   0: no ``line`` key, 1: ``"line": null``, 2: a whole number in ``lines``
  lines             R x int64
  reason_codes      R x int32   index into the reason table (-1: no ``reason`` key)
  reason_ends       K x int64   end of each distinct reason in ``reasons``
  extra_ends        R x int64   end of each record's other keys (canonical JSON object; empty: none)
  sources           S bytes     UTF-8 (surrogateescape), back to back
  reasons           B bytes     the distinct reasons, UTF-8, back to back
  extras            E bytes
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Callable, Iterator

from repack.manifest.caps import listed_limit
from repack.manifest.schema import ManifestError
from repack.manifest.side_columns import counts_line, cut_texts

if TYPE_CHECKING:
    import numpy as np  # imported where used: `repack verify` forks its hashing processes before numpy is imported

MAGIC = b"repack-quarantine 1\n"
ROLE = "quarantine"
LISTED_DEFAULT = 1000
RUN_SUFFIX = "; the "  # what a record of a run of text lines adds to its first line's reason: how many after it
_NULL_LINE, _INT_LINE = 1, 2  # line_kind (0: the record has no line key)


class QuarantineFileError(ManifestError):
    """A quarantine side file that cannot be read (damaged, missing, not the one the manifest records)."""


def listed_records() -> int:
    """How many records a manifest lists itself (``REPACK_QUARANTINE_LISTED``, default 1,000; 0 or more)."""
    return listed_limit("REPACK_QUARANTINE_LISTED", LISTED_DEFAULT, "records")


FILE_NAME = re.compile(r"quarantine(?:-v[0-9]+)?\.records")  # any version's side file


def file_name(version: int = 1) -> str:
    """The side file of a version: ``quarantine.records`` (version 1), ``quarantine-vN.records``."""
    return "quarantine.records" if int(version) == 1 else f"quarantine-v{int(version)}.records"


def side_file(data: dict) -> str | None:
    """The quarantine side file a manifest names (None: it lists every record itself)."""
    name = (data.get("files") or {}).get(ROLE)
    return name if isinstance(name, str) else None


def _joined(texts: list[bytes]) -> tuple[bytes, "np.ndarray"]:
    import numpy as np

    return b"".join(texts), np.cumsum([len(t) for t in texts], dtype="<i8")


def encode(records: list[dict]) -> bytes:
    """The side file of ``records`` (manifest quarantine records: dicts of JSON values)."""
    import numpy as np

    count = len(records)
    has_source, line_kind, lines, codes = bytearray(count), bytearray(count), [0] * count, [-1] * count
    table: dict[str, int] = {}
    sources, extras = [b""] * count, [b""] * count
    for row, record in enumerate(records):
        in_columns = 0
        source = record.get("source")
        if type(source) is str:
            has_source[row] = 1
            sources[row] = source.encode("utf-8", "surrogateescape")
            in_columns += 1
        if "line" in record:
            line = record["line"]
            if line is None:
                line_kind[row] = _NULL_LINE
                in_columns += 1
            elif type(line) is int:
                line_kind[row], lines[row] = _INT_LINE, line
                in_columns += 1
        reason = record.get("reason")
        if type(reason) is str:
            code = table.get(reason)
            if code is None:
                code = table[reason] = len(table)
            codes[row] = code
            in_columns += 1
        if len(record) > in_columns:  # keys beyond the three columns (a video's codes, text's no_documents)
            taken = {"source": has_source[row], "line": line_kind[row], "reason": codes[row] >= 0}
            rest = {k: v for k, v in record.items() if not taken.get(k)}
            extras[row] = json.dumps(rest, sort_keys=True, ensure_ascii=True, separators=(",", ":")).encode()
    source_bytes, source_ends = _joined(sources)
    reason_bytes, reason_ends = _joined([r.encode("utf-8", "surrogateescape") for r in table])
    extra_bytes, extra_ends = _joined(extras)
    header = {"records": count, "reasons": len(table), "source_bytes": len(source_bytes),
              "reason_bytes": len(reason_bytes), "extra_bytes": len(extra_bytes)}
    return b"".join([MAGIC, json.dumps(header, sort_keys=True).encode() + b"\n", source_ends.tobytes(),
                     bytes(has_source), bytes(line_kind), np.array(lines, "<i8").tobytes(),
                     np.array(codes, "<i4").tobytes(), reason_ends.tobytes(), extra_ends.tobytes(), source_bytes,
                     reason_bytes, extra_bytes])


def _header(raw: bytes, where: str) -> tuple[dict, int]:
    def refuse(why: str) -> QuarantineFileError:
        return QuarantineFileError(f"{where}: not a quarantine file repack reads ({why})")

    keys = ("records", "reasons", "source_bytes", "reason_bytes", "extra_bytes")
    counts, at = counts_line(raw, MAGIC, keys, refuse)
    records, reasons, *blobs = counts
    if 30 * records + 8 * reasons + sum(blobs) != len(raw) - at:
        raise refuse(f"{len(raw)} bytes, not what {records} records take")
    return dict(zip(keys, counts)), at


def record_count(raw: bytes, where: str) -> int:
    """How many records a side file holds (its header, checked against its size)."""
    return _header(raw, where)[0]["records"]


def decode(raw: bytes, where: str, limit: int | None = None) -> list[dict]:
    """The records a side file holds, in order (equal to those ``encode`` took; the first ``limit`` where given);
    QuarantineFileError naming ``where`` when the file is not one ``encode`` writes."""
    columns = _columns(raw, where)
    return _records(columns, where, 0, len(columns["codes"]) if limit is None else min(limit, len(columns["codes"])))


def iter_records(raw: bytes, where: str, batch: int = 1 << 16) -> Iterator[dict]:
    """The records of a side file one by one, decoded ``batch`` at a time (``repack inspect --quarantine`` of
    millions holds one batch of dicts, not all of them)."""
    columns = _columns(raw, where)
    count = len(columns["codes"])
    for start in range(0, count, batch):
        yield from _records(columns, where, start, min(start + batch, count))


def _records(columns: dict, where: str, start: int, stop: int) -> list[dict]:
    """Rows ``start`` to ``stop`` of ``_columns`` as records."""
    reasons = columns["reasons"]
    records = []
    rows = slice(start, stop)
    for source, has, kind, line, code, extra in zip(
            columns["sources"](start, stop), columns["has_source"][rows].tolist(), columns["line_kind"][rows].tolist(),
            columns["lines"][rows].tolist(), columns["codes"][rows].tolist(), columns["extras"](start, stop)):
        try:
            record = json.loads(extra) if extra else {}
        except (ValueError, RecursionError):
            record = None
        if not isinstance(record, dict):
            raise QuarantineFileError(f"{where}: not a quarantine file repack reads (a record's other keys are not a "
                                      "JSON object)")
        if has:
            record["source"] = source
        if kind:
            record["line"] = line if kind == _INT_LINE else None
        if code >= 0:
            record["reason"] = reasons[code]
        records.append(record)
    return records


def reason_counts(raw: bytes, where: str) -> dict[str, int]:
    """{reason: records} of a side file, counted on its columns ("?" for records without one)."""
    import numpy as np

    columns = _columns(raw, where)
    codes = columns["codes"]
    counts = np.bincount(codes + 1, minlength=len(columns["reasons"]) + 1).tolist()
    found = {reason: n for reason, n in zip(columns["reasons"], counts[1:]) if n}
    if counts[0]:
        found["?"] = found.get("?", 0) + counts[0]
    return found


def _columns(raw: bytes, where: str) -> dict:
    """The side file's columns: numpy views of its bytes, the reasons as str, the sources and extras as functions
    of a row range (start, stop) that decode those rows only (a report decodes 50 of millions)."""
    import numpy as np

    header, at = _header(raw, where)
    count, kinds = header["records"], header["reasons"]

    def take(items: int, dtype: str) -> np.ndarray:
        nonlocal at
        column = np.frombuffer(raw, dtype, items, at)
        at += items * np.dtype(dtype).itemsize
        return column

    source_ends, has_source, line_kind, lines = take(count, "<i8"), take(count, "u1"), take(count, "u1"), \
        take(count, "<i8")
    codes, reason_ends, extra_ends = take(count, "<i4"), take(kinds, "<i8"), take(count, "<i8")
    blobs = []
    for end_key in ("source_bytes", "reason_bytes", "extra_bytes"):
        blobs.append(raw[at:at + header[end_key]])
        at += header[end_key]
    sources, reason_blob, extras = blobs
    for ends, total in ((source_ends, len(sources)), (reason_ends, len(reason_blob)), (extra_ends, len(extras))):
        if np.any(np.diff(ends, prepend=0) < 0) or (len(ends) and ends[-1] != total):
            raise QuarantineFileError(f"{where}: not a quarantine file repack reads (its offsets do not add up)")
    if np.any(codes < -1) or np.any(codes >= kinds) or np.any(line_kind > _INT_LINE):
        raise QuarantineFileError(f"{where}: not a quarantine file repack reads (a reason or line out of range)")
    return {"sources": lambda start, stop: _texts(sources, source_ends, start, stop), "has_source": has_source,
            "line_kind": line_kind, "lines": lines, "codes": codes,
            "reasons": _texts(reason_blob, reason_ends, 0, len(reason_ends)),
            "extras": lambda start, stop: _texts(extras, extra_ends, start, stop)}


def _texts(blob: bytes, ends, start: int, stop: int) -> list[str]:
    """Strings ``start`` to ``stop`` of ``blob`` cut at ``ends`` (an int64 column: each string's end): one decode of
    what they span, then str slices where it is ASCII."""
    if stop <= start:
        return []
    first = int(ends[start - 1]) if start else 0
    cut = (ends[start:stop] - first).tolist()
    return cut_texts(blob[first:first + cut[-1]], [0, *cut[:-1]], cut)


def compact(data: dict, version: int) -> tuple[dict, tuple[str, bytes] | None]:
    """(``data`` (a manifest with every quarantine record) in its published form, the side file to write first as
    (name, bytes) or None): where it holds more than ``listed_records()``, every record goes to the version's side
    file, the first of them listed, and the file named in ``files``/``file_digests``; no quarantine role otherwise
    (a record set that shrank). The caller writes the file once nothing can refuse the version any more."""
    from repack.sinks.checks import bytes_digest

    files = {k: v for k, v in (data.get("files") or {}).items() if k != ROLE}
    digests = {k: v for k, v in (data.get("file_digests") or {}).items() if k != ROLE}
    records = data["quarantine"]
    listed = listed_records()
    out = {key: value for key, value in data.items() if key not in ("files", "file_digests")}
    side = None
    if len(records) > listed:
        side = file_name(version), encode(records)
        out["quarantine"] = records[:listed]
        files[ROLE], digests[ROLE] = side[0], bytes_digest(side[1])
    if files:
        out["files"] = files
    if digests:
        out["file_digests"] = digests
    return out, side


def checked_file(data: dict, read: Callable[[str], bytes | None], where: str) -> bytes | None:
    """The side file's bytes (None where the manifest names none), refused (QuarantineFileError) when missing or
    not of the size and sha256 its ``file_digests`` record."""
    name = side_file(data)
    if name is None:
        return None
    raw = read(name)
    if raw is None:
        raise QuarantineFileError(f"{where}/{name}: missing (the quarantine records its manifest names)")
    expected = (data.get("file_digests") or {}).get(ROLE)
    if not isinstance(expected, dict) or expected.get("bytes") != len(raw) or \
            expected.get("sha256") != hashlib.sha256(raw).hexdigest():
        raise QuarantineFileError(f"{where}/{name}: not the quarantine records the manifest records (its size or "
                                  "sha256 differs); `repack verify` names what else changed")
    return raw


def summary(data: dict, read: Callable[[str], bytes | None], where: str, first: int) -> tuple[int, dict, list[dict]]:
    """(how many records, {reason: records}, the first ``first`` records) of a manifest's quarantine, counted on its
    side file's columns where it names one (no dict per record)."""
    raw = checked_file(data, read, where)
    if raw is None:
        records = data["quarantine"]
        counts: dict[str, int] = {}
        for record in records:
            reason = str(record.get("reason", "?"))
            counts[reason] = counts.get(reason, 0) + 1
        return len(records), counts, list(records[:first])
    name = f"{where}/{side_file(data)}"
    return record_count(raw, name), reason_counts(raw, name), decode(raw, name, first)


def every_record(data: dict, read: Callable[[str], bytes | None], where: str) -> list[dict]:
    """Every quarantine record of a manifest: its side file's where it names one, else its own list."""
    raw = checked_file(data, read, where)
    return list(data["quarantine"]) if raw is None else decode(raw, f"{where}/{side_file(data)}")


def expand(data: dict, read: Callable[[str], bytes | None], where: str) -> dict:
    """``data`` with every quarantine record listed and no quarantine role in ``files``/``file_digests`` (the form a
    job's finalize builds: a change derives the next version from it, and ``compact`` names that version's file)."""
    if side_file(data) is None:
        return data
    out = dict(data, quarantine=every_record(data, read, where))
    for key in ("files", "file_digests"):
        rest = {k: v for k, v in (data.get(key) or {}).items() if k != ROLE}
        if rest:
            out[key] = rest
        else:
            out.pop(key, None)
    return out
