"""A tar shard's DALI index (``repack.sinks.tar_format``) as ``repack remove`` uses it: one row per
member, samples as ranges of rows. Parsed by the project's one ``.idx`` parser
(``repack.manifest.shard_index``, its pieces on threads); this module adds the byte-layout questions
remove asks, and lays out the index of the kept samples from the old index's own text
(``shifted_text``: lines copied, only the offsets written anew) or, where that text is not exactly what
repack writes, from its columns (``text_of``)."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from repack.exec.cpus import worker_cpus
from repack.manifest import ManifestError
from repack.manifest.shard_index import NEWLINE, IndexColumns, index_pieces, join_shards, parse_piece, ragged_ranges
from repack.sinks.tar_format import BLOCK, INDEX_VERSION


@dataclass(frozen=True)
class ShardIndex:
    """``columns``: the parsed index; ``offset``/``size``: int64 per member; ``first``: the first member
    row of each sample, then the member count."""

    columns: IndexColumns
    offset: np.ndarray
    size: np.ndarray
    first: np.ndarray
    raw: bytes = b""  # the index file's text, when it was parsed from one

    @property
    def samples(self) -> int:
        return len(self.first) - 1

    def key(self, sample: int) -> str:
        return self.columns.key(sample)

    def keys(self) -> list[str]:
        return [self.columns.key(sample) for sample in range(self.samples)]

    def members(self, sample: int) -> list[tuple[str, int, int, str]]:
        """(ext, data offset, size, name) of the sample's members."""
        rows = np.arange(int(self.first[sample]), int(self.first[sample + 1]))
        return list(zip(self.exts(rows), self.offset[rows].tolist(), self.size[rows].tolist(), self.names(rows)))

    def exts(self, rows: np.ndarray) -> list[str]:
        """The ext of each member row in ``rows``."""
        table = self.columns.exts
        return [table[code] for code in self.columns.ext[rows].tolist()]

    def names(self, rows: np.ndarray) -> list[str]:
        """The name of each member row in ``rows``."""
        samples = np.searchsorted(self.first, rows, side="right") - 1
        table = self.columns.suffixes
        out = []
        for sample, code in zip(samples.tolist(), self.columns.suffix[rows].tolist()):
            keyed, tail = table[code]
            out.append((self.columns.key(sample) if keyed else "") + tail.decode("ascii"))
        return out

    def name_fields(self, rows: np.ndarray, width: int) -> np.ndarray:
        """(rows, width) uint8: each member row's name NUL-padded (cut) to ``width`` bytes."""
        samples = np.searchsorted(self.first, rows, side="right") - 1
        return self.columns.name_fields(samples, rows, width)

    def padded_end(self) -> np.ndarray:
        """Per member: the end of its data's padding."""
        return self.offset + self.size + (-self.size % BLOCK)

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(start of the first header, end of the last member's padding) per sample."""
        return self.offset[self.first[:-1]] - BLOCK, self.padded_end()[self.first[1:] - 1]

    def key_positions(self) -> np.ndarray:
        """Per sample: the position its key starts with (``repack.lifecycle.locate.key_position``: the
        decimal digits before the key's first ``_``, or the whole key where it is only digits), -1 where it
        has none; vectorized over the keys."""
        starts = self.columns.key_ends[:-1].astype(np.int64)
        lengths = np.diff(self.columns.key_ends).astype(np.int64)
        width = min(int(lengths.max(initial=0)), _POSITION_DIGITS + 1)
        if not width:
            return np.full(self.samples, -1, np.int64)
        padded = np.zeros(len(self.columns.keys) + width, np.uint8)
        padded[:len(self.columns.keys)] = self.columns.keys
        chars = padded[starts[:, None] + np.arange(width)]
        live = np.arange(width) < lengths[:, None]
        digit = live & (chars >= ord("0")) & (chars <= ord("9"))
        count = np.where(digit.all(axis=1), width, np.argmin(digit, axis=1))  # leading digits
        after = chars[np.arange(self.samples), np.minimum(count, width - 1)]
        valid = (count > 0) & (count <= _POSITION_DIGITS) & ((count == lengths) | (after == ord("_")))
        values = np.where(digit & (np.arange(width) < count[:, None]), chars - ord("0"), 0).astype(np.int64)
        scale = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
        positions = values @ scale // 10 ** (width - np.minimum(count, width))
        return np.where(valid, positions, -1)

    def text_of(self, kept: np.ndarray, shift: np.ndarray) -> bytes:
        """The DALI index (``repack.sinks.tar_format``) of the samples ``kept`` (ascending sample
        numbers), each member's data offset moved by its sample's ``shift``: every member line laid out in
        one byte matrix (ext, offset, size, name, separator) and the live bytes taken in row order, no
        Python object per line."""
        counts = np.diff(self.first)[kept]
        rows = ragged_ranges(self.first[kept], counts)
        samples = np.repeat(kept, counts)
        exts = [e.encode("ascii") for e in self.columns.exts]
        ext_width = max(map(len, exts), default=1) or 1
        ext_table = np.zeros((max(len(exts), 1), ext_width), np.uint8)
        for code, ext in enumerate(exts):
            ext_table[code, :len(ext)] = np.frombuffer(ext, np.uint8)
        ext_len = np.array([len(e) for e in exts] or [0], np.int64)[self.columns.ext[rows].astype(np.int64)]
        suffix_len = np.array([len(t) for _, t in self.columns.suffixes] or [0], np.int64)
        keyed = np.array([k for k, _ in self.columns.suffixes] or [True], bool)
        code = self.columns.suffix[rows].astype(np.int64)
        key_len = np.diff(self.columns.key_ends).astype(np.int64)[samples]
        name_len = suffix_len[code] + np.where(keyed[code], key_len, 0)
        name_width = int(name_len.max(initial=1))
        offset, offset_live = _decimal(self.offset[rows] + np.repeat(shift[kept], counts))
        size, size_live = _decimal(self.size[rows])
        separator = np.full((len(rows), 1), ord(" "), np.uint8)
        separator[np.cumsum(counts) - 1] = ord("\n")  # a sample's last member ends its line
        space = np.full((len(rows), 1), ord(" "), np.uint8)
        always = np.ones((len(rows), 1), bool)
        fields = [(ext_table[self.columns.ext[rows].astype(np.int64)], np.arange(ext_width) < ext_len[:, None]),
                  (space, always), (offset, offset_live), (space, always), (size, size_live), (space, always),
                  (self.columns.name_fields(samples, rows, name_width), np.arange(name_width) < name_len[:, None]),
                  (separator, always)]
        matrix = np.concatenate([f for f, _ in fields], axis=1)
        live = np.concatenate([m for _, m in fields], axis=1)
        return f"{INDEX_VERSION} {len(kept)}\n".encode() + matrix[live].tobytes()

    def shifted_text(self, kept: np.ndarray, shift: np.ndarray) -> bytes:
        """``text_of(kept, shift)``, the same bytes, made from the index's own text: the kept samples'
        lines copied in runs as they stand, then each copied member's offset overwritten in place where
        its new value has as many digits as the old (one scatter per digit column, no Python object per
        line); a line whose offset changes its width (crossing a power of ten) is laid out by
        ``text_of``. ``text_of`` alone where the text is not one it would write (no text, or a size
        written with leading zeros), or where the kept lines break into many short runs (most lines
        kept one by one: laying them all out is then cheaper than a copy per run)."""
        cut = np.ones(len(kept), bool)
        cut[1:] = kept[1:] != kept[:-1] + 1
        layout = self._token_ends() if np.count_nonzero(cut) * MIN_RUN_LINES <= len(kept) else None
        if layout is None:
            return self.text_of(kept, shift)
        ends, body = layout
        counts = np.diff(self.first)[kept]
        rows = ragged_ranges(self.first[kept], counts)
        member_sample = np.repeat(np.arange(len(kept)), counts)
        values = self.offset[rows] + shift[kept][member_sample]
        token_end = ends[4 * rows + 1]
        same_width = _digit_counts(values) == token_end - ends[4 * rows] - 1
        copied = np.bincount(member_sample, weights=~same_width, minlength=len(kept)) == 0
        line_start = np.where(self.first[kept] == 0, 0, ends[np.maximum(4 * self.first[kept] - 1, 0)] + 1)
        line_end = ends[4 * self.first[kept + 1] - 1] + 1
        # pieces: runs of kept lines that follow each other in the text and are all copied, or all laid out
        cut[1:] |= copied[1:] != copied[:-1]
        firsts = np.flatnonzero(cut)
        lasts = np.append(firsts[1:], len(kept)) - 1
        laid_out = np.flatnonzero(~copied)  # the lines whose width changes: laid out together, in order
        rendered = memoryview(self.text_of(kept[laid_out], shift) if len(laid_out) else b"\n")
        rendered_ends = np.flatnonzero(np.frombuffer(rendered, np.uint8) == NEWLINE) + 1  # the header's first
        rendered_at = np.searchsorted(laid_out, np.arange(len(kept)))  # per kept line: its number among them
        out = bytearray(f"{INDEX_VERSION} {len(kept)}\n".encode())
        base = np.zeros(len(kept), np.int64)  # per kept line: its position in ``out`` minus its position in ``body``
        source = memoryview(body)
        for first, last, whole in zip(firsts.tolist(), lasts.tolist(), copied[firsts].tolist()):
            if whole:
                lo, hi = int(line_start[first]), int(line_end[last])
                base[first:last + 1] = len(out) - lo
                out += source[lo:hi]
            else:
                out += rendered[rendered_ends[rendered_at[first]]:rendered_ends[rendered_at[last] + 1]]
        patched = copied[member_sample] & (values != self.offset[rows])
        _write_decimals(np.frombuffer(out, np.uint8), token_end[patched] + base[member_sample[patched]],
                        values[patched])
        return bytes(out)

    def _token_ends(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(the end of each token of the index body: 4 a member, ext offset size name; the body as uint8)
        when the raw text is one ``text_of`` lays out for these columns (sizes without leading zeros: the
        parser took every other byte as it stands), else None."""
        if not self.raw:
            return None
        body = np.frombuffer(self.raw, np.uint8, offset=self.raw.index(b"\n") + 1)
        ends = np.flatnonzero(body <= 32)  # the parser left spaces and newlines as the only such bytes
        if len(ends) != 4 * len(self.offset):
            return None
        size_digits = ends[2::4] - ends[1::4] - 1
        if not np.array_equal(size_digits, _digit_counts(self.size)):
            return None
        return ends, body

    def adjacent(self) -> bool:
        """Whether each member's header follows the previous member of its sample."""
        inner = np.ones(len(self.offset), bool)
        inner[self.first[:-1]] = False  # a sample's first member follows nothing of its own
        ends = self.padded_end()
        return bool(np.all(self.offset[1:][inner[1:]] == ends[:-1][inner[1:]] + BLOCK))


_POSITION_DIGITS = 18  # a position longer than this is no position (int64 holds 18 digits)
MIN_RUN_LINES = 16  # ``shifted_text`` copies runs of kept lines when they hold this many lines on average
def _write_decimals(text: np.ndarray, ends: np.ndarray, values: np.ndarray) -> None:
    """Each of ``values`` (non-negative) written in decimal into ``text`` so that its digits end just
    before its ``ends``: one pass per digit over the values of each width (most share one)."""
    widths = _digit_counts(values)
    for width in np.flatnonzero(np.bincount(widths)).tolist():  # not np.unique: it imports numpy.ma
        at = widths == width
        rest, where = (values, ends) if at.all() else (values[at], ends[at])
        rest = rest.astype(np.uint64 if int(rest.max(initial=0)) >> 32 else np.uint32)
        where = where - 1
        for _ in range(width):
            rest, digit = np.divmod(rest, 10)
            text[where] = digit + ord("0")
            where -= 1


def _digit_counts(values: np.ndarray) -> np.ndarray:
    """The number of decimal digits of each non-negative value (1 for 0)."""
    values = values.astype(np.int64)
    count = np.ones(len(values), np.int64)
    for power in range(1, len(str(int(values.max(initial=0))))):
        count += values >= 10 ** power
    return count


def _decimal(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """((n, width) uint8 ASCII digits, right-aligned; which of them are live) of non-negative ``values``:
    one column per pass (a quotient and a product over a flat column), not an (n, width) division."""
    values = values.astype(np.int64)
    width = len(str(int(values.max(initial=0))))
    digits = np.empty((len(values), width), np.uint8)
    rest = values
    for column in range(width - 1, -1, -1):
        quotient = rest // 10
        digits[:, column] = rest - quotient * 10
        rest = quotient
    digits += np.uint8(ord("0"))
    count = np.ones(len(values), np.int64)
    for power in range(1, width):
        count += values >= 10 ** power
    return digits, np.arange(width) >= (width - count)[:, None]


PARSE_THREADS = 8  # pieces of an index parsed at once (numpy releases the GIL over a piece's arrays)


def _parsed(raw: bytes) -> IndexColumns:
    """``repack.manifest.shard_index.parse_index`` of ``raw``, its pieces parsed on threads (up to
    PARSE_THREADS and the CPUs this process may keep busy: ``worker_cpus``, its share in a pool): a
    shard of ~140k samples is ~5 pieces."""
    count, pieces = index_pieces(raw, "index")
    threads = min(len(pieces), PARSE_THREADS, worker_cpus())
    if threads <= 1:
        parts = [parse_piece(piece, "index") for piece in pieces]
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="repack-index") as pool:
            parts = list(pool.map(parse_piece, pieces, ["index"] * len(pieces)))
    return join_shards([parts], [count], ["index"])


def parse_index(raw: bytes, recorded_sha256: str | None = None) -> ShardIndex | None:
    """The index in ``raw``; None when it is not the one the manifest records (``recorded_sha256``) or
    not a well-formed index (its last line unterminated, or a data offset inside the first header)."""
    if recorded_sha256 and hashlib.sha256(raw).hexdigest() != recorded_sha256:
        return None
    head = raw.partition(b"\n")[0].split(b" ")
    if not raw.endswith(b"\n") or len(head) != 2 or head[0] != INDEX_VERSION.encode():
        return None
    try:
        columns = _parsed(raw)
    except ManifestError:
        return None
    offset, size = columns.offset.astype(np.int64), columns.size.astype(np.int64)
    if len(offset) and offset.min() < BLOCK:
        return None
    return ShardIndex(columns, offset, size, columns.first_member.astype(np.int64), bytes(raw))
