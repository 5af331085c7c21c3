"""A dataset's DALI index files (``.idx``, format in ``pipelines.manifest_access``) as flat numpy
columns: the readers' one in-memory index, built once when a dataset opens and shared by its
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

import numpy as np

from repack.manifest import ManifestError

SPACE, NEWLINE, DOT = 32, 10, 46
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
        key_lo = self.key_ends[samples].astype(np.int64)
        key_len = self.key_ends[samples + 1].astype(np.int64) - key_lo
        table, lengths, keyed = _suffix_table(self.suffixes)
        code = self.suffix[members].astype(np.int64)
        key_len = np.where(keyed[code], key_len, 0)
        col = np.arange(width)
        out = np.zeros((len(members), width), dtype=np.uint8)
        in_key = col < key_len[:, None]
        rows, cols = np.nonzero(in_key)
        out[rows, cols] = self.keys[key_lo[rows] + cols]
        tail = col - key_len[:, None]
        in_tail = (tail >= 0) & (tail < lengths[code][:, None])
        rows, cols = np.nonzero(in_tail)
        out[rows, cols] = table[code[rows], tail[rows, cols]]
        return out


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


def parse_index(raw: bytes, where: str) -> IndexColumns:
    """One ``.idx`` file's bytes as the columns of a one-shard index (``ManifestError`` naming
    ``where`` when it is not a well-formed v1.2 index)."""
    end = raw.find(b"\n")
    head = (raw if end < 0 else raw[:end]).split()
    if not raw.strip():
        raise ManifestError(f"{where}: empty index file")
    if len(head) != 2 or head[0] != b"v1.2" or not head[1].isdigit():
        raise ManifestError(f"{where}: not a v1.2 index with a matching sample count")
    count = int(head[1])
    body = np.frombuffer(raw, dtype=np.uint8, offset=end + 1 if end >= 0 else len(raw))
    if len(body) and body[-1] != NEWLINE:
        body = np.append(body, np.uint8(NEWLINE))
    if np.count_nonzero(body < SPACE) != np.count_nonzero(body == NEWLINE) or body.max(initial=0) > 126:
        raise ManifestError(f"{where}: not a v1.2 index (a byte that is not printable ASCII)")
    seps = np.flatnonzero((body == SPACE) | (body == NEWLINE))
    line_ends = np.flatnonzero(body[seps] == NEWLINE)  # token number of each line's last token
    if len(line_ends) != count:
        raise ManifestError(f"{where}: not a v1.2 index with a matching sample count")
    starts = np.concatenate([[0], seps[:-1] + 1]).astype(np.int64)
    lengths = seps - starts
    per_line = np.diff(np.concatenate([[-1], line_ends]))
    bad = (per_line % 4 != 0) | (per_line == 0)
    tokens = np.arange(len(seps))
    line_of = np.searchsorted(line_ends, tokens)
    empty = lengths == 0
    bad[line_of[empty]] = True
    numeric = np.flatnonzero((tokens % 4 == 1) | (tokens % 4 == 2))
    _, number_ok = _decimal(body, starts[numeric], lengths[numeric])
    bad[line_of[numeric[~number_ok]]] = True
    if bad.any():
        line = int(np.argmax(bad))
        lo = 0 if line == 0 else int(seps[line_ends[line - 1]]) + 1
        text = body[lo:int(seps[line_ends[line]])].tobytes().decode("ascii")
        raise ManifestError(f"{where}: malformed index line {text[:80]!r}")
    first_member = np.concatenate([[0], (line_ends + 1) // 4]).astype(np.int64)
    ext_s, ext_n = starts[0::4], lengths[0::4]
    offset, _ = _decimal(body, starts[1::4], lengths[1::4])
    size, _ = _decimal(body, starts[2::4], lengths[2::4])
    name_s, name_n = starts[3::4], lengths[3::4]
    exts, ext = _codes(body, ext_s, ext_n)
    # the key: the first member's name up to its first dot (the whole name without one)
    head_s, head_n = name_s[first_member[:-1]], name_n[first_member[:-1]]
    dots = np.flatnonzero(body == DOT)
    at = np.searchsorted(dots, head_s)
    dot = dots[np.minimum(at, len(dots) - 1)] if len(dots) else np.zeros(len(head_s), dtype=np.int64)
    key_n = np.where((at < len(dots)) & (dot < head_s + head_n), dot - head_s, head_n)
    key_ends = np.concatenate([[0], np.cumsum(key_n)]).astype(np.int64)
    keys = body[ragged_ranges(head_s, key_n)]
    # each member's name: the key + a suffix when it starts with the key, else a whole name
    sample_of = np.repeat(np.arange(count), np.diff(first_member))
    m_key_s, m_key_n = head_s[sample_of], key_n[sample_of]
    keyed = name_n >= m_key_n
    for j in range(int(key_n.max(initial=0))):
        live = keyed & (j < m_key_n)
        keyed[live] = body[name_s[live] + j] == body[m_key_s[live] + j]
    tail_s = np.where(keyed, name_s + m_key_n, name_s)
    tail_n = np.where(keyed, name_n - m_key_n, name_n)
    suffixes, suffix = _codes(body, tail_s, tail_n, tag=np.where(keyed, _KEYED[0], _WHOLE[0]))
    return IndexColumns(np.array([0, count], dtype=np.int64), first_member, key_ends, keys, ext, suffix,
                        offset, size, tuple(e.decode("ascii") for _, e in exts),
                        tuple((tag == _KEYED, tail) for tag, tail in suffixes))


def _decimal(body: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The decimal tokens at ``starts``/``lengths``: (values, which are 1 to 18 digits and nothing else)."""
    value = np.zeros(len(starts), dtype=np.int64)
    ok = (lengths > 0) & (lengths <= _MAX_DIGITS)
    for j in range(min(int(lengths.max(initial=0)), _MAX_DIGITS)):
        live = j < lengths
        digit = body[np.where(live, starts + j, 0)].astype(np.int64) - 48
        ok &= ~live | ((digit >= 0) & (digit <= 9))
        value = np.where(live, value * 10 + digit, value)
    return value, ok


def _codes(body: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
           tag: np.ndarray | None = None) -> tuple[list[tuple[bytes, bytes]], np.ndarray]:
    """The distinct tokens (tag byte + token bytes) among ``starts``/``lengths``, and each one's code."""
    width = int(lengths.max(initial=0)) + 1
    grid = np.zeros((len(starts), width), dtype=np.uint8)
    grid[:, 0] = _KEYED[0] if tag is None else tag
    rows = np.repeat(np.arange(len(starts)), lengths)
    cols = ragged_ranges(np.zeros(len(starts), dtype=np.int64), lengths)
    grid[rows, cols + 1] = body[ragged_ranges(starts, lengths)]
    table, codes = np.unique(grid.view(f"S{width}").ravel(), return_inverse=True)
    return [(bytes(t[:1]), bytes(t[1:])) for t in table], codes.astype(narrowest(len(table)))


def narrowest(limit: int):
    """The narrowest unsigned dtype that holds values below ``limit``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if limit <= np.iinfo(dtype).max + 1:
            return dtype
    return np.int64


def concat(parts: list[IndexColumns]) -> IndexColumns:
    """The one-shard indexes ``parts`` (in shard order) as one dataset index, codes merged."""
    exts = tuple(sorted({e for p in parts for e in p.exts}))
    suffixes = tuple(sorted({s for p in parts for s in p.suffixes}))
    ext_code, suffix_code = {e: i for i, e in enumerate(exts)}, {s: i for i, s in enumerate(suffixes)}
    ext = [np.array([ext_code[e] for e in p.exts], dtype=np.int64)[p.ext] if len(p.ext) else p.ext for p in parts]
    suffix = [np.array([suffix_code[s] for s in p.suffixes], dtype=np.int64)[p.suffix] if len(p.suffix) else p.suffix
              for p in parts]
    counts = [p.samples for p in parts]
    members = [len(p.ext) for p in parts]
    key_bytes = [len(p.keys) for p in parts]
    first_member = _chain([p.first_member for p in parts], members)
    key_ends = _chain([p.key_ends for p in parts], key_bytes)
    offset = np.concatenate([p.offset for p in parts] or [np.zeros(0, np.int64)])
    size = np.concatenate([p.size for p in parts] or [np.zeros(0, np.int64)])
    return IndexColumns(
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        first_member.astype(narrowest(int(first_member[-1]) + 1)),
        key_ends.astype(narrowest(int(key_ends[-1]) + 1)),
        np.concatenate([p.keys for p in parts] or [np.zeros(0, np.uint8)]).astype(np.uint8),
        np.concatenate(ext or [np.zeros(0, np.int64)]).astype(narrowest(len(exts))),
        np.concatenate(suffix or [np.zeros(0, np.int64)]).astype(narrowest(len(suffixes))),
        offset.astype(narrowest(int(offset.max(initial=0)) + 1)),
        size.astype(narrowest(int(size.max(initial=0)) + 1)),
        exts, suffixes)


def _chain(ends: list[np.ndarray], totals: list[int]) -> np.ndarray:
    """Cumulative ``(n + 1,)`` arrays of consecutive parts as one, each part shifted by the totals before it."""
    out = [np.zeros(1, dtype=np.int64)]
    base = 0
    for part, total in zip(ends, totals):
        out.append(part[1:].astype(np.int64) + base)
        base += total
    return np.concatenate(out)
