"""The cheap structure check of a tar shard against its DALI index: columns, not a member walk, cut
into parts that run on different processes.

``check_part(tar, index, part, parts, checksums)`` answers, for the index lines that begin in the
``part``-th of ``parts`` equal slices of the index text (``part_lines``): are they exactly the lines
repack writes, and are the members they name exactly the archive repack writes for them
(``tar_format``'s byte layout)? It parses those lines into columns with the project's one index parser
(``repack.manifest.shard_index``), then checks every member header at once with numpy against the
header repack writes for it (template, name, octal size, checksum: one comparison of 512-byte rows),
the members back to back, each sample's members named ``KEY.EXT`` with the index's ext and adjacent
samples' keys different (through the small ext and suffix tables and the keys' hashes, not per-member
rows), every sample with the same members after its first, and, given the ``.crc`` file's bytes, each
sample's crc32 against it. No payload is decoded. ``parts_agree`` joins the parts' answers into the
shard's: the parts chain (each starts where the one before ended, the first at byte 0, the last at the
end-of-archive), agree on the layout, and hold the index's sample count. A yes is final; anything else
(damage, or a tar another tool wrote with other header bytes) is no verdict: the caller walks the
archive member by member (``tar_format.read_archive``) to name what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from repack.manifest import ManifestError
from repack.manifest.shard_index import IndexColumns, parse_index
from repack.sinks.keys import row_hashes
from repack.sinks.sample_checksums import HEADER, MAGIC, checksums_size, sample_crcs
from repack.sinks.tar_format import (_HEADER_TEMPLATE, _TEMPLATE_SUM, BLOCK, INDEX_VERSION, MAX_MEMBER_SIZE,
                                     end_of_archive)

_TEMPLATE = np.frombuffer(bytes(_HEADER_TEMPLATE), dtype=np.uint8)
_SIZE_SHIFTS = np.arange(30, -1, -3, dtype=np.int64)  # 11 octal digits
_SUM_SHIFTS = np.arange(15, -1, -3, dtype=np.int64)  # 6 octal digits
_ZERO, _DOT, _SLASH = ord("0"), ord("."), ord("/")
MAX_NAME = 100  # bytes of a ustar name field


@dataclass(frozen=True)
class PartCheck:
    """One part's lines matched the archive: where they sit (``first_sample``: the number of the part's
    first sample in the shard; ``start``: its first member's data offset; ``end``: the end of its last
    member's padded data), the index's sample count (``count``), the layout (members per sample, the
    exts after the first), the first and last sample keys, and each sample's key hash (``key_hashes``).
    ``offsets`` and ``keys`` (rows of bytes, NUL padded) stay in the process that made them."""

    count: int
    first_sample: int
    samples: int
    start: int
    end: int
    per_sample: int
    layout: tuple[str, ...]
    first_key: bytes
    last_key: bytes
    key_hashes: np.ndarray
    offsets: np.ndarray | None = None
    keys: np.ndarray | None = None

    def summary(self) -> dict:
        """The fields another process needs (``parts_agree``), as JSON-ready values; the key hashes
        travel as raw bytes beside it."""
        return {"count": self.count, "first_sample": self.first_sample, "samples": self.samples,
                "start": self.start, "end": self.end, "per_sample": self.per_sample, "layout": list(self.layout),
                "first_key": self.first_key.hex(), "last_key": self.last_key.hex()}

    @classmethod
    def from_summary(cls, summary: dict, key_hashes: bytes) -> PartCheck:
        return cls(summary["count"], summary["first_sample"], summary["samples"], summary["start"], summary["end"],
                   summary["per_sample"], tuple(summary["layout"]), bytes.fromhex(summary["first_key"]),
                   bytes.fromhex(summary["last_key"]), np.frombuffer(key_hashes, dtype=np.uint64))


@dataclass(frozen=True)
class TarColumns:
    """A tar shard that matches its index: per member data offsets (archive order), the members per
    sample, and each sample's key as a row of bytes (``keys``: uint8, samples x width, NUL padded)."""

    offsets: np.ndarray
    per_sample: int
    keys: np.ndarray


def check_against_index(tar, index: bytes) -> TarColumns | None:
    """``TarColumns`` when ``tar`` (the archive's bytes: bytes, mmap or memoryview) and ``index`` (the
    ``.idx`` file's bytes) are exactly what repack writes for each other; None otherwise (not a verdict:
    walk the archive to find the problem). The whole shard as one part."""
    part = check_part(tar, index, 0, 1)
    if part is None or not parts_agree([part]):
        return None
    return TarColumns(part.offsets, part.per_sample, part.keys)


def part_lines(index: bytes, part: int, parts: int) -> tuple[int, int, int]:
    """(first byte, end byte, number of the first sample) of the lines of ``index`` that begin in the
    ``part``-th of ``parts`` equal slices of its text after the header line."""
    body = index.find(b"\n") + 1
    length = len(index) - body

    def line_start(at: int) -> int:
        if at <= body:
            return body
        found = index.find(b"\n", at - 1)
        return len(index) if found < 0 else found + 1

    start = line_start(body + part * length // parts)
    end = line_start(body + (part + 1) * length // parts) if part + 1 < parts else len(index)
    return start, end, index.count(b"\n", body, start)


def check_part(tar, index: bytes, part: int, parts: int, checksums: bytes | None = None) -> PartCheck | None:
    """``PartCheck`` when the lines of ``part`` (``part_lines``) are canonical and the members they name
    are exactly repack's archive (``tar``: the whole archive's bytes) and, given ``checksums`` (the whole
    ``.crc`` file), their crc32s are its entries; None otherwise. The last part also checks that the
    end-of-archive follows its last member and ends the file; the first, the ``.crc`` file's header."""
    first_newline = index.find(b"\n")
    if first_newline < 0 or not index.endswith(b"\n"):
        return None
    head = index[:first_newline].split(b" ")
    if len(head) != 2 or head[0] != INDEX_VERSION.encode() or not head[1].isdigit() or \
            index[:first_newline] != f"{INDEX_VERSION} {int(head[1])}".encode():
        return None
    count = int(head[1])
    start, end, first_sample = part_lines(index, part, parts)
    lines = index[start:end]
    samples = lines.count(b"\n")
    if first_sample + samples > count:
        return None
    data = np.frombuffer(tar, dtype=np.uint8)
    if len(data) % BLOCK:
        return None
    last = part + 1 == parts
    if not samples:
        if last and (first_sample or not _ends(data, 0)):
            return None
        empty = np.zeros(0, np.uint64)
        return PartCheck(count, first_sample, 0, 0, 0, 0, (), b"", b"", empty, np.zeros(0, np.int64),
                         np.zeros((0, 1), np.uint8))
    try:
        columns = parse_index(b"%s %d\n%s" % (INDEX_VERSION.encode(), samples, lines), "index")
    except ManifestError:
        return None
    checked = _check_columns(data, columns, len(lines))
    if checked is None:
        return None
    offsets, sizes, per_sample, layout, keys, hashes = checked
    end_of_part = int(offsets[-1] + sizes[-1] + (-sizes[-1] % BLOCK))
    if part == 0 and offsets[0] != BLOCK or last and not _ends(data, end_of_part):
        return None
    if checksums is not None and not _crcs_match(checksums, tar, offsets, sizes, per_sample, first_sample,
                                                 count, part == 0):
        return None
    return PartCheck(count, first_sample, samples, int(offsets[0]), end_of_part, per_sample, layout,
                     keys[0].tobytes().rstrip(b"\0"), keys[-1].tobytes().rstrip(b"\0"), hashes, offsets, keys)


def parts_agree(parts: list[PartCheck]) -> bool:
    """The parts of one shard, in order, make up its index and archive: every line in one part, each
    part's members starting where the previous part's ended (the first at byte 0), one layout, adjacent
    samples' keys different across part boundaries."""
    if not parts or any(p.count != parts[0].count for p in parts):
        return False
    filled = [p for p in parts if p.samples]
    if sum(p.samples for p in filled) != parts[0].count or (parts[0].count and not parts[-1].samples):
        return False
    at = 0
    for before, after in zip([None, *filled], filled):
        if after.start != at + BLOCK or after.first_sample != (before.first_sample + before.samples if before else 0):
            return False
        if before is not None and (after.per_sample != before.per_sample or after.layout != before.layout
                                   or after.first_key == before.last_key):
            return False
        at = after.end
    return True


def _ends(data: np.ndarray, end: int) -> bool:
    """The file ends with exactly repack's end-of-archive after ``end``."""
    return len(data) == end + len(end_of_archive(end)) and not data[end:].any()


def _check_columns(data: np.ndarray, columns: IndexColumns, text_bytes: int):
    """(offsets, sizes, members per sample, layout, key rows, key hashes) when the parsed lines are
    canonical (``text_bytes`` long) and name exactly the members of ``data`` at their offsets; else None."""
    count, members = columns.samples, len(columns.ext)
    per_sample = int(columns.first_member[1])
    if not per_sample or np.any(np.diff(columns.first_member.astype(np.int64)) != per_sample):
        return None
    ok_pair, ext_lengths, tail_lengths = _name_tables(columns)
    if not ok_pair[columns.suffix, columns.ext].all():
        return None  # a name that is not the sample key + "." + the index's ext
    keys = columns.keys
    key_lengths = np.diff(columns.key_ends.astype(np.int64))
    if not len(keys) or (key_lengths == 0).any() or (keys == _SLASH).any():
        return None
    offsets, sizes = columns.offset.astype(np.int64), columns.size.astype(np.int64)
    name_lengths = key_lengths.repeat(per_sample) + tail_lengths[columns.suffix]
    if int(name_lengths.max()) > MAX_NAME:
        return None
    # every token is followed by one separator; digits-only numbers are canonical when no longer than their value
    canonical = int(ext_lengths[columns.ext].sum() + name_lengths.sum() + _digits(offsets).sum()
                    + _digits(sizes).sum()) + 4 * members
    if text_bytes != canonical or (sizes > MAX_MEMBER_SIZE).any():
        return None
    padded = sizes + (-sizes % BLOCK)
    if not np.array_equal(offsets[1:], offsets[:-1] + padded[:-1] + BLOCK) or offsets[0] < BLOCK \
            or offsets[-1] + padded[-1] + 2 * BLOCK > len(data):
        return None
    ext_table = columns.ext.reshape(count, per_sample)
    if not (ext_table[:, 1:] == ext_table[:1, 1:]).all():
        return None
    width = int(name_lengths.max())
    names = columns.name_fields(np.arange(count).repeat(per_sample), np.arange(members), width)
    if not _headers_match(data, offsets, names, sizes):
        return None
    rows = _key_rows(columns, key_lengths)
    hashes = row_hashes(rows)
    same = np.flatnonzero(hashes[1:] == hashes[:-1])
    if len(same) and (rows[same] == rows[same + 1]).all(axis=1).any():
        return None  # adjacent samples with one key
    layout = tuple(columns.exts[int(code)] for code in ext_table[0, 1:])
    return offsets, sizes, per_sample, layout, rows, hashes


def _name_tables(columns: IndexColumns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ok[suffix code, ext code]: the suffix is "." + that ext after the sample key, a flat name;
    bytes of each ext; bytes of each suffix)."""
    exts = [e.encode("ascii") for e in columns.exts]
    ok = np.zeros((max(1, len(columns.suffixes)), max(1, len(exts))), bool)
    for s, (keyed, tail) in enumerate(columns.suffixes):
        for e, ext in enumerate(exts):
            ok[s, e] = keyed and tail == b"." + ext and 0 < len(ext) <= MAX_NAME and b"/" not in ext
    return (ok, np.array([len(e) for e in exts] or [0], np.int64),
            np.array([len(t) for _, t in columns.suffixes] or [0], np.int64))


_ROWS = 2048  # headers compared at a time: the working rows stay in the CPU's cache


def _headers_match(data: np.ndarray, offsets: np.ndarray, names: np.ndarray, sizes: np.ndarray) -> bool:
    """The 512-byte block before each member's data is the header repack writes for it (its template
    with the member's name row, octal size and checksum), compared ``_ROWS`` members at a time."""
    blocks = data.view(np.uint64).reshape(-1, BLOCK // 8)
    expected = np.empty((min(_ROWS, len(sizes)), BLOCK), np.uint8)
    expected[:] = _TEMPLATE
    expected[:, 155] = 32
    found = np.empty((len(expected), BLOCK // 8), np.uint64)
    width = names.shape[1]
    size_digits = (((sizes[:, None] >> _SIZE_SHIFTS) & 7) + _ZERO).astype(np.uint8)
    sums = _TEMPLATE_SUM + names.sum(axis=1, dtype=np.int64) + size_digits.sum(axis=1, dtype=np.int64)
    sum_digits = (((sums[:, None] >> _SUM_SHIFTS) & 7) + _ZERO).astype(np.uint8)
    for lo in range(0, len(sizes), _ROWS):
        hi = min(lo + _ROWS, len(sizes))
        rows, got = expected[:hi - lo], found[:hi - lo]
        rows[:, :width] = names[lo:hi]
        rows[:, 124:135] = size_digits[lo:hi]
        rows[:, 148:154] = sum_digits[lo:hi]
        np.take(blocks, (offsets[lo:hi] - BLOCK) // BLOCK, axis=0, out=got)
        if not np.array_equal(got, rows.view(np.uint64)):
            return False
    return True


def _key_rows(columns: IndexColumns, key_lengths: np.ndarray) -> np.ndarray:
    """Each sample's key as a uint8 row, NUL padded to the longest."""
    width = int(key_lengths.max())
    if columns.key_width == width:
        return columns.keys.reshape(-1, width)
    rows = np.zeros((len(key_lengths), width), np.uint8)
    live = np.arange(width) < key_lengths[:, None]
    rows[live] = columns.keys
    return rows


def _crcs_match(checksums: bytes, tar, offsets: np.ndarray, sizes: np.ndarray, per_sample: int,
                first_sample: int, count: int, first_part: bool) -> bool:
    """The part's samples' crc32s are their entries in the ``.crc`` file (and, for the first part, the
    file's header and length are those of ``count`` samples)."""
    if len(checksums) != checksums_size(count):
        return False
    if first_part and checksums[:HEADER.size] != HEADER.pack(MAGIC, count):
        return False
    samples = len(offsets) // per_sample
    stored = np.frombuffer(checksums, dtype="<u4", count=samples, offset=HEADER.size + 4 * first_sample)
    return bool(np.array_equal(sample_crcs(tar, offsets, sizes, per_sample), stored))


def _digits(values: np.ndarray) -> np.ndarray:
    """How many decimal digits each of ``values`` (below 10**18) is written with."""
    return np.searchsorted(10 ** np.arange(1, 19, dtype=np.int64), values, side="right") + 1
