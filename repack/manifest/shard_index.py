"""A dataset's DALI index files (``.idx``, format in ``repack.sinks.tar_format``) as flat numpy
columns: the general parser of ``.idx`` text in the project. The readers (``pipelines``) and ``repack
remove`` (``repack.lifecycle.shard_index``) read an index through ``parse_index``; ``repack verify``
(``repack.sinks.tar_check``) first checks a part's lines in the exact form repack writes
(``canonical_lines``) and shard-walks whatever is not in that form; the only module of ``repack.manifest`` that uses numpy (the readers may import
only ``repack.manifest``, and an index of millions of members needs columns).

For the readers it is their one in-memory index, built once when a dataset opens and shared by its
DataLoader workers (they fork after it is built; numpy buffers stay shared copy-on-write, where a
Python object per sample would be copied page by page as its reference counts change).

Per sample (its global number: the shards' samples concatenated in manifest order):
``first_member`` (where its members start in the member columns) and its key (``keys`` blob,
``key_ends``). Per member: ``ext`` and ``suffix`` (codes into the small tables ``exts`` and
``suffixes``: a member's name is the sample key + suffix, or the suffix alone where the name does not
start with the key), data ``offset`` and ``size``. About 50 bytes per sample of three members; each
column takes the narrowest unsigned type that holds it.

Parsing is vectorized over the index text (no Python object per line or token); every check of the
line-by-line parser holds: the header ``v1.2 <samples>``, lines of four-token groups separated by
single spaces, decimal offsets and sizes, printable ASCII only. A failure is a ``ManifestError``
naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator

import dataclasses
import mmap

import numpy as np

from repack.distinct import distinct
from repack.manifest import ManifestError

SPACE, NEWLINE, DOT = 32, 10, 46
Allocate = Callable[[int, np.dtype], np.ndarray]  # (count, dtype) -> a writable array of count items
_MAX_DIGITS = 18  # offsets and sizes below 10**18: int64 holds them
_KEYED, _WHOLE = b"k", b"n"  # suffix table tag: after the sample key, or the whole name


@dataclass(frozen=True)
class IndexColumns:
    """The index of a dataset (or of one shard) as columns; see the module docstring."""

    shard_starts: np.ndarray  # (shards + 1,) global number of each shard's first sample
    first_member: np.ndarray  # (samples + 1,)
    key_ends: np.ndarray  # (samples + 1,) sample i's key is keys[key_ends[i]:key_ends[i + 1]]
    keys: np.ndarray  # uint8 blob
    ext: np.ndarray  # (members,) code into exts
    suffix: np.ndarray  # (members,) code into suffixes
    offset: np.ndarray  # (members,) first data byte in the tar
    size: np.ndarray  # (members,)
    exts: tuple  # str per code
    suffixes: tuple  # (keyed: bool, bytes) per code
    key_width: int = -1  # the length of every key when all are as long (then ``keys`` is a matrix), else -1

    @property
    def samples(self) -> int:
        return len(self.first_member) - 1

    def shard_of(self, samples: np.ndarray) -> np.ndarray:
        """The shard number of each global sample number."""
        return np.searchsorted(self.shard_starts, samples, side="right") - 1

    def members_of(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(member numbers of ``samples``, in order, each sample's members in index order; how many
        each sample has)."""
        first = self.first_member[samples].astype(np.int64)
        counts = self.first_member[samples + 1].astype(np.int64) - first
        return ragged_ranges(first, counts), counts

    def key(self, sample: int) -> str:
        return self.keys[int(self.key_ends[sample]):int(self.key_ends[sample + 1])].tobytes().decode("ascii")

    def names(self, sample: int) -> tuple[str, ...]:
        """The member names the index gives for ``sample``, in index order."""
        key = self.key(sample)
        out = []
        for m in range(int(self.first_member[sample]), int(self.first_member[sample + 1])):
            keyed, tail = self.suffixes[int(self.suffix[m])]
            out.append((key if keyed else "") + tail.decode("ascii"))
        return tuple(out)

    def name_fields(self, samples: np.ndarray, members: np.ndarray, width: int = 100) -> np.ndarray:
        """(members, width) uint8: each member's name NUL-padded to ``width`` bytes (a ustar name
        field), ``samples`` giving each member's sample; a longer name is cut (it matches no field)."""
        table, lengths, keyed = _suffix_table(self.suffixes)
        code = self.suffix[members].astype(np.int64)
        k = self.key_width
        if k >= 0 and keyed.all() and k + table.shape[1] <= width:  # the common case: rows copied whole
            out = np.zeros((len(members), width), dtype=np.uint8)
            if k:
                out[:, :k] = self.keys.reshape(-1, k)[samples]
            out[:, k:k + table.shape[1]] = table[code]
            return out
        # rows grouped by key length (few distinct lengths): the key's bytes, then the suffix row
        key_lo = self.key_ends[samples].astype(np.int64)
        key_len = np.minimum(np.where(keyed[code], self.key_ends[samples + 1].astype(np.int64) - key_lo, 0), width)
        out = np.zeros((len(members), width), dtype=np.uint8)
        for n in distinct(key_len).tolist():
            at = np.flatnonzero(key_len == n)
            if n:
                out[at, :n] = self.keys[key_lo[at, None] + np.arange(n)]
            tail = min(table.shape[1], width - n)
            if tail > 0:
                out[at, n:n + tail] = table[code[at], :tail]
        return out


@lru_cache(maxsize=8)
def _suffix_table(suffixes: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    width = max([len(t) for _, t in suffixes], default=0) or 1
    table = np.zeros((max(len(suffixes), 1), width), dtype=np.uint8)
    for i, (_, tail) in enumerate(suffixes):
        table[i, :len(tail)] = np.frombuffer(tail, dtype=np.uint8)
    lengths = np.array([len(t) for _, t in suffixes] or [0], dtype=np.int64)
    keyed = np.array([k for k, _ in suffixes] or [True], dtype=bool)
    return table, lengths, keyed


def ragged_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` without a Python loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - counts - starts, counts)


_CUT_LOOKBACK = 4096  # bytes before a piece's end searched for its last newline first
CHUNK_BYTES = 4 << 20  # index text parsed at a time: its working arrays stay tens of MB, whatever the shard


def parse_index(raw: bytes, where: str, layout: bool = True) -> IndexColumns:
    """One ``.idx`` file's bytes as the columns of a one-shard index (``ManifestError`` naming
    ``where`` when it is not a well-formed v1.2 index). Parsed ``CHUNK_BYTES`` of lines at a time.
    ``layout=False``: lines taken out of an index (its key read from one line), not checked as its tar's."""
    count, pieces = index_pieces(raw, where)
    return join_shards([[parse_piece(piece, where) for piece in pieces]], [count], [where], layout=layout)


def index_pieces(raw: bytes | mmap.mmap, where: str, chunk_bytes: int | None = None) -> tuple[int, list[np.ndarray]]:
    """(the sample count the header declares, the body cut into pieces of whole lines of about
    ``chunk_bytes`` (default ``CHUNK_BYTES``) each): what ``parse_piece`` takes, one piece at a time or
    several at once on threads (numpy parses with the GIL released)."""
    end = raw.find(b"\n")
    head = (raw[:] if end < 0 else raw[:end]).split()  # a slice: bytes, also of a mapping
    if not head and not bytes(raw).strip():  # a copy: only when the first line is blank
        raise ManifestError(f"{where}: empty index file")
    if len(head) != 2 or head[0] != b"v1.2" or not head[1].isdigit():
        raise ManifestError(f"{where}: not a v1.2 index with a matching sample count")
    body = np.frombuffer(raw, dtype=np.uint8, offset=end + 1 if end >= 0 else len(raw))
    if len(body) and body[-1] != NEWLINE:
        body = np.append(body, np.uint8(NEWLINE))
    chunk = max(1, chunk_bytes or CHUNK_BYTES)
    pieces, lo = [], 0
    while lo < len(body) or not pieces:
        hi = min(lo + chunk, len(body))
        if hi < len(body):  # at the chunk's last newline (past it only for a line longer than a chunk)
            tail = max(lo, hi - _CUT_LOOKBACK)  # looked for in the chunk's tail first: the text is not read twice
            cut = np.flatnonzero(body[tail:hi] == NEWLINE)
            if not len(cut) and tail > lo:
                tail, cut = lo, np.flatnonzero(body[lo:hi] == NEWLINE)
            hi = tail + int(cut[-1]) + 1 if len(cut) else hi + int(np.argmax(body[hi:] == NEWLINE)) + 1
        pieces.append(body[lo:hi])
        lo = hi
    return int(head[1]), pieces


def parse_piece(piece: np.ndarray, where: str) -> IndexColumns:
    """Whole lines of an index body (a piece from ``index_pieces``) as one-shard columns, each in its
    narrowest type (pieces wait for ``join_shards`` in about the room the joined index takes)."""
    columns = _parse_lines(piece, where)
    return dataclasses.replace(columns, **{name: _narrow(getattr(columns, name))
                                           for name in ("first_member", "key_ends", "offset", "size")})


def _narrow(values: np.ndarray) -> np.ndarray:
    return values.astype(narrowest(int(values.max(initial=0)) + 1), copy=False)


def join_shards(parts: list[list[IndexColumns]], counts: list[int], wheres: list[str],
                allocate: Allocate | None = None, map_parts: Callable = map, layout: bool = True) -> IndexColumns:
    """The parsed pieces of each shard (``parts[i]``: shard i's, in order) as one dataset index, each
    shard checked against the sample count its header declares (``counts[i]``) and (``layout``) laid out as
    its tar (``_check_member_layout``), codes merged once (the joined columns from ``allocate``, the pieces
    copied by ``map_parts``, as in ``concat``)."""
    for pieces, count, where in zip(parts, counts, wheres, strict=True):
        if sum(p.samples for p in pieces) != count:
            raise ManifestError(f"{where}: not a v1.2 index with a matching sample count")
    return _joined([p for pieces in parts for p in pieces], counts, wheres, allocate, map_parts, layout)


def _joined(parts: list[IndexColumns], counts: list[int], wheres: list[str], allocate: Allocate | None,
            map_parts: Callable, layout: bool) -> IndexColumns:
    """``parts`` (whose shards' sample counts were checked) concatenated, with the shards' starts."""
    joined = concat(parts, allocate, map_parts)
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    joined = dataclasses.replace(joined, shard_starts=starts)
    if layout:
        _check_member_layout(joined, wheres)
    return joined


@dataclass(frozen=True)
class IndexJob:
    """Index text parsed at once (``parse_job``): a piece of one shard's index, or the whole bodies of
    consecutive small index files joined (``bodies``, with their ``wheres``: to name the file at fault)."""

    text: np.ndarray | None  # whole lines (None once parsed)
    shards: range  # the shard numbers whose lines it holds
    where: str
    bodies: tuple = ()
    wheres: tuple = ()


def small_index_bytes(piece_bytes: int) -> int:
    """The size under which ``index_jobs`` joins an index with its neighbours (a reader reads such a file
    rather than mapping it)."""
    return piece_bytes // 4


def index_jobs(cut: list[tuple[int, list[np.ndarray]]], wheres: list[str], piece_bytes: int,
               first_shard: int = 0) -> list[IndexJob]:
    """The pieces of every shard's index (``cut[i]``: shard ``first_shard + i``'s ``index_pieces``, named
    ``wheres[i]``) as parse jobs of about ``piece_bytes`` each: a large index's pieces one by one, small
    indexes (``small_index_bytes``) joined with their neighbours (a dataset of many small shards: a parse
    per shard costs ~1 ms of numpy calls whatever its size). A joined index's line count is checked
    against its header here."""
    jobs: list[IndexJob] = []
    group: list[int] = []
    size = 0

    def close() -> None:
        nonlocal size
        if len(group) == 1:
            jobs.append(IndexJob(cut[group[0]][1][0], shards(group[0], group[0]), wheres[group[0]]))
        elif group:
            bodies = tuple(cut[i][1][0] for i in group)
            jobs.append(IndexJob(np.concatenate(bodies), shards(group[0], group[-1]),
                                 f"{wheres[group[0]]} .. {wheres[group[-1]]}", bodies, tuple(wheres[i] for i in group)))
        group.clear()
        size = 0

    def shards(first: int, last: int) -> range:
        return range(first_shard + first, first_shard + last + 1)

    for shard, (count, pieces) in enumerate(cut):
        if len(pieces) == 1 and len(pieces[0]) < small_index_bytes(piece_bytes):
            if int(np.count_nonzero(pieces[0] == NEWLINE)) != count:
                raise ManifestError(f"{wheres[shard]}: not a v1.2 index with a matching sample count")
            group.append(shard)
            size += len(pieces[0])
            if size >= piece_bytes:
                close()
            continue
        close()
        jobs.extend(IndexJob(piece, shards(shard, shard), wheres[shard]) for piece in pieces)
    close()
    return jobs


def parse_job(job: IndexJob) -> IndexColumns:
    """``parse_piece`` of a job's text; a failure in joined bodies is named by the file it is in."""
    try:
        return parse_piece(job.text, job.where)
    except ManifestError:
        for body, where in zip(job.bodies, job.wheres):
            parse_piece(body, where)
        raise


def parse_index_set(read: Callable[[int], bytes | mmap.mmap], wheres: list[str], expected: list[int],
                    piece_bytes: int, at_once: int, map_read: Callable = map,
                    parse: Callable[[IndexJob], IndexColumns] | None = None, map_parse: Callable = map,
                    allocate: Allocate | None = None) -> IndexColumns:
    """The index files ``0 .. len(wheres) - 1`` of a dataset (``read(i)``: file i's bytes, named
    ``wheres[i]``; ``expected[i]``: the samples its manifest entry declares) as one ``IndexColumns``, each
    file's lines counted and laid out as its tar: read ``at_once`` files at a time (a mapped file holds a
    descriptor) by ``map_read``, parsed in ``index_jobs`` by ``parse`` (default ``parse_job``) over
    ``map_parse``, joined once (into arrays from ``allocate``, copied by ``map_parse``). A file whose header
    declares another count than ``expected`` raises, naming it."""
    jobs: list[IndexJob] = []
    parsed: list[IndexColumns] = []
    for batch_jobs, batch_parsed in _parsed_batches(read, wheres, expected, piece_bytes, at_once, map_read,
                                                    parse or parse_job, map_parse):
        jobs += batch_jobs
        parsed += batch_parsed
    return join_jobs(jobs, parsed, expected, wheres, allocate, map_parse)


def _parsed_batches(read: Callable[[int], bytes | mmap.mmap], wheres: list[str], expected: list[int],
                    piece_bytes: int, at_once: int, map_read: Callable, parse: Callable[[IndexJob], IndexColumns],
                    map_parse: Callable) -> Iterator[tuple[list[IndexJob], list[IndexColumns]]]:
    """``parse_index_set``'s batches: per ``at_once`` files, their jobs (text dropped) and columns."""
    for lo in range(0, len(wheres), at_once):
        batch = range(lo, min(lo + at_once, len(wheres)))
        cut = list(map_read(lambda i: index_pieces(read(i), wheres[i], piece_bytes), batch))
        for i, (count, _) in zip(batch, cut):
            if count != expected[i]:
                raise ManifestError(f"{wheres[i]}: {count} samples, the manifest says {expected[i]}")
        jobs = index_jobs(cut, wheres[lo:batch.stop], piece_bytes, first_shard=lo)
        del cut  # what is left of the files' text is in the jobs: each file's mapping ends with its last job
        parsed = list(map_parse(parse, jobs))
        yield [dataclasses.replace(job, text=None, bodies=()) for job in jobs], parsed


def join_jobs(jobs: list[IndexJob], parsed: list[IndexColumns], counts: list[int], wheres: list[str],
              allocate: Allocate | None = None, map_parts: Callable = map) -> IndexColumns:
    """``join_shards`` of parsed ``index_jobs`` (``parsed[j]``: job j's columns): each shard's lines
    counted against ``counts`` (its header's), then joined and laid out as its tar."""
    held = np.zeros(len(counts), dtype=np.int64)
    for job, part in zip(jobs, parsed, strict=True):
        if len(job.shards) > 1:  # whole small files, counted by index_jobs
            held[job.shards.start:job.shards.stop] = counts[job.shards.start:job.shards.stop]
        else:
            held[job.shards.start] += part.samples
    wrong = np.flatnonzero(held != np.asarray(counts, dtype=np.int64))
    if len(wrong):
        raise ManifestError(f"{wheres[int(wrong[0])]}: not a v1.2 index with a matching sample count")
    return _joined(parsed, counts, wheres, allocate, map_parts, True)


TAR_BLOCK = 512  # a ustar header, and the unit data is padded to


def _check_member_layout(index: IndexColumns, wheres: list[str]) -> None:
    """ManifestError naming the shard whose index does not list its tar's members as repack writes them, back
    to back (the first member's data after one header block, each next one a header block after the previous
    member's padded data: a line repeated, moved or dropped, or a member left out, would read a sample twice,
    another never, or a sample without a member), or gives a sample two members of one extension (the reader
    would keep one and drop the other)."""
    if not len(index.offset):
        return
    offset = index.offset.astype(np.int64, copy=False)
    step = index.size[:-1].astype(np.int64)  # a member's padded data and the next member's header
    step += 2 * TAR_BLOCK - 1
    step &= ~(TAR_BLOCK - 1)
    step += offset[:-1]
    bad = np.empty(len(offset), dtype=bool)
    np.not_equal(offset[1:], step, out=bad[1:])
    firsts = index.first_member[index.shard_starts[:-1]].astype(np.int64)
    firsts = firsts[firsts < len(offset)]
    bad[firsts] = offset[firsts] != TAR_BLOCK  # each shard's first member: after its tar's first header
    if bad.any():
        member = int(np.argmax(bad))
        raise ManifestError(_where_member(index, wheres, member, "member is not where the member listed before it "
                                          "ends in the tar: a line repeated, moved or dropped, or a member left out"))
    per_sample = np.diff(index.first_member.astype(np.int64, copy=False))
    if len(per_sample) and per_sample.min() == per_sample.max() > 1:  # the usual case: one layout, as a matrix
        grid = index.ext.reshape(-1, int(per_sample[0]))
        same = np.zeros(len(grid), dtype=bool)
        for left in range(grid.shape[1] - 1):  # a few members a sample: every pair of columns
            for right in range(left + 1, grid.shape[1]):
                same |= grid[:, left] == grid[:, right]
        twice = np.flatnonzero(same)
        member = int(index.first_member[twice[0]]) if len(twice) else -1
    else:
        sample_of = np.repeat(np.arange(len(per_sample)), per_sample)
        pairs = np.sort(sample_of * (len(index.exts) + 1) + index.ext.astype(np.int64))
        again = np.flatnonzero(pairs[1:] == pairs[:-1])
        member = int(index.first_member[pairs[again[0]] // (len(index.exts) + 1)]) if len(again) else -1
    if member >= 0:
        raise ManifestError(_where_member(index, wheres, member, "line gives two members one extension"))


def _where_member(index: IndexColumns, wheres: list[str], member: int, problem: str) -> str:
    """The message for ``member`` (a global member number) of a joined index: the shard and its sample."""
    shard = int(np.searchsorted(index.first_member[index.shard_starts].astype(np.int64), member, side="right")) - 1
    sample = int(np.searchsorted(index.first_member.astype(np.int64), member, side="right")) - 1
    return f"{wheres[shard]}: not a v1.2 index of its tar (sample {sample - int(index.shard_starts[shard])}'s {problem})"


def _parse_lines(body: np.ndarray, where: str) -> IndexColumns:
    """Whole lines of an index (each ending in a newline) as one-shard columns."""
    if np.count_nonzero(body < SPACE) != np.count_nonzero(body == NEWLINE) or body.max(initial=0) > 126:
        raise ManifestError(f"{where}: not a v1.2 index (a byte that is not printable ASCII)")
    seps = np.flatnonzero(body <= SPACE)  # spaces and newlines: the only bytes below 33 left
    newline = body[seps] == NEWLINE
    line_ends = np.flatnonzero(newline)  # token number of each line's last token
    count = len(line_ends)
    if not count:
        return concat([])
    starts = np.empty(len(seps), dtype=np.int64)
    starts[0:1] = 0
    starts[1:] = seps[:-1] + 1
    lengths = seps - starts
    per_line = np.diff(line_ends, prepend=-1)
    if np.any(per_line % 4) or not np.all(per_line) or not np.all(lengths):
        _malformed(body, seps, line_ends, lengths, where)
    rows = _Rows(body, int(lengths.max(initial=0)))
    offset, offset_ok = rows.decimal(starts[1::4], lengths[1::4])
    size, size_ok = rows.decimal(starts[2::4], lengths[2::4])
    if not (offset_ok.all() and size_ok.all()):
        _malformed(body, seps, line_ends, lengths, where)
    first_member = np.zeros(count + 1, dtype=np.int64)
    first_member[1:] = (line_ends + 1) // 4
    exts, ext = rows.codes(starts[0::4], lengths[0::4])
    name_s, name_n = starts[3::4], lengths[3::4]
    # the key: the first member's name up to its first dot (the whole name without one)
    head_s, head_n = name_s[first_member[:-1]], name_n[first_member[:-1]]
    head_rows, width = rows.take(head_s, head_n)
    dotted = head_rows == DOT
    key_n = np.where(dotted.any(axis=1), dotted.argmax(axis=1), head_n) if width else head_n
    key_ends = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(key_n, out=key_ends[1:])
    keys = head_rows[np.arange(width) < key_n[:, None]] if width else np.zeros(0, dtype=np.uint8)
    # each member's name: the key + a suffix when it starts with the key, else a whole name
    sample_of = np.repeat(np.arange(count), np.diff(first_member))
    m_key_n = key_n[sample_of]
    keyed = name_n >= m_key_n
    others = np.ones(len(name_s), dtype=bool)
    others[first_member[:-1]] = False  # a sample's first name starts with its key by definition
    others = np.flatnonzero(others)
    if len(others) and width:
        name_rows, _ = rows.take(name_s[others], np.minimum(name_n[others], width))
        in_key = np.arange(name_rows.shape[1]) < m_key_n[others, None]
        keyed[others] &= ~np.any(in_key & (name_rows != head_rows[sample_of[others], :name_rows.shape[1]]), axis=1)
    tail_s = np.where(keyed, name_s + m_key_n, name_s)
    tail_n = np.where(keyed, name_n - m_key_n, name_n)
    suffixes, suffix = rows.codes(tail_s, tail_n, tag=np.where(keyed, _KEYED[0], _WHOLE[0]))
    return IndexColumns(np.array([0, count], dtype=np.int64), first_member, key_ends, keys, ext, suffix,
                        offset, size, tuple(e.decode("ascii") for _, e in exts),
                        tuple((tag == _KEYED, tail) for tag, tail in suffixes), _same_width(key_n))


def _same_width(lengths: np.ndarray) -> int:
    return int(lengths[0]) if len(lengths) and np.all(lengths == lengths[0]) else (0 if not len(lengths) else -1)


def _malformed(body: np.ndarray, seps: np.ndarray, line_ends: np.ndarray, lengths: np.ndarray, where: str):
    """Raise the ManifestError that quotes the first malformed line (the slow, exact check: only on failure)."""
    lo = 0
    for end in seps[line_ends]:
        text = body[lo:int(end)].tobytes().decode("ascii")
        tokens = text.split(" ")
        if (len(tokens) % 4 or not all(tokens) or
                not all(t.isdigit() and len(t) <= _MAX_DIGITS for i, t in enumerate(tokens) if i % 4 in (1, 2))):
            raise ManifestError(f"{where}: malformed index line {text[:80]!r}")
        lo = int(end) + 1
    raise ManifestError(f"{where}: malformed index")


class _Rows:
    """Tokens of an index body as rows of a 2-D uint8 array (each a copy of the bytes from the token's
    start, zeros past its end): one gather of contiguous rows instead of a pass per byte position."""

    def __init__(self, body: np.ndarray, width: int) -> None:
        pad = max(width, _MAX_DIGITS) + 1
        padded = np.zeros(pad + len(body) + pad, dtype=np.uint8)
        padded[pad:pad + len(body)] = body
        self.padded, self.pad = padded, pad

    def _window(self, width: int) -> np.ndarray:
        return np.lib.stride_tricks.as_strided(self.padded, shape=(len(self.padded) - width, width),
                                               strides=(1, 1), writeable=False)

    def take(self, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, int]:
        width = int(lengths.max(initial=0))
        rows = self._window(width)[starts + self.pad]
        rows *= np.arange(width, dtype=np.int64) < lengths[:, None]
        return rows, width

    def decimal(self, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values, which tokens are 1 to 18 decimal digits and nothing else)."""
        width = int(min(lengths.max(initial=0), _MAX_DIGITS))
        # each token's last ``width`` bytes, right-aligned: column j has weight 10 ** (width - 1 - j)
        rows = self._window(width)[starts + lengths - width + self.pad]
        live = np.arange(width, dtype=np.int64) >= width - lengths[:, None]
        rows -= np.uint8(48)  # a byte that is not a digit wraps above 9
        ok = (lengths > 0) & (lengths <= _MAX_DIGITS) & ~np.any(live & (rows > 9), axis=1)
        rows *= live
        values = np.zeros(len(starts), dtype=np.int64)
        for j in range(width):
            values *= 10
            values += rows[:, j]
        return values, ok

    def codes(self, starts: np.ndarray, lengths: np.ndarray,
              tag: np.ndarray | None = None) -> tuple[list[tuple[bytes, bytes]], np.ndarray]:
        """The distinct tokens (a tag byte + the token) and each token's code."""
        rows, width = self.take(starts, lengths)
        grid = np.zeros((len(starts), max(width + 1, 8)), dtype=np.uint8)
        grid[:, 0] = _KEYED[0] if tag is None else tag
        grid[:, 1:width + 1] = rows
        table, codes = _distinct(grid)
        return [(bytes(t[:1]), bytes(t[1:]).rstrip(b"\0")) for t in table], codes.astype(narrowest(len(table)))


_FEW = 16  # distinct tokens found by comparison before sorting takes over


def _distinct(grid: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """The distinct rows of ``grid`` and each row's number among them (few distinct rows, the normal
    case for extensions and name suffixes: one comparison pass each, no sort)."""
    codes = np.full(len(grid), -1, dtype=np.int64)
    keys = grid[:, :8].copy().view(np.uint64).ravel() if grid.shape[1] == 8 else None
    table: list[np.ndarray] = []
    for code in range(_FEW):
        left = np.flatnonzero(codes < 0)[:1]
        if not len(left):
            return table, codes
        row = grid[left[0]]
        same = (keys == keys[left[0]]) if keys is not None else np.all(grid == row, axis=1)
        codes[same] = code
        table.append(row)
    rows, codes = np.unique(grid.view(f"S{grid.shape[1]}").ravel(), return_inverse=True)
    return [np.frombuffer(r.ljust(grid.shape[1], b"\0"), dtype=np.uint8) for r in rows], codes


def narrowest(limit: int):
    """The narrowest unsigned dtype that holds values below ``limit``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if limit <= np.iinfo(dtype).max + 1:
            return dtype
    return np.int64


def concat(parts: list[IndexColumns], allocate: Allocate | None = None, map_parts: Callable = map) -> IndexColumns:
    """The one-shard indexes ``parts`` (in shard order) as one dataset index, codes merged; each joined
    per-sample or per-member column in an array from ``allocate(count, dtype)`` (default: a shared
    anonymous memory map of its own). Each part is copied into its place by ``map_parts(function,
    part numbers)`` (default ``map``; a thread pool's ``map`` copies parts at once: numpy copies with
    the GIL released)."""
    exts = tuple(sorted({e for p in parts for e in p.exts}))
    suffixes = tuple(sorted({s for p in parts for s in p.suffixes}))
    ext_code, suffix_code = {e: i for i, e in enumerate(exts)}, {s: i for i, s in enumerate(suffixes)}
    counts = np.array([p.samples for p in parts], dtype=np.int64)
    members = np.array([len(p.ext) for p in parts], dtype=np.int64)
    key_bytes = np.array([len(p.keys) for p in parts], dtype=np.int64)
    sample_at, member_at, key_at = (np.concatenate([[0], np.cumsum(a)]).astype(np.int64)
                                    for a in (counts, members, key_bytes))
    first_member = _allocated(int(sample_at[-1]) + 1, narrowest(int(member_at[-1]) + 1), allocate)
    key_ends = _allocated(int(sample_at[-1]) + 1, narrowest(int(key_at[-1]) + 1), allocate)
    keys = _allocated(int(key_at[-1]), np.uint8, allocate)
    ext = _allocated(int(member_at[-1]), narrowest(len(exts)), allocate)
    suffix = _allocated(int(member_at[-1]), narrowest(len(suffixes)), allocate)
    offset = _allocated(int(member_at[-1]), narrowest(max([int(p.offset.max(initial=0)) for p in parts],
                                                          default=0) + 1), allocate)
    size = _allocated(int(member_at[-1]), narrowest(max([int(p.size.max(initial=0)) for p in parts],
                                                        default=0) + 1), allocate)
    first_member[:1] = 0
    key_ends[:1] = 0

    def place(i: int) -> None:
        p, s0, s1, m0, m1 = parts[i], int(sample_at[i]), int(sample_at[i + 1]), int(member_at[i]), int(member_at[i + 1])
        np.add(p.first_member[1:], first_member.dtype.type(m0), out=first_member[s0 + 1:s1 + 1],
               dtype=first_member.dtype, casting="unsafe")
        np.add(p.key_ends[1:], key_ends.dtype.type(key_at[i]), out=key_ends[s0 + 1:s1 + 1], dtype=key_ends.dtype,
               casting="unsafe")
        keys[int(key_at[i]):int(key_at[i + 1])] = p.keys
        if m1 > m0:
            ext[m0:m1] = np.array([ext_code[e] for e in p.exts], dtype=ext.dtype)[p.ext]
            suffix[m0:m1] = np.array([suffix_code[t] for t in p.suffixes], dtype=suffix.dtype)[p.suffix]
        offset[m0:m1] = p.offset
        size[m0:m1] = p.size

    for _ in map_parts(place, range(len(parts))):
        pass
    return IndexColumns(sample_at, first_member, key_ends, keys, ext, suffix, offset, size, exts, suffixes,
                        _common_width([p.key_width for p in parts if p.samples]))


def _allocated(count: int, dtype, allocate: Allocate | None = None) -> np.ndarray:
    """An array of ``count`` items of ``dtype`` from ``allocate``, by default in a memory map of its own,
    not on the malloc heap: parsing's working arrays, once freed, leave no heap behind for forked
    workers to map."""
    if allocate is not None:
        return allocate(count, np.dtype(dtype))
    return np.frombuffer(mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize)), dtype=dtype, count=count)


def _common_width(widths: list[int]) -> int:
    return widths[0] if widths and all(w == widths[0] for w in widths) else (0 if not widths else -1)
