"""Text corpora as streams of documents: listing, cutting into balanced chunks, reading.

Inputs: ``.jsonl``/``.ndjson``/``.json`` (JSON lines, one document per line, text in a
field), ``.txt`` (one document per line, per file, or per blank-line-separated paragraph)
and ``.parquet`` (a string column), the first two optionally ``.gz`` or ``.zst``. SOURCE is
one such file, a folder of them (recursive, sorted by byte path, hidden files skipped) or,
with ``--list``, a file naming them one per line. A folder is scanned into columns by
``repack.sources.text_scan``; the others are listed here.

Planning (``repack.jobs.text_plan``) cuts the corpus into chunks of about equal size that never split a document:
uncompressed JSON lines/text files are cut at byte offsets snapped forward to the next
document boundary; compressed files and whole-file documents are indivisible; parquet files
are cut at row-group boundaries. The cut depends only on the files and the options, so the
same corpus always gives the same chunks.

Reading a segment streams it line by line (bounded memory) and yields ``Doc`` values: a
document (text), or a problem (reason) with its 1-based line within the segment; the
caller turns segment lines into file lines using each segment's line count.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import json
import os
import stat as stat_mod
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, NamedTuple

import numpy as np

from repack.errors import SourceUnavailable, UsageError, stable_reason
from repack.manifest.quarantine_records import RUN_SUFFIX
from repack.sources.base import again_name, alias_reason, pick_real_paths
from repack.sources.columns import NO_LABEL, InputTable, name_ends, same_files
from repack.sources.confine import Confinement
from repack.sources.reading import open_input
from repack.sources.s3 import list_columns
from repack.sources.text_kinds import classify, unread_reason
from repack.sources.text_scan import KIND_CODES, KIND_OF, TextInputs, not_utf8_names, scan_text_folder
from repack.sources.text_sniff import (SNIFF_BYTES, binary_document, binary_reason, has_nul, may_hold_a_fragment,
                                      plain_text)
from repack.store import is_remote

SNIP_BYTES = 4096  # the sniff reads a damaged compressed stream in pieces, keeping what decompressed
DOC_PER = ("line", "file", "blank-line")
SNAP_READ = 1 << 16
AUTO_CHUNKS = 256              # --chunk-bytes auto: about this many chunks,
AUTO_MIN, AUTO_MAX = 5 * 10**5, 256 * 10**6  # each between 0.5 MB and 256 MB (work for every core)
DEFAULT_MAX_DOC_BYTES = 8 * 2**20  # --max-doc-bytes: a longer document is quarantined, never held whole
# A document is tokenized whole (splitting it could change its tokens). Measured with GPT-2's
# byte-level BPE (tokenizers 0.23, `repack text --workers 1`): peak RSS about 100 MB plus about
# 105 bytes per byte of the longest document (8 MiB: 0.85 GB, 16 MiB: 1.75 GB). So --max-doc-bytes
# is refused above MAX_DOC_BYTES_LIMIT, which keeps a worker under TEXT_WORKER_BUDGET.
TOKENIZE_BYTES_PER_BYTE = 105
TEXT_WORKER_BUDGET = 2 * 2**30
MAX_DOC_BYTES_LIMIT = 16 * 2**20


def auto_chunk_bytes(total: int) -> int:
    """The default chunk size: total/256 clamped to [0.5 MB, 256 MB] (depends on the corpus only)."""
    return min(AUTO_MAX, max(AUTO_MIN, -(-total // AUTO_CHUNKS)))


class TextFile(NamedTuple):
    """One input file: where it is, how to name it, its kind and compression, its size (a named tuple:
    one per input file, made at tuple speed)."""

    path: str
    rel: str
    kind: str         # "jsonl" | "txt" | "parquet"
    compression: str  # "" | "gz" | "zst"
    size: int
    mtime_ns: int = 0  # size, mtime_ns and inode: the fingerprint checked before reading (resume)
    ino: int = 0


class Segment(NamedTuple):
    """A contiguous piece of one file: bytes [start, end) or row groups [start, end) (a named tuple: one
    per input file at least)."""

    path: str
    rel: str
    kind: str
    compression: str
    start: int
    end: int
    unit: str  # "bytes" | "rowgroups" | "file"
    fingerprint: tuple[int, ...] = ()  # the file's [size, mtime_ns, inode] at planning

    def to_json(self) -> dict:
        return {"path": self.path, "rel": self.rel, "kind": self.kind, "compression": self.compression,
                "start": self.start, "end": self.end, "unit": self.unit, "fingerprint": list(self.fingerprint)}

    @classmethod
    def from_json(cls, data: dict) -> "Segment":
        return cls(**{**data, "fingerprint": tuple(data.get("fingerprint", ()))})


UNIT_CODES = {"bytes": "b", "file": "f", "rowgroups": "r"}
UNIT_OF = {code: unit for unit, code in UNIT_CODES.items()}


def segment_table(segments: list[Segment]) -> dict:
    """A task's segments as columns for its plan payload (a few numbers per input file, not a record):
    ``root`` (where ``path`` = root + rel), ``rel``, ``start``, ``end``, ``fingerprint`` lists, ``unit``
    one letter per segment, and ``path`` only when some segment's path is not root + rel (then "" where
    it is). Kind and compression follow from the name (``classify``)."""
    first = segments[0]
    root = first.path[:-len(first.rel)] if first.path.endswith(first.rel) else ""
    paths = ["" if s.path == root + s.rel else s.path for s in segments]
    table = {"root": root, "rel": [s.rel for s in segments], "start": [s.start for s in segments],
             "end": [s.end for s in segments], "unit": "".join(UNIT_CODES[s.unit] for s in segments),
             "fingerprint": [list(s.fingerprint) for s in segments]}
    if any(paths):
        table["path"] = paths
    return table


def table_segments(table: dict) -> list[Segment]:
    """The segments of a ``segment_table``."""
    root, paths = table["root"], table.get("path") or [""] * len(table["rel"])
    out = []
    for rel, path, start, end, unit, fp in zip(table["rel"], paths, table["start"], table["end"], table["unit"],
                                               table["fingerprint"]):
        kind, compression = classify(rel.rsplit("/", 1)[-1])  # a planned rel always classifies
        out.append(Segment(path or root + rel, rel, kind, compression, start, end, UNIT_OF[unit], tuple(fp)))
    return out


@dataclass(frozen=True)
class Doc:
    """A document (``text``) or a problem (``reason``), at a 1-based ``line`` of its segment."""

    line: int
    text: str | None = None
    reason: str | None = None


def list_text_files(source: str, list_file: bool = False, confinement: Confinement | None = None,
                    workers: int = 1) -> tuple[TextInputs, list[dict], int]:
    """The input files in deterministic order (columns), quarantine records, and the count of skipped files.

    Every local input goes through the confinement rooted at the source folder (or the list file's
    folder, or a single file's own folder): see ``repack.sources.confine``. A folder is walked on
    ``workers`` processes (``repack.sources.text_scan``)."""
    if not is_remote(source) and not list_file and Path(source).is_dir():
        return scan_text_folder((confinement or Confinement()).rooted(str(source)), workers)
    if is_remote(source):
        return list_remote_text_files(source, list_file, confinement or Confinement())
    if list_file:
        return list_text_rows(source, confinement or Confinement())
    files, quarantine, skipped = single_text_file(source, confinement)
    return TextInputs.of_files(files), quarantine, skipped


class _FileIdent(NamedTuple):
    """What ``pick_real_paths`` reads of a row's stat."""

    st_dev: int
    st_ino: int


def list_text_rows(source: str, rules: Confinement) -> tuple[TextInputs, list[dict], int]:
    """``list_text_files`` of a list file, as columns: each row checked (``Confinement.check_listed``) into an
    ``InputTable`` (names blob, fingerprint columns, a real path only where it is not root/rel), in the list's
    order; a file reached twice (a link, a hard link, a row repeated) read once, under the path
    ``pick_real_paths`` picks of the rows that open it, found by one sort of the (device, inode) columns. A list
    of 100,000 rows allocated 1,504 B a row at its peak with tuples and stat results per row, 135 B so (2-core
    VM, tracemalloc; 10.3 -> 5.4 s)."""
    src = Path(source)
    conf = rules.rooted(str(src.absolute().parent))
    base = str(src.parent)
    not_text: list[dict] = []
    refused: list[dict] = []
    names = bytearray()
    columns = {k: array("q") for k in ("size", "mtime", "inode", "device", "line")}
    codes = array("B")
    real_paths: dict[int, str] = {}
    prefix = conf.root + "/"
    real_folders: dict[str, str] = {}  # each row's folder -> its real path
    # rows end at "\n" only (a "\r" before it is stripped): a file name may hold U+2028, U+0085 or a form feed,
    # which str.splitlines() took for line ends (and packed or named the pieces); bytes that are not UTF-8 stay
    # the name's own (surrogateescape), as the folder walk reads names
    rows = src.read_bytes().decode("utf-8", "surrogateescape").split("\n")
    if rows and not rows[-1]:
        rows.pop()
    for number in range(len(rows)):
        entry = rows[number].strip().lstrip("\ufeff")
        rows[number] = None  # the columns grow as the rows go
        if not entry or entry.startswith("#"):
            continue
        where = f" ({src.name}:{number + 1})"
        path = entry if os.path.isabs(entry) else os.path.join(base, entry)  # as written: "a.txt/" is no file
        kind = classify(os.path.basename(path))
        if kind is None:
            not_text.append({"source": entry, "line": None, "reason": "not a .jsonl/.txt/.parquet file "
                             "(optionally .gz/.zst)" + where})
            continue
        checked = conf.check_listed(path, real_folders)
        reason = checked.reason
        if reason is None and stat_mod.S_ISDIR(checked.st.st_mode):
            reason = "not a regular file (folder)"
        if reason is not None:
            refused.append({"source": entry, "line": None, "reason": reason + where})
            continue
        st = checked.st
        if checked.real != prefix + entry:
            real_paths[len(codes)] = checked.real
        names += entry.encode("utf-8", "surrogateescape") + b"\0"
        for key, value in (("size", st.st_size), ("mtime", st.st_mtime_ns), ("inode", st.st_ino),
                           ("device", st.st_dev), ("line", number + 1)):
            columns[key].append(value)
        codes.append(KIND_CODES[kind])
    del rows
    column = {k: np.frombuffer(v, dtype=np.int64).copy() if len(v) else np.zeros(0, np.int64)
              for k, v in columns.items()}
    names = bytes(names)
    table = InputTable(conf.root, names, name_ends(names), np.full(len(codes), NO_LABEL, dtype=np.int32), (),
                       column["size"], column["mtime"], column["inode"], real_paths)
    inputs = TextInputs(table, np.frombuffer(codes, dtype=np.uint8).copy() if len(codes) else np.zeros(0, np.uint8))
    bad = not_utf8_names(table)  # refused as the folder scan refuses them, before a file's paths are weighed
    if bad:
        refused += [{"source": table.rel(row), "line": None, "reason": f"{reason} ({src.name}:{column['line'][row]})"}
                    for row, reason in sorted(bad.items())]
        kept = np.flatnonzero(~np.isin(np.arange(len(table)), list(bad)))
        inputs, column = inputs.take(kept), {k: v[kept] for k, v in column.items()}
        table = inputs.table
    keep, twice = _read_once(table, column["device"], column["line"], conf.root, src.name)
    if not keep.all():
        inputs = inputs.take(np.flatnonzero(keep))
    return inputs, not_text + refused + twice, 0


def _read_once(table: InputTable, devices: np.ndarray, lines: np.ndarray, root: str, list_name: str
               ) -> tuple[np.ndarray, list[dict]]:
    """Which rows of a list's ``table`` are read (a file reached through several rows is read once, under the
    rel ``pick_real_paths`` keeps), and the quarantine records of the others, in row order."""
    keep = np.ones(len(table), dtype=bool)
    groups = same_files(table.inodes, devices)
    if not groups:
        return keep, []
    aliases: dict[str, str] = {}
    for group in groups:
        aliases.update(pick_real_paths([(table.rel(row), table.path(row),
                                         _FileIdent(int(devices[row]), int(table.inodes[row]))) for row in group], root))
    records = []
    read: set[str] = set()
    set_aside: set[str] = set()  # names of the rows not read: each its own, never a packed file's
    seen_again: dict[str, int] = {}
    for row in sorted(row for group in groups for row in group):
        rel = table.rel(row)
        if rel in aliases or rel in read:  # a file reached twice (link, hard link, list repeat) is read once
            where = f" ({list_name}:{int(lines[row])})"
            first = aliases.get(rel, rel)
            reason = (alias_reason(rel, table.path(row), first, root) + where if first != rel
                      else f"listed twice{where}: read once")
            shown = again_name(rel, seen_again) if rel in read or rel in set_aside else rel
            set_aside.add(shown)
            records.append({"source": shown, "line": None, "reason": reason})
            keep[row] = False
            continue
        read.add(rel)
    return keep, records


def single_text_file(source: str, confinement: Confinement | None = None) -> tuple[list[TextFile], list[dict], int]:
    """``list_text_files`` of one file named on the command line: its ``TextFile``, or its quarantine record."""
    src = Path(source)
    conf = (confinement or Confinement()).rooted(os.path.dirname(os.path.realpath(src)))
    kind = classify(src.name)
    if kind is None:
        return [], [{"source": src.name, "line": None, "reason": "not a .jsonl/.txt/.parquet file "
                     "(optionally .gz/.zst)"}], 0
    checked = conf.check_listed(str(src), {})
    reason = checked.reason
    if reason is None and stat_mod.S_ISDIR(checked.st.st_mode):
        reason = "not a regular file (folder)"
    if reason is not None:
        return [], [{"source": src.name, "line": None, "reason": reason}], 0
    st = checked.st
    return [TextFile(checked.real, src.name, *kind, st.st_size, st.st_mtime_ns, st.st_ino)], [], 0


NOT_TEXT = 255  # the code of a listed object that is no text input (no ``KIND_CODES`` value takes it)


def _kind_codes(rels: list[str]) -> np.ndarray:
    """Each listed key's ``KIND_CODES`` value by its name, NOT_TEXT for a name no text kind takes."""
    return np.fromiter((KIND_CODES[kind] if (kind := classify(rel.rpartition("/")[2])) is not None else NOT_TEXT
                        for rel in rels), dtype=np.uint8, count=len(rels))


def list_remote_text_files(url: str, list_file: bool, rules: Confinement) -> tuple[TextInputs, list[dict], int]:
    """``list_text_files`` for an s3:// prefix (paged listing, sorted by byte path), in columns from the
    listing's (``repack.sources.s3.list_columns``: no object per input); objects are neither symlinks nor
    special files: of the confinement only the size cap applies."""
    if list_file:
        raise UsageError("--list reads a local list file: SOURCE cannot be an s3:// URL with --list")
    listing = list_columns(url, _kind_codes)  # keys that name no file are quarantined, hidden/junk ones counted
    quarantine: list[dict] = [{**record, "line": None} for record in listing.quarantine]
    codes = listing.codes
    text = codes != NOT_TEXT
    table = listing.input_table()
    skipped = listing.skipped
    for row in np.flatnonzero(~text).tolist():  # a name that looks like a text input: named, never dropped silently
        unread = unread_reason(table.rel(row).rpartition("/")[2])
        if unread is None:
            skipped += 1
        else:
            quarantine.append({"source": table.rel(row), "line": None, "reason": unread})
    for row, reason in listing.size_refusals(rules, among=text).items():
        quarantine.append({"source": table.rel(row), "line": None, "reason": reason})
        text[row] = False
    keep = np.flatnonzero(text)
    inputs = TextInputs(table, codes)
    return (inputs if len(keep) == len(codes) else inputs.take(keep)), quarantine, skipped


# -- planning ----------------------------------------------------------------------------------

def snap_line(fh: BinaryIO, pos: int, size: int) -> int:
    """The first line start at or after ``pos``."""
    if pos <= 0 or pos >= size:
        return min(max(pos, 0), size)
    fh.seek(pos - 1)
    skipped = 0
    while True:
        block = fh.read(SNAP_READ)
        if not block:
            return size
        newline = block.find(b"\n")
        if newline >= 0:
            return pos + skipped + newline
        skipped += len(block)


def is_blank(line: bytes) -> bool:
    """A whitespace-only line, a paragraph separator of ``--doc-per blank-line``: ASCII whitespace, or Unicode
    whitespace such as a no-break or an ideographic space (a document of only those is empty: the same rule)."""
    rest = line.strip()
    if not rest:
        return True
    if (rest[0] < 0x80 and not 0x1c <= rest[0] <= 0x1f) or not rest[:4].decode("utf-8", "ignore")[:1].isspace():
        return False  # decoded only where it may be blank (str.isspace: also the separators U+001C-U+001F)
    try:
        return rest.decode("utf-8").isspace()
    except UnicodeDecodeError:
        return False


def snap_paragraph(fh: BinaryIO, pos: int, size: int) -> int:
    """The first position at or after ``pos`` that follows a blank (whitespace-only) line."""
    start = snap_line(fh, pos, size)
    if start >= size:
        return size
    fh.seek(start)
    offset = start
    for line in fh:
        offset += len(line)
        if is_blank(line):
            return offset
    return size


def parquet_row_groups(path: str, field: str) -> tuple[list[int], str | None]:
    """Compressed byte size of each row group, and a reason when the file cannot be used."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError("reading .parquet needs pyarrow: pip install pyarrow (or the 'text' extra)") from None
    try:
        with open_input(path) as fh:
            meta = pq.ParquetFile(fh)
            schema, md = meta.schema_arrow, meta.metadata
    except SourceUnavailable:  # the endpoint's fault, not the file's: the plan fails (a re-run reads it)
        raise
    except Exception as exc:  # noqa: BLE001 - a bad file is a quarantine record
        return [], stable_reason(exc, "unreadable parquet: ")
    if field not in schema.names:
        return [], f"no column {field!r} (columns: {', '.join(schema.names[:10])})"
    import pyarrow as pa

    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return [], f"column {field!r} is {kind}, not a string column"
    sizes = [max(1, sum(md.row_group(i).column(j).total_compressed_size for j in range(md.num_columns)))
             for i in range(md.num_row_groups)]
    return sizes, None


# -- reading -----------------------------------------------------------------------------------

PRELOAD_MAX_BYTES = 1 << 20  # a whole file up to this size is read in one call (read_inputs), not streamed


def preloadable(segment: Segment) -> bool:
    """True for a segment that is a whole file of at most PRELOAD_MAX_BYTES (text or JSON lines): its task
    reads it in one call with the others (``repack.sources.reading.read_inputs``: no open per line
    reader, s3:// objects fetched concurrently) and hashes those bytes."""
    size = segment.fingerprint[0] if segment.fingerprint else None
    return (segment.kind != "parquet" and size is not None and size <= PRELOAD_MAX_BYTES and segment.start == 0
            and (segment.unit == "file" or segment.end == size))


def file_document(data: bytes | OSError | None, max_doc_bytes: int) -> tuple[str, int] | None:
    """(text, lines) of a plain ``.txt`` file read whole already (``--doc-per file``: the many-small-files
    case) when it is good text under the cap, without a BOM; None otherwise (not read, too long, anything to
    report: ``SegmentReader``'s general path then says what)."""
    if not isinstance(data, bytes) or len(data.removeprefix(codecs.BOM_UTF8)) > max_doc_bytes:
        return None
    if len(data) <= SNIFF_BYTES:
        text = plain_text(data)
        if text is None:
            return None
        text = text.removeprefix("\ufeff")
    else:
        if binary_reason(data[:SNIFF_BYTES]) is not None:
            return None
        try:
            text = data.removeprefix(codecs.BOM_UTF8).decode("utf-8")
        except UnicodeDecodeError:
            return None
        if has_nul(text):
            return None
    if may_hold_a_fragment(text):  # a short file with a control character: the general path checks its document
        return None
    return text, data.count(b"\n") + (0 if data[-1:] in (b"\n", b"") else 1)


@contextlib.contextmanager
def _open_stream(segment: Segment, data: bytes | OSError | None = None) -> Iterator[BinaryIO]:
    """The segment's bytes (decompressed): ``data`` (the whole file, read already; an OSError raised
    here), else opened through the confinement's ``open_input``."""
    if isinstance(data, OSError):
        raise data
    with (io.BytesIO(data) if data is not None else
          open_input(segment.path, list(segment.fingerprint) or None, segment.rel, buffering=1 << 20)) as raw:
        if segment.compression == "gz":
            with gzip.GzipFile(fileobj=raw, mode="rb") as fh:
                yield fh
        elif segment.compression == "zst":
            import zstandard  # importable: checked before planning (require_decompressors)

            with io.BufferedReader(ZstdFrames(raw, zstandard), 1 << 20) as fh:
                yield fh
        else:
            if segment.unit == "bytes":
                raw.seek(segment.start)
            yield raw


class ZstdFrames(io.RawIOBase):
    """The bytes of a .zst file's frames, one after the other, decompressed a read at a time (zstandard's
    ``stream_reader``: bounded memory however well the text compresses); EOFError where the file ends inside a
    frame (a cut file: the stream reader ends there as if the file were whole, and the lines read so far would be
    taken for all of it; ``gzip`` raises EOFError the same way). The compressed bytes' frame layout is followed
    as they are read (``ZstdLayout``)."""

    def __init__(self, raw: BinaryIO, zstandard) -> None:
        self._layout = ZstdLayout()
        self._reader = zstandard.ZstdDecompressor().stream_reader(_Followed(raw, self._layout),
                                                                   read_across_frames=True, closefd=False)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = self._reader.readinto(buffer)
        if not count and not self._layout.whole():
            raise EOFError("zstd: the file ends inside a frame (cut short)")
        return count


class _Followed:
    """A binary file whose bytes, as read, are fed to a ``ZstdLayout``."""

    def __init__(self, raw: BinaryIO, layout: "ZstdLayout") -> None:
        self._raw, self._layout = raw, layout

    def read(self, size: int = -1) -> bytes:
        chunk = self._raw.read(size)
        self._layout.feed(chunk)
        return chunk


_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE = range(0x184D2A50, 0x184D2A60)
_DICT_ID_BYTES = (0, 1, 2, 4)


class ZstdLayout:
    """The zstd frame format (RFC 8878) followed over a stream of compressed bytes: frame and block headers
    parsed, block bodies and skippable frames counted past, never held. ``whole()``: the bytes fed so far end
    where a frame ends. A layout it cannot follow (not a frame's magic, a reserved block type) stops it: the
    decompressor names that error."""

    def __init__(self) -> None:
        self._held, self._skip, self._need, self._step = b"", 0, 4, self._magic
        self._checksum = False

    def feed(self, chunk: bytes) -> None:
        at, end = 0, len(chunk)
        while at < end and self._step is not None:
            if self._skip:
                passed = min(self._skip, end - at)
                self._skip -= passed
                at += passed
                continue
            take = min(self._need - len(self._held), end - at)
            self._held += chunk[at:at + take]
            at += take
            if len(self._held) == self._need:
                held, self._held = self._held, b""
                self._step(held)

    def whole(self) -> bool:
        return self._step is None or (self._step == self._magic and not self._held and not self._skip)

    def _next(self, need: int, step) -> None:
        self._need, self._step = need, step

    def _magic(self, held: bytes) -> None:
        magic = int.from_bytes(held, "little")
        if magic == _ZSTD_MAGIC:
            self._next(1, self._descriptor)
        elif magic in _SKIPPABLE:
            self._next(4, self._skippable)
        else:
            self._step = None

    def _skippable(self, held: bytes) -> None:
        self._skip = int.from_bytes(held, "little")
        self._next(4, self._magic)

    def _descriptor(self, held: bytes) -> None:
        fhd = held[0]
        single_segment = bool(fhd & 0x20)
        self._checksum = bool(fhd & 0x04)
        content_size = (1 if single_segment else 0, 2, 4, 8)[fhd >> 6]
        rest = (0 if single_segment else 1) + _DICT_ID_BYTES[fhd & 3] + content_size
        self._next(rest, self._header_rest) if rest else self._next(3, self._block)

    def _header_rest(self, held: bytes) -> None:
        self._next(3, self._block)

    def _block(self, held: bytes) -> None:
        header = int.from_bytes(held, "little")
        kind, size = (header >> 1) & 3, header >> 3
        if kind == 3:  # reserved
            self._step = None
            return
        self._skip = 1 if kind == 1 else size  # an RLE block's body is its one byte
        if not header & 1:
            self._next(3, self._block)
        else:
            self._next(4, self._magic if not self._checksum else self._frame_checksum)

    def _frame_checksum(self, held: bytes) -> None:
        self._next(4, self._magic)


def require_decompressors(inputs: TextInputs) -> None:
    """UsageError (before planning) when an input needs a decompressor that is not installed."""
    if any(KIND_OF[code][1] == "zst" for code in set(inputs.codes.tolist())):
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise UsageError("reading .zst needs zstandard: pip install zstandard (or the 'text' extra)") from None


def _blank_so_far(data: bytes) -> bytes | None:
    """None where the whole characters of ``data`` (a piece of a line) are not all whitespace (``is_blank``), else
    its last character's bytes where that may go on in the next piece (b"" where none)."""
    cut = len(data)
    while cut and len(data) - cut < 3 and data[cut - 1] & 0xC0 == 0x80:  # UTF-8 continuation bytes
        cut -= 1
    cut = cut - 1 if cut and data[cut - 1] >= 0xC0 else len(data)  # its lead byte: the character may go on
    return data[cut:] if is_blank(data[:cut]) else None


def _skip_line(fh: BinaryIO, budget: int | None, carry: bytes | None = None) -> tuple[int, bool]:
    """Read past the end of the current line without keeping it: (the bytes read, whether the line is blank given
    ``carry``, ``_blank_so_far`` of its bytes read before; None: not blank, or not asked)."""
    read = 0
    while budget is None or read < budget:
        more = fh.readline(SNAP_READ if budget is None else min(SNAP_READ, budget - read))
        read += len(more)
        if carry is not None:
            carry = _blank_so_far(carry + more)
        if not more or more.endswith(b"\n"):
            break
    return read, carry is not None and is_blank(carry)


def _lines(segment: Segment, cap: int, data: bytes | OSError | None = None,
           blanks: bool = False) -> Iterator[bytes | None]:
    """Raw lines (with their newline) of a byte-range or whole-file segment (``data``: its bytes, read
    already); a leading UTF-8 BOM of the file is dropped; a line whose text (without its LF or CRLF, and
    the BOM) is longer than ``cap`` bytes yields None and is skipped, never held; with ``blanks`` such a line
    of whitespace only (``is_blank``) yields b"\n": a paragraph separator, as ``snap_paragraph`` cuts there."""
    with _open_stream(segment, data) as fh:
        remaining = segment.end - segment.start if segment.unit == "bytes" else None
        first = segment.unit != "bytes" or segment.start == 0
        while remaining is None or remaining > 0:
            most = cap + 2 + (len(codecs.BOM_UTF8) if first else 0)  # the text, a CRLF, the file's BOM
            raw = fh.readline(most if remaining is None else min(most, remaining))
            if not raw:
                return
            if remaining is not None:
                remaining -= len(raw)
            goes_on = len(raw) == most and not raw.endswith(b"\n")  # more of this line is left to read
            if first:
                raw, first = raw.removeprefix(codecs.BOM_UTF8), False
            if goes_on or len(_strip_newline(raw)) > cap:  # too long: skip the rest of it
                blank = blanks and is_blank(raw)
                if goes_on:
                    skipped, blank = _skip_line(fh, remaining, _blank_so_far(raw) if blanks else None)
                    if remaining is not None:
                        remaining -= skipped
                yield b"\n" if blank else None
                continue
            yield raw


def _decode(raw: bytes) -> tuple[str | None, str | None]:
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return None, f"undecodable UTF-8 at byte {exc.start} of the document ({exc.reason})"


def _strip_newline(raw: bytes) -> bytes:
    if raw.endswith(b"\n"):
        raw = raw[:-1]
        if raw.endswith(b"\r"):
            raw = raw[:-1]
    return raw


DAMAGED_PREFIXES = ("binary data, not text", "undecodable UTF-8")  # a document's reasons a stretch shares


def _run_kind(reason: str) -> str:
    """What consecutive quarantined documents must share to be one record: damaged content (binary or undecodable),
    malformed JSON (its parser's detail differs line by line), else the very reason (``missing field 'text'``)."""
    if reason.startswith(DAMAGED_PREFIXES):
        return "damaged"
    return "malformed JSON" if reason.startswith("malformed JSON") else reason


def _one_record(run: list[Doc]) -> Iterator[Doc]:
    """A run of consecutive quarantined documents of one kind (``_run_kind``) as one record: the first's line and
    reason, and how far it goes (a binary stretch in the middle of a file gave a record per line: 30,000 of them;
    a file of a million lines without the ``--field`` key, a million records, ~1 KB each in the driver)."""
    if len(run) == 1:
        yield run[0]
    elif run and run[0].reason.startswith(DAMAGED_PREFIXES):
        kinds = " or ".join(p for p in DAMAGED_PREFIXES if any(d.reason.startswith(p) for d in run[1:]))
        yield Doc(run[0].line, reason=f"{run[0].reason}{RUN_SUFFIX}{len(run) - 1} document(s) after it are damaged "
                                      f"too ({kinds}), the last starting {run[-1].line - run[0].line} line(s) on "
                                      "(a damaged stretch)")
    elif run:
        yield Doc(run[0].line, reason=f"{run[0].reason}{RUN_SUFFIX}{len(run) - 1} document(s) after it too, the last "
                                      f"starting {run[-1].line - run[0].line} line(s) on")


class SegmentReader:
    """Iterates one segment's documents; ``lines`` holds how many lines (rows) it consumed."""

    def __init__(self, segment: Segment, field: str = "text", doc_per: str = "line",
                 max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES, data: bytes | OSError | None = None) -> None:
        """``data``: the segment's raw bytes when its task read them already (a ``preloadable`` segment),
        or the OSError reading them; None: the reader opens the segment itself."""
        if doc_per not in DOC_PER:
            raise UsageError(f"--doc-per must be one of {', '.join(DOC_PER)}, got {doc_per!r}")
        self.segment = segment
        self.data = data
        self.field = field
        self.doc_per = doc_per
        self.max_doc_bytes = max_doc_bytes
        self.lines = 0
        self.blank_lines = 0

    def too_long(self, line: int, what: str = "document") -> Doc:
        return Doc(line, reason=f"{what} longer than the {self.max_doc_bytes}-byte cap (--max-doc-bytes): "
                                "quarantined, not read whole")

    def __iter__(self) -> Iterator[Doc]:
        """The segment's documents; binary or UTF-16 content is quarantined (``repack.sources.text_sniff``):
        the whole segment when its first bytes are not UTF-8 text, else each document holding U+0000."""
        whole = self._read_file_document()
        if whole is not None:
            yield whole
            return
        run: list[Doc] = []  # consecutive quarantined documents of one kind: one record for them all (what is
        kind = None          # packed stays each document's own verdict, the same whatever the chunking)
        for doc in self._documents():
            binary = binary_document(doc.text) if doc.text is not None else None
            if binary is not None:
                doc = Doc(doc.line, reason=binary)
            if doc.reason is not None:
                doc_kind = _run_kind(doc.reason)
                if doc_kind != kind:
                    yield from _one_record(run)
                    run.clear()
                    kind = doc_kind
                run.append(doc)
                continue
            yield from _one_record(run)
            run.clear()
            kind = None
            yield doc
        yield from _one_record(run)

    def _read_file_document(self) -> Doc | None:
        """The one document of a plain .txt file read whole already (``--doc-per file``, the many-small-files
        case), straight from its bytes when it is good text under the cap; None otherwise (not that case,
        or anything to report: the general path below then says what)."""
        segment = self.segment
        if self.doc_per != "file" or segment.kind != "txt" or segment.compression:
            return None
        whole = file_document(self.data, self.max_doc_bytes)
        if whole is None:
            return None
        text, self.lines = whole
        return Doc(1, text=text)

    def _sniff(self) -> str | None:
        """Why the segment's file is not UTF-8 text (text_sniff.binary_reason of the file's first bytes), or None.
        A piece of a file cut into several is judged by the file's first bytes, as the file's first piece is: one
        verdict per file, whatever the chunking (damage further in is each line's to report)."""
        segment = self.segment
        if segment.kind == "parquet":
            return None
        if isinstance(self.data, bytes) and not segment.compression:
            return binary_reason(self.data[:SNIFF_BYTES])
        if segment.unit == "bytes" and not segment.compression:
            with open_input(segment.path, list(segment.fingerprint) or None, segment.rel) as raw:
                return binary_reason(raw.read(SNIFF_BYTES))
        head = bytearray()
        with _open_stream(segment, self.data) as fh:  # compressed: the file's first bytes, decompressed
            try:
                while len(head) < SNIFF_BYTES:
                    piece = fh.read(min(SNIP_BYTES, SNIFF_BYTES - len(head)))
                    if not piece:
                        break
                    head += piece
            except Exception:  # noqa: BLE001 - a damaged stream: judged on what was read, the reader reports it
                pass
        return binary_reason(bytes(head))

    def _documents(self) -> Iterator[Doc]:
        kind = self.segment.kind
        try:
            reason = self._sniff()
            if reason:
                for _ in _lines(self.segment, self.max_doc_bytes, self.data):  # counted, so later segments' lines stay true
                    self.lines += 1
                yield Doc(1, reason=f"{reason}: the whole segment (this line and the {self.lines - 1} after it) "
                                    "is quarantined")
                return
            if kind == "jsonl":
                yield from self._jsonl()
            elif kind == "parquet":
                yield from self._parquet()
            elif self.doc_per == "line":
                yield from self._txt_lines()
            elif self.doc_per == "file":
                yield from self._txt_file()
            else:
                yield from self._txt_paragraphs()
        except (OSError, EOFError, ValueError) as exc:  # truncated/corrupt file: keep what was read
            if isinstance(exc, UnicodeDecodeError):
                raise
            yield Doc(self.lines + 1, reason=stable_reason(exc, f"unreadable after line {self.lines}: "))
        except Exception as exc:  # noqa: BLE001 - zstandard raises its own ZstdError
            if type(exc).__name__ != "ZstdError":
                raise
            yield Doc(self.lines + 1, reason=f"unreadable after line {self.lines}: zstd: {exc}")

    def _jsonl(self) -> Iterator[Doc]:
        field = self.field
        for raw in _lines(self.segment, self.max_doc_bytes, self.data):
            self.lines += 1
            if raw is None:  # the cap bounds what is read of a line: its JSON, escapes and all
                yield self.too_long(self.lines, "JSON line")
                continue
            if not raw.strip():
                self.blank_lines += 1
                continue
            text, reason = _decode(raw)
            if reason:
                yield Doc(self.lines, reason=reason)
                continue
            try:
                obj = json.loads(text)
            except ValueError as exc:
                yield Doc(self.lines, reason=f"malformed JSON: {exc}")
                continue
            except RecursionError:
                yield Doc(self.lines, reason="malformed JSON: nested too deeply")
                continue
            except Exception as exc:  # noqa: BLE001 - one bad record never fails its part
                yield Doc(self.lines, reason=stable_reason(exc, "malformed JSON: "))
                continue
            if not isinstance(obj, dict):
                yield Doc(self.lines, reason=f"JSON line is a {type(obj).__name__}, not an object")
                continue
            value = obj.get(field)
            if field not in obj or value is None:
                yield Doc(self.lines, reason=f"missing field {field!r}")
            elif not isinstance(value, str):
                yield Doc(self.lines, reason=f"field {field!r} is a {type(value).__name__}, not a string")
            else:
                yield Doc(self.lines, text=value)

    def _txt_lines(self) -> Iterator[Doc]:
        for raw in _lines(self.segment, self.max_doc_bytes, self.data):
            self.lines += 1
            if raw is None:
                yield self.too_long(self.lines)
                continue
            text, reason = _decode(_strip_newline(raw))
            yield Doc(self.lines, text=text, reason=reason)

    def _txt_file(self) -> Iterator[Doc]:
        with _open_stream(self.segment, self.data) as fh:
            data = fh.read(self.max_doc_bytes + 1 + len(codecs.BOM_UTF8))
            newlines, last = data.count(b"\n"), data[-1:]
            too_long = len(data.removeprefix(codecs.BOM_UTF8)) > self.max_doc_bytes
            for block in iter(lambda: fh.read(SNAP_READ), b"") if too_long else ():  # count lines, keep nothing
                newlines, last = newlines + block.count(b"\n"), block[-1:]
        self.lines = newlines + (0 if last in (b"\n", b"") else 1)
        if too_long:
            yield self.too_long(1)
            return
        data = data.removeprefix(codecs.BOM_UTF8)
        try:
            yield Doc(1, text=data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, exc.start) + 1
            yield Doc(1, reason=f"undecodable UTF-8 at line {line} ({exc.reason})")

    def _txt_paragraphs(self) -> Iterator[Doc]:
        para: list[bytes] = []
        size, first, over = 0, 0, False  # size: the paragraph's bytes so far, its last newline included
        for raw in _lines(self.segment, self.max_doc_bytes, self.data, blanks=True):
            self.lines += 1
            if raw is None or not is_blank(raw):
                if not para and not over:
                    first = self.lines
                size += len(raw) if raw is not None else self.max_doc_bytes + 1
                # the document's text: its lines less the newline after the last (``_paragraph``)
                over = over or raw is None or size - (len(raw) - len(_strip_newline(raw))) > self.max_doc_bytes
                if over:
                    para.clear()  # over the cap: drop what was kept, count the rest
                else:
                    para.append(raw)
                continue
            if para or over:
                yield self.too_long(first) if over else self._paragraph(para, first)
                para, size, over = [], 0, False
        if para or over:
            yield self.too_long(first) if over else self._paragraph(para, first)

    @staticmethod
    def _paragraph(lines: list[bytes], first: int) -> Doc:
        data = _strip_newline(b"".join(lines))
        try:
            return Doc(first, text=data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            line = first + data.count(b"\n", 0, exc.start)
            return Doc(first, reason=f"undecodable UTF-8 at line {line} ({exc.reason})")

    def _parquet(self) -> Iterator[Doc]:
        import pyarrow.parquet as pq

        with open_input(self.segment.path, list(self.segment.fingerprint) or None, self.segment.rel) as fh:
            pf = pq.ParquetFile(fh)
            groups = list(range(self.segment.start, self.segment.end))
            field = self.field
            for batch in pf.iter_batches(batch_size=4096, row_groups=groups, columns=[field], use_threads=False):
                for value in batch.column(0).to_pylist():
                    self.lines += 1
                    if value is None:
                        yield Doc(self.lines, reason=f"missing field {field!r} (null)")
                    elif len(value) * 4 > self.max_doc_bytes and len(value.encode("utf-8", "surrogatepass")) > self.max_doc_bytes:
                        yield self.too_long(self.lines)
                    else:
                        yield Doc(self.lines, text=value)
