"""The columnar record of what a dataset version holds (job state ``.repack/inputs-vN.npz``).

One compressed numpy ``.npz`` per version, no pickle (written and read with ``allow_pickle=False``);
every member is a plain array, one row per input, rows sorted by name (bytes order)::

  member         dtype / shape     meaning
  format         int64 (1,)        FORMAT (a newer number is refused)
  names          uint8 (B,)        the inputs' rels, utf-8 (surrogateescape), each followed by one NUL
  size           int64 (N,)        bytes at planning
  mtime_ns       int64 (N,)        mtime at planning; NO_MTIME where the fingerprint has none (s3: [size])
  position       int64 (N,)        the sample key's number (keys are ``%08d_...``); -1 without one (text)
  sha256         uint8 (N, 32)     the content, where a task hashed it (``has_sha256``)
  has_sha256     bool  (N,)
  removed        uint8 (R,)        sources `repack remove` took down, NUL-terminated like ``names``, sorted
  next_position  int64 (1,)        the next free sample position (keys stay unique)
  quarantined    uint8 (Q,)        optional: the rels without a sample (the staged --append job's input only)

A version whose change is small is stored as a *delta* on the previous version's record (``format`` 2,
``repack.lifecycle.publish.write_inputs_record``): the same members holding only the rows it adds or
changes and the sources it removed, plus ``base`` (int64 (1,): the version it extends) and ``depth``
(int64 (1,): how many deltas lead down to a whole record). Reading it reads the chain and merges
(``merged``): a change costs what changed, not a rewrite of every input's row.

Names are looked up vectorized (``np.searchsorted`` over a fixed-width bytes array); a record of a
million inputs is never a million Python objects. The zip members carry a fixed timestamp: the same
record is the same bytes. An older repack's ``inputs-vN.json`` (``{"inputs": {rel: [size, mtime_ns]},
"next_position", "sha256", "removed"}``) is converted on read (``from_json_record``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from dataclasses import dataclass
from typing import Callable

import numpy as np

from repack.distinct import distinct
from repack.errors import UsageError

FORMAT = 1
DELTA_FORMAT = 2  # the rows one version adds to its base's record (``StoredRecord.base``)
NO_MTIME = np.iinfo(np.int64).min
MAX_STATE_BYTES = 64 * 2**30  # declared (uncompressed) bytes of one record; more is refused unread
MEMBERS = ("format", "names", "size", "mtime_ns", "position", "sha256", "has_sha256", "removed", "next_position")
COMPRESS_LEVEL = 1  # the sha256 column dominates and does not compress: level 6 saves ~1%, at twice the time
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def encode_names(names) -> np.ndarray:
    """A fixed-width bytes array (dtype ``S``) of ``names`` (str, utf-8 with surrogateescape): joined and
    encoded in one call, then cut as a byte matrix (``names_of_blob``), no bytes object per name."""
    names = names if isinstance(names, list) else list(names)
    if not names:
        return np.array([], dtype="S1")
    blob = ("\0".join(names) + "\0").encode("utf-8", "surrogateescape")
    if blob.count(0) != len(names):
        raise UsageError("an input name is empty or holds a NUL byte; it cannot be recorded")
    return names_of_blob(blob)


def names_of_blob(blob: bytes, ends: np.ndarray | None = None) -> np.ndarray:
    """The ``S`` array of a names blob (each name followed by one NUL, as a scan's ``InputTable.names`` and
    a plan's ``relz`` hold them; ``ends``: the position of each NUL, where the caller has them, e.g.
    ``InputTable.ends``: the blob is not searched again); UsageError for an empty name."""
    try:
        return _unblob(np.frombuffer(blob, np.uint8), "an input name", ends)
    except ValueError as exc:
        raise UsageError(f"{exc}; it cannot be recorded") from None


def decode_names(names: np.ndarray) -> list[str]:
    """``names`` (dtype ``S``) as str."""
    return [name.decode("utf-8", "surrogateescape") for name in names.tolist()]


@dataclass(frozen=True)
class InputColumns:
    """One version's record, as columns (see the module docstring); ``names`` and ``removed`` are
    sorted unique ``S`` arrays."""

    names: np.ndarray
    size: np.ndarray
    mtime_ns: np.ndarray
    position: np.ndarray
    sha256: np.ndarray
    has_sha256: np.ndarray
    removed: np.ndarray
    next_position: int
    quarantined: np.ndarray = dataclasses.field(default_factory=lambda: np.array([], dtype="S1"))
    # set on a record read without its digests (``sha256``/``has_sha256`` then hold none): called with the
    # rows whose digests are wanted (None: all), the same record with at least those rows' digests, derived
    # when called (``repack.lifecycle.first_record``)
    digests_from: Callable[[np.ndarray | None], "InputColumns"] | None = dataclasses.field(default=None, compare=False,
                                                                                           repr=False)
    # set on the record of a dataset first packed from s3://: a row of mtime 0 there may be an object listed
    # before fingerprints held ETags (``repack.sources.object_etag``), known by its size alone
    pre_etag_objects: bool = dataclasses.field(default=False, compare=False, repr=False)
    # set on the staged --append job's input where a recorded input may hold no sample without a quarantine
    # record (a text file that gave no document: blank lines only): of the rels it is called with, those that
    # hold none (a changed one is then packed, not refused)
    sampleless_of: Callable[[list[str]], set[str]] | None = dataclasses.field(default=None, compare=False,
                                                                             repr=False)
    # set on the staged --append job's input of a --dedup dataset: the sources it left out as copies of a packed
    # sample (rel -> that content's sha256, hex): one whose content is still that is known, not new
    dropped_copies: dict[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # of those, the fingerprint each had when it was left out (rel -> [size, mtime_ns]): one that still has it is
    # known without a read (a copy of another print is hashed and compared with its sha256)
    dropped_prints: dict[str, list[int]] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.names)

    def find(self, names: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row of each of ``names`` (an ``S`` array), whether it is recorded); a row is 0 where not."""
        if not len(self.names):
            return np.zeros(len(names), np.int64), np.zeros(len(names), bool)
        return sorted_rows(self.names, names)

    def is_removed(self, names: np.ndarray) -> np.ndarray:
        """Whether each of ``names`` was taken down by `repack remove`."""
        return member_of(self.removed, names)

    def is_quarantined(self, names: np.ndarray) -> np.ndarray:
        """Whether each of ``names`` is in ``quarantined`` (planned before, without a sample)."""
        return member_of(self.quarantined, names)

    def holds_sample(self, names: np.ndarray) -> np.ndarray:
        """Whether each of ``names`` has a sample in the dataset: recorded, neither quarantined nor removed."""
        _, recorded = self.find(names)
        return recorded & ~self.is_quarantined(names) & ~self.is_removed(names)

    def digested(self, rows: np.ndarray | None = None) -> "InputColumns":
        """This record with its digests (itself when it has them; see ``digests_from``); ``rows``: only
        those rows' digests are wanted (the record's others may stay absent: it keeps ``digests_from``)."""
        if self.digests_from is None:
            return self
        whole = self.digests_from(rows)
        if not np.array_equal(whole.names, self.names):
            raise ValueError("a record's digests were derived for other inputs than its own")
        return dataclasses.replace(self, sha256=whole.sha256, has_sha256=whole.has_sha256,
                                   digests_from=None if rows is None else self.digests_from)

    def hex_digest(self, row: int) -> str | None:
        return bytes(self.sha256[row]).hex() if self.has_sha256[row] else None

    def with_removed(self, sources) -> "InputColumns":
        """This record with ``sources`` added to the removed ones."""
        removed = np.union1d(self.removed, encode_names(sorted(set(sources)))) if sources else self.removed
        return dataclasses.replace(self, removed=removed.astype(bytes))


ANCHOR_EVERY = 16  # ``sorted_rows``: one name in this many is looked up by bisection, the others guessed


def sorted_rows(table: np.ndarray, names: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(``np.searchsorted(table, names)`` clipped to ``table``'s rows, whether ``table`` holds each name there)
    (``table``: a sorted unique ``S`` array, not empty): the same rows, at a fraction of the bisections when
    ``names`` is sorted too and mostly in ``table`` (a scan against the record: every 16th name bisected; a name
    between two of them is guessed at the same distance from its anchor's row, and kept where ``table`` holds it
    there: the row of a unique name; a wrong guess, e.g. past a new name, is bisected). The names are compared
    with the table once: the comparison that checks the guesses is the answer."""
    last = len(table) - 1
    if len(names) < 4 * ANCHOR_EVERY:
        rows = np.searchsorted(table, names).clip(0, last)
        return rows, table[rows] == names
    anchors = np.arange(0, len(names), ANCHOR_EVERY)
    shift = np.searchsorted(table, names[anchors]) - anchors
    rows = (np.repeat(shift, ANCHOR_EVERY)[:len(names)] + np.arange(len(names))).clip(0, last)
    found = table[rows] == names
    missed = np.flatnonzero(~found)
    if len(missed):
        rows[missed] = np.searchsorted(table, names[missed]).clip(0, last)
        found[missed] = table[rows[missed]] == names[missed]
    return rows, found


def member_of(table: np.ndarray, names: np.ndarray) -> np.ndarray:
    """Whether each of ``names`` is in ``table`` (a sorted unique ``S`` array)."""
    if not len(table):
        return np.zeros(len(names), bool)
    rows = np.searchsorted(table, names).clip(0, len(table) - 1)
    return table[rows] == names


def with_quarantined(record: InputColumns, sources) -> InputColumns:
    """``record`` carrying the sorted names ``sources`` as its ``quarantined``."""
    return dataclasses.replace(record, quarantined=distinct(encode_names(sorted(set(sources))))
                               if sources else np.array([], dtype="S1"))


def with_digests(record: InputColumns, rels, raw: bytes) -> InputColumns:
    """``record`` with the sha256 of ``rels`` (str, or an ``S`` array) set from ``raw`` (their 32-byte
    digests joined, in order; a later rel wins); rels the record does not hold are left out."""
    if not len(rels):
        return record
    rows, found = record.find(rels if isinstance(rels, np.ndarray) else encode_names(rels))
    digests = np.frombuffer(raw, np.uint8, 32 * len(rels)).reshape(len(rels), 32)
    sha, has = record.sha256.copy(), record.has_sha256.copy()
    sha[rows[found]] = digests[found]
    has[rows[found]] = True
    return dataclasses.replace(record, sha256=sha, has_sha256=has)


def empty_columns(next_position: int = 0) -> InputColumns:
    return build_columns([], [], [], [], {}, next_position)


def build_columns(names, sizes, mtimes, positions, digests: dict[str, str],
                  next_position: int, removed=()) -> InputColumns:
    """Columns of the given inputs (``names``: str, or an ``S`` array; a later duplicate of a name wins);
    ``digests``: {rel: hex sha256}."""
    order_names = names if isinstance(names, np.ndarray) else encode_names(names)
    if digests:
        names = decode_names(order_names) if isinstance(names, np.ndarray) else names
    size = np.asarray(sizes, dtype=np.int64).reshape(-1)
    mtime = np.asarray(mtimes, dtype=np.int64).reshape(-1)
    position = np.asarray(positions, dtype=np.int64).reshape(-1)
    if digests:
        sha, has = hex_digests([digests.get(name) for name in names])
    else:
        sha, has = np.zeros((len(names), 32), np.uint8), np.zeros(len(names), bool)
    return _sorted_last_wins(order_names, size, mtime, position, sha, has, encode_names(sorted(set(removed))),
                             next_position)


_NIBBLE = np.full(256, 255, np.uint8)
_NIBBLE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)
_NIBBLE[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16, dtype=np.uint8)


def hex_digests(digests: list) -> tuple[np.ndarray, np.ndarray]:
    """((N, 32) uint8 digests, whether each is one) of hex sha256 strings; anything else (None, not
    64 hex digits) is no digest: its input is refused if changed, never packed twice."""
    valid = [isinstance(d, str) and len(d) == 64 and d.isascii() for d in digests]
    text = "".join(d if ok else "0" * 64 for d, ok in zip(digests, valid)).encode("ascii")
    nibbles = _NIBBLE[np.frombuffer(text, np.uint8)].reshape(len(digests), 64)
    has = np.array(valid, bool) & (nibbles != 255).all(axis=1)
    sha = (nibbles[:, 0::2] << 4 | nibbles[:, 1::2]).astype(np.uint8)
    sha[~has] = 0
    return sha, has


def _sorted_last_wins(names, size, mtime, position, sha, has, removed, next_position) -> InputColumns:
    removed = distinct(removed) if len(removed) else np.array([], dtype="S1")
    if len(names) < 2 or bool(np.all(names[1:] > names[:-1])):  # already sorted and unique (a sorted scan)
        return InputColumns(names.astype(bytes), size, mtime, position, sha, has, removed, int(next_position))
    reverse = slice(None, None, -1)
    unique, first = np.unique(names[reverse], return_index=True)  # first of the reversed: the last given
    rows = (len(names) - 1 - first).astype(np.int64)
    removed = distinct(removed) if len(removed) else np.array([], dtype="S1")
    return InputColumns(unique.astype(bytes), size[rows], mtime[rows], position[rows], sha[rows], has[rows],
                        removed, int(next_position))


def merged(old: InputColumns, new: InputColumns) -> InputColumns:
    """``old`` with ``new``'s rows added; a name in both takes ``new``'s row, and ``old``'s digest where
    ``new`` has none (a copy recognized by content keeps its digest). Rows are updated in place or
    inserted where they sort: no sort of the whole record. Either without its digests (``digests_from``):
    the result is too, and merges them when asked."""
    if old.digests_from is not None or new.digests_from is not None:
        return dataclasses.replace(merged(dataclasses.replace(old, digests_from=None),
                                          dataclasses.replace(new, digests_from=None)),
                                   digests_from=lambda rows=None: merged(old.digested(), new.digested()))
    rows, known = old.find(new.names)
    sha, has = new.sha256.copy(), new.has_sha256.copy()
    inherit = known & ~has
    sha[inherit] = old.sha256[rows[inherit]]
    has[inherit] = old.has_sha256[rows[inherit]]
    position = new.position.copy()
    keep_old = known & (position < 0)
    position[keep_old] = old.position[rows[keep_old]]
    columns = {"size": (old.size, new.size), "mtime_ns": (old.mtime_ns, new.mtime_ns),
               "position": (old.position, position), "sha256": (old.sha256, sha), "has_sha256": (old.has_sha256, has)}
    at, fresh = rows[known], ~known
    where = np.searchsorted(old.names, new.names[fresh])  # new.names are sorted: so are the insertion points
    result = {}
    for key, (before, after) in columns.items():
        updated = before.copy()
        updated[at] = after[known]
        result[key] = np.insert(updated, where, after[fresh], axis=0)
    width = max(old.names.dtype.itemsize, new.names.dtype.itemsize)
    names = np.insert(old.names.astype(f"S{width}"), where, new.names[fresh].astype(f"S{width}"))
    removed = np.union1d(old.removed, new.removed).astype(bytes) if len(new.removed) else old.removed
    return InputColumns(names, result["size"], result["mtime_ns"], result["position"], result["sha256"],
                        result["has_sha256"], removed, max(old.next_position, new.next_position))


def _blob(names: np.ndarray) -> np.ndarray:
    """The names of an ``S`` array (no NUL inside a name), each followed by one NUL, as one uint8 array:
    the rows of the array's byte matrix cut at each name's length, no object per name."""
    if not len(names):
        return np.zeros(0, np.uint8)
    width = names.dtype.itemsize
    matrix = np.zeros((len(names), width + 1), np.uint8)
    matrix[:, :width] = np.ascontiguousarray(names).view(np.uint8).reshape(len(names), width)
    lengths = np.count_nonzero(matrix, axis=1)
    return matrix[np.arange(width + 1) <= lengths[:, None]]


def _unblob(blob: np.ndarray, what: str, ends: np.ndarray | None = None) -> np.ndarray:
    """The ``S`` array of the NUL-terminated names in ``blob`` (``_blob``), built as a byte matrix (``ends``: the
    position of each NUL, when known)."""
    if not len(blob):
        return np.array([], dtype="S1")
    if ends is None:
        ends = np.flatnonzero(blob == 0)
    if not len(ends) or ends[-1] != len(blob) - 1:
        raise ValueError(f"{what}: the last name is not NUL-terminated")
    starts = np.concatenate([[0], ends[:-1] + 1])
    lengths = ends - starts
    if not lengths.min():
        raise ValueError(f"{what}: an empty name")
    width = int(lengths.max())
    if int(lengths.min()) == width:  # names of one length (numbered files): the blob is the matrix and a NUL column
        return np.ascontiguousarray(blob.reshape(len(ends), width + 1)[:, :width]).view(f"S{width}").reshape(-1)
    matrix = np.zeros((len(ends), width), np.uint8)
    matrix[np.arange(width) < lengths[:, None]] = blob[blob != 0]
    return matrix.view(f"S{width}").reshape(-1)


def to_bytes(record: InputColumns, compress: bool = True, base: tuple[int, int] | None = None) -> bytes:
    """The ``.npz`` bytes of ``record`` (same record, same bytes); compressed but for the sha256 column,
    which does not compress (``compress=False``: nothing is, for a file read once and deleted). ``base``:
    (version, depth) when ``record`` is a delta on that version's record (see the module docstring). A
    record read without its digests gets them first."""
    record = record.digested()
    arrays = {"format": np.array([FORMAT if base is None else DELTA_FORMAT], np.int64), "names": _blob(record.names),
              "size": record.size, "mtime_ns": record.mtime_ns, "position": record.position, "sha256": record.sha256,
              "has_sha256": record.has_sha256, "removed": _blob(record.removed),
              "next_position": np.array([record.next_position], np.int64), "quarantined": _blob(record.quarantined)}
    extra = ("quarantined",) if len(record.quarantined) else ()
    if base is not None:
        arrays.update(base=np.array([base[0]], np.int64), depth=np.array([base[1]], np.int64))
        extra += ("base", "depth")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in (*MEMBERS, *extra):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            method = zipfile.ZIP_DEFLATED if compress and name != "sha256" else zipfile.ZIP_STORED
            archive.writestr(zipfile.ZipInfo(f"{name}.npy", _ZIP_TIME), member.getvalue(), method, COMPRESS_LEVEL)
    return buffer.getvalue()


@dataclass(frozen=True)
class StoredRecord:
    """A record file's content: whole (``base`` None, ``depth`` 0), or a delta on version ``base``'s."""

    columns: InputColumns
    base: int | None = None
    depth: int = 0


def from_bytes(raw: bytes, where: str) -> InputColumns:
    """The whole record in ``raw`` (the file at ``where``); UsageError naming it when it is not one this
    repack reads (see ``parse_record``) or is a delta."""
    stored = parse_record(raw, where)
    if stored.base is not None:
        raise UsageError(f"{where} is a delta on version {stored.base}'s record, not a whole record")
    return stored.columns


def record_depth(raw: bytes, where: str) -> int:
    """How many deltas the record file in ``raw`` stands on (0: a whole record), read from its ``format``
    and ``depth`` members alone; UsageError naming ``where`` when it is not a record file."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            names = set(archive.namelist())
            arrays = {}
            for name in ("format", "depth"):
                if f"{name}.npy" in names and archive.getinfo(f"{name}.npy").file_size <= 1024:
                    with archive.open(f"{name}.npy") as member:
                        arrays[name] = np.lib.format.read_array(member, allow_pickle=False)
        version = _typed(arrays, "format", np.int64, 1)
        if version.shape != (1,) or int(version[0]) not in (FORMAT, DELTA_FORMAT):
            raise ValueError("no format this repack reads")
        if int(version[0]) == FORMAT:
            return 0
        depth = _typed(arrays, "depth", np.int64, 1)
        if depth.shape != (1,) or depth[0] < 1:
            raise ValueError("depth is not one positive int64")
        return int(depth[0])
    except (ValueError, KeyError, EOFError, OSError, zipfile.BadZipFile, NotImplementedError, RuntimeError) as exc:
        raise UsageError(f"{where} is not a readable record of the dataset's inputs ({exc}); move it aside and "
                         "repack without --append") from None


def parse_record(raw: bytes, where: str) -> StoredRecord:
    """The record file in ``raw`` (the file at ``where``); UsageError naming it when it is not a record this
    repack reads (not a zip, a member missing or of another dtype or shape, names unsorted, a newer format)."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            infos = {info.filename: info for info in archive.infolist()}
            if sum(info.file_size for info in infos.values()) > MAX_STATE_BYTES:
                raise ValueError(f"declares more than {MAX_STATE_BYTES} bytes")
            arrays = {}
            for name in (*MEMBERS, "quarantined", "base", "depth"):
                if f"{name}.npy" not in infos:
                    if name in MEMBERS:
                        raise ValueError(f"no member {name}.npy")
                    continue
                with archive.open(infos[f"{name}.npy"]) as member:
                    arrays[name] = np.lib.format.read_array(member, allow_pickle=False)
        return _checked(arrays)
    except UsageError:
        raise
    except (ValueError, KeyError, EOFError, OSError, zipfile.BadZipFile, NotImplementedError, RuntimeError) as exc:
        raise UsageError(f"{where} is not a readable record of the dataset's inputs ({exc}); move it aside and "
                         "repack without --append") from None


def _checked(arrays: dict) -> StoredRecord:
    version = arrays["format"]
    if version.shape != (1,) or version.dtype != np.int64:
        raise ValueError("format is not one int64")
    if int(version[0]) not in (FORMAT, DELTA_FORMAT):
        raise UsageError(f"the record is format {int(version[0])}; this repack reads formats {FORMAT} and "
                         f"{DELTA_FORMAT} (upgrade repack)")
    base, depth = None, 0
    if int(version[0]) == DELTA_FORMAT:
        if "base" not in arrays or "depth" not in arrays:
            raise ValueError("a delta without its base.npy and depth.npy")
        base_column, depth_column = _typed(arrays, "base", np.int64, 1), _typed(arrays, "depth", np.int64, 1)
        if base_column.shape != (1,) or depth_column.shape != (1,) or base_column[0] < 1 or depth_column[0] < 1:
            raise ValueError("base or depth is not one positive int64")
        base, depth = int(base_column[0]), int(depth_column[0])
    names = _unblob(_typed(arrays, "names", np.uint8, 1), "names")
    removed = _unblob(_typed(arrays, "removed", np.uint8, 1), "removed")
    count = len(names)
    columns = {key: _typed(arrays, key, np.int64, 1) for key in ("size", "mtime_ns", "position")}
    sha = _typed(arrays, "sha256", np.uint8, 2)
    has = _typed(arrays, "has_sha256", np.bool_, 1)
    if any(len(c) != count for c in (*columns.values(), sha, has)) or (count and sha.shape[1] != 32):
        raise ValueError(f"columns of other lengths than the {count} names")
    if count > 1 and not bool(np.all(names[1:] > names[:-1])):
        raise ValueError("names are not sorted and unique")
    if len(removed) > 1 and not bool(np.all(removed[1:] > removed[:-1])):
        raise ValueError("removed names are not sorted and unique")
    next_position = _typed(arrays, "next_position", np.int64, 1)
    if next_position.shape != (1,):
        raise ValueError("next_position is not one int64")
    quarantined = (_unblob(_typed(arrays, "quarantined", np.uint8, 1), "quarantined") if "quarantined" in arrays
                   else np.array([], dtype="S1"))
    return StoredRecord(InputColumns(names, columns["size"], columns["mtime_ns"], columns["position"],
                                     sha.reshape(count, 32), has, removed, int(next_position[0]),
                                     np.unique(quarantined)), base, depth)


def _typed(arrays: dict, key: str, dtype, ndim: int) -> np.ndarray:
    array = arrays[key]
    if array.dtype != dtype or array.ndim != ndim:
        raise ValueError(f"{key} is {array.dtype} with {array.ndim} dimension(s), not {np.dtype(dtype)}")
    return array


def from_json_record(raw: bytes, where: str) -> InputColumns:
    """An older repack's ``inputs-vN.json`` as columns; UsageError naming it when it is not one."""
    try:
        data = json.loads(raw)
        inputs = data["inputs"]
        names = list(inputs)
        sizes = [int(inputs[n][0]) for n in names]
        mtimes = [int(inputs[n][1]) if len(inputs[n]) > 1 else NO_MTIME for n in names]
        positions = [-1] * len(names)
        return build_columns(names, sizes, mtimes, positions, dict(data.get("sha256") or {}),
                             int(data["next_position"]), [str(r) for r in data.get("removed") or ()])
    except UsageError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise UsageError(f"{where} is not a readable record of the dataset's inputs ({type(exc).__name__}: {exc}); "
                         "move it aside and repack without --append") from None
