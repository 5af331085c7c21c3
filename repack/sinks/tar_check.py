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

import json
from dataclasses import dataclass

import numpy as np

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
    classes: tuple[tuple[int, int], ...] | None = None  # (class index, samples) of the .cls values; None: no .cls
    # (class index, the class its first sample's .json member names) per index; None: no .json member
    class_names: tuple[tuple[int, str | None], ...] | None = None

    def summary(self) -> dict:
        """The fields another process needs (``parts_agree``), as JSON-ready values; the key hashes
        travel as raw bytes beside it."""
        return {"count": self.count, "first_sample": self.first_sample, "samples": self.samples,
                "start": self.start, "end": self.end, "per_sample": self.per_sample, "layout": list(self.layout),
                "first_key": self.first_key.hex(), "last_key": self.last_key.hex(),
                "classes": None if self.classes is None else [list(pair) for pair in self.classes],
                "class_names": None if self.class_names is None else [list(pair) for pair in self.class_names]}

    @classmethod
    def from_summary(cls, summary: dict, key_hashes: bytes) -> PartCheck:
        classes, names = summary.get("classes"), summary.get("class_names")
        return cls(summary["count"], summary["first_sample"], summary["samples"], summary["start"], summary["end"],
                   summary["per_sample"], tuple(summary["layout"]), bytes.fromhex(summary["first_key"]),
                   bytes.fromhex(summary["last_key"]), np.frombuffer(key_hashes, dtype=np.uint64),
                   classes=None if classes is None else tuple((int(i), int(n)) for i, n in classes),
                   class_names=None if names is None else tuple((int(i), name) for i, name in names))


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
    checked = _check_columns(data, lines, samples)
    if checked is None:
        return None
    offsets, sizes, per_sample, layout, keys, hashes = checked
    end_of_part = int(offsets[-1] + sizes[-1] + (-sizes[-1] % BLOCK))
    if part == 0 and offsets[0] != BLOCK or last and not _ends(data, end_of_part):
        return None
    if checksums is not None and not _crcs_match(checksums, tar, offsets, sizes, per_sample, first_sample,
                                                 count, part == 0):
        return None
    values = class_values(data, offsets, sizes, per_sample, layout)
    return PartCheck(count, first_sample, samples, int(offsets[0]), end_of_part, per_sample, layout,
                     keys[0].tobytes().rstrip(b"\0"), keys[-1].tobytes().rstrip(b"\0"), hashes, offsets, keys,
                     counted(values), named_classes(data, offsets, sizes, per_sample, layout, values))


CLASS_EXT = "cls"  # the member holding a sample's class index, decimal digits
JSON_EXT = "json"  # the member holding a sample's metadata (``class``: its class's name)


def class_values(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, per_sample: int,
                 layout: tuple[str, ...]) -> np.ndarray | None:
    """Each sample's ``.cls`` value (int64) of the members at
    ``offsets`` (sample-major, ``per_sample`` a sample, ``layout`` the exts after the first; repack writes them
    zero-padded to one width, as DALI's pipeline reads them); None without a ``.cls`` member, or when one is not
    1 to 9 decimal digits (not counted: the readers refuse such a label by the sample's name)."""
    if CLASS_EXT not in layout:
        return None
    column = 1 + layout.index(CLASS_EXT)
    at = offsets.reshape(-1, per_sample)[:, column]
    size = sizes.reshape(-1, per_sample)[:, column]
    if not len(at):
        return np.zeros(0, np.int64)
    width = int(size.max())
    if size.min() < 1 or width > 9:
        return None
    rows = data[at[:, None] + np.arange(width)]
    live = np.arange(width) < size[:, None]
    digits = rows - np.uint8(_ZERO)  # a byte that is not a digit wraps above 9
    if (live & (digits > 9)).any():
        return None
    digits = np.where(live, digits, 0).astype(np.int64)
    return (digits @ 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)) // 10 ** (width - size)


def counted(values: np.ndarray | None):
    """(class index, samples) pairs, by index (sparse: a dataset of ImageNet-21k's or iNaturalist's ids holds few
    of them per part); None for None."""
    if values is None:
        return None
    if not len(values):
        return ()
    if int(values.max()) < 4 * len(values) + 1024:  # dense enough: a count per index up to the largest
        counts = np.bincount(values)
        present = np.flatnonzero(counts)
        return tuple(zip(present.tolist(), counts[present].tolist()))
    present, counts = np.unique(values, return_counts=True)
    return tuple(zip(present.tolist(), counts.tolist()))


def named_classes(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, per_sample: int,
                  layout: tuple[str, ...], values: np.ndarray | None):
    """(class index, the ``class`` its first sample's ``.json`` member names, None where it names none) per index
    of ``values``: what ``repack verify`` holds the manifest's class map against (a swap of two names moves no
    count); None without ``.json`` members or class values."""
    if values is None or JSON_EXT not in layout or not len(values):
        return None
    column = 1 + layout.index(JSON_EXT)
    at = offsets.reshape(-1, per_sample)[:, column]
    size = sizes.reshape(-1, per_sample)[:, column]
    present, first = np.unique(values, return_index=True)
    names = []
    for index, row in zip(present.tolist(), first.tolist()):
        try:
            name = json.loads(data[at[row]:at[row] + size[row]].tobytes()).get("class")
        except (ValueError, AttributeError):
            name = None
        names.append((index, name if isinstance(name, str) else None))
    return tuple(names)


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


def _check_columns(data: np.ndarray, lines: bytes, samples: int):
    """(offsets, sizes, members per sample, layout, key rows, key hashes) when ``lines`` (``samples``
    whole lines) are canonical and name exactly the members of ``data`` at their offsets; else None."""
    found = canonical_lines(lines, samples)
    if found is None:
        return None
    offsets, sizes, per_sample, layout, rows, names = found
    padded = sizes + (-sizes % BLOCK)
    if (sizes > MAX_MEMBER_SIZE).any() or offsets[0] < BLOCK or \
            not np.array_equal(offsets[1:], offsets[:-1] + padded[:-1] + BLOCK) or \
            offsets[-1] + padded[-1] + 2 * BLOCK > len(data):
        return None
    if not _headers_match(data, offsets, names, sizes):
        return None
    hashes = row_hashes(rows)
    same = np.flatnonzero(hashes[1:] == hashes[:-1])
    if len(same) and (rows[same] == rows[same + 1]).all(axis=1).any():
        return None  # adjacent samples with one key
    return offsets, sizes, per_sample, layout, rows, hashes


def canonical_lines(lines: bytes, samples: int):
    """(member offsets, sizes, members per sample, the exts after the first, key rows, name rows) of
    ``samples`` index lines (``lines``: whole lines) when each is byte for byte what repack writes:
    ``EXT OFFSET SIZE KEY.EXT`` per member, single spaces, one newline, the same members on every line
    after the first (whose ext may differ per line), decimal numbers without leading zeros, keys without
    ``.`` or ``/``, names of at most 100 bytes; else None. Rows are uint8, NUL padded. Each token is
    compared where it lies in the text (numpy over columns of token positions, no parse into strings)."""
    newline = lines.find(b"\n")
    tokens = lines[:newline].split(b" ")
    if newline < 0 or len(tokens) % 4 or not samples:
        return None
    per_sample = len(tokens) // 4
    exts = tokens[0::4]
    if any(not ext or b"/" in ext or len(ext) >= MAX_NAME for ext in exts):
        return None
    text = np.frombuffer(bytes(_PAD) + lines + bytes(_PAD), dtype=np.uint8)
    body = text[_PAD:_PAD + len(lines)]
    if body.max() > 126:
        return None
    seps = np.flatnonzero(body <= 32) + _PAD
    width = 4 * per_sample
    if len(seps) != samples * width:
        return None
    ends = seps.reshape(samples, width)
    kinds = text[ends]
    if not ((kinds[:, :-1] == 32).all() and (kinds[:, -1] == _NEWLINE).all()):
        return None
    starts = np.empty_like(ends)
    starts.flat[0] = _PAD
    starts.flat[1:] = seps[:-1] + 1
    lengths = ends - starts
    first_ext, first_codes = _first_exts(text, starts[:, 0], lengths[:, 0], exts[0])
    if first_ext is None:
        return None
    if any(not _all_equal(text, starts[:, 4 * j], lengths[:, 4 * j], exts[j]) for j in range(1, per_sample)):
        return None
    offsets, sizes = _decimals(text, starts[:, 1::4], lengths[:, 1::4]), _decimals(text, starts[:, 2::4], lengths[:, 2::4])
    if offsets is None or sizes is None:
        return None
    # keys: the first name without "." + its ext; every name is the key + "." + its ext
    suffix_lengths = np.array([len(ext) + 1 for ext in first_ext], np.int64)[first_codes]
    key_lengths = lengths[:, 3] - suffix_lengths
    if key_lengths.min() < 1 or key_lengths.max() >= MAX_NAME:
        return None
    keys = _rows(text, starts[:, 3], key_lengths)
    if ((keys == _DOT) | (keys == _SLASH)).any():
        return None
    tails = [b"." + ext for ext in first_ext] + [b"." + ext for ext in exts[1:]]
    codes = np.empty((samples, per_sample), np.int64)
    codes[:, 0] = first_codes
    codes[:, 1:] = len(first_ext) + np.arange(per_sample - 1)
    tail_lengths = np.array([len(tail) for tail in tails], np.int64)
    name_lengths = key_lengths[:, None] + tail_lengths[codes]
    if name_lengths.max() > MAX_NAME or not np.array_equal(name_lengths, lengths[:, 3::4]):
        return None
    names = _names(keys, key_lengths, tails, codes)
    if not np.array_equal(_rows(text, starts[:, 3::4].ravel(), name_lengths.ravel(), names.shape[1]), names):
        return None
    return offsets, sizes, per_sample, tuple(ext.decode() for ext in exts[1:]), keys, names


_PAD = 2 * MAX_NAME  # zero bytes around the text: a row taken at or before any token stays inside
_NEWLINE = 10


def _rows(text: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int | None = None) -> np.ndarray:
    """The bytes of the tokens at ``starts`` (each ``lengths`` long) as uint8 rows, NUL padded to
    ``width`` (default: the longest)."""
    width = int(lengths.max()) if width is None else width
    window = np.lib.stride_tricks.as_strided(text, shape=(len(text) - width + 1, width), strides=(1, 1),
                                             writeable=False)
    rows = window[starts]
    rows[np.arange(width) >= lengths[:, None]] = 0
    return rows


def _all_equal(text: np.ndarray, starts: np.ndarray, lengths: np.ndarray, token: bytes) -> bool:
    """Every token at ``starts`` is ``token``."""
    if not (lengths == len(token)).all():
        return False
    return all((text[starts + at] == byte).all() for at, byte in enumerate(token))


def _first_exts(text: np.ndarray, starts: np.ndarray, lengths: np.ndarray, first: bytes):
    """(the distinct exts of the lines' first members, each line's code among them), or (None, None)
    when one is not a flat ext."""
    if _all_equal(text, starts, lengths, first):
        return [first], np.zeros(len(starts), np.int64)
    if lengths.max() >= MAX_NAME:
        return None, None
    rows = _rows(text, starts, lengths)
    table, codes = np.unique(rows, axis=0, return_inverse=True)
    exts = [bytes(row).rstrip(b"\0") for row in table]
    if any(not ext or b"/" in ext or len(ext) >= MAX_NAME for ext in exts):
        return None, None
    return exts, codes.ravel().astype(np.int64)


def _decimals(text: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray | None:
    """The values of decimal tokens written as repack writes them (1 to 18 digits, no leading zero);
    None when one is not. Each token is read as the row of the ``width`` bytes that end where it ends
    (right-aligned: the bytes before it count as zeros), one matrix product with the powers of ten."""
    starts, lengths = starts.ravel(), lengths.ravel()
    width = int(lengths.max())
    if width > _MAX_DIGITS or ((text[starts] == _ZERO) & (lengths > 1)).any():
        return None
    window = np.lib.stride_tricks.as_strided(text, shape=(len(text) - width + 1, width), strides=(1, 1),
                                             writeable=False)
    digits = window[starts + lengths - width] - np.uint8(_ZERO)  # a byte that is not a digit wraps above 9
    digits[np.arange(width - 1, -1, -1) >= lengths[:, None]] = 0
    if digits.max() > 9:
        return None
    return digits.astype(np.int64) @ 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)


_MAX_DIGITS = 18


def _names(keys: np.ndarray, key_lengths: np.ndarray, tails: list[bytes], codes: np.ndarray) -> np.ndarray:
    """Each member's name (the sample's key + its tail) as a uint8 row, NUL padded: one row per member,
    the samples' members in order."""
    samples, per_sample = codes.shape
    tail_table = np.zeros((len(tails), max(map(len, tails))), np.uint8)
    for code, tail in enumerate(tails):
        tail_table[code, :len(tail)] = np.frombuffer(tail, np.uint8)
    width = int(key_lengths.max()) + tail_table.shape[1]
    names = np.zeros((samples, per_sample, width), np.uint8)
    distinct = np.flatnonzero(np.bincount(key_lengths)).tolist()  # not np.unique: it imports numpy.ma
    for length in distinct:
        at = np.flatnonzero(key_lengths == length) if len(distinct) > 1 else slice(None)
        names[at, :, :length] = keys[at, None, :length]
        names[at, :, length:length + tail_table.shape[1]] = tail_table[codes[at]]
    return names.reshape(samples * per_sample, width)


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
