"""List files: .csv, .tsv (header row with a ``path`` column) and .jsonl ({"path", "label"}).

Paths are relative to the list file's folder, or absolute; the list file's folder is the source
root of the ``Confinement`` (a path outside it, or a symlink leaving it, is quarantined unless
``--allow-outside-source``; FIFOs, devices and files over the size cap are quarantined). The label column is optional
(``label``, ``class`` or ``cls``; surrounding whitespace stripped, ``sources.base.clean_label``).
Every quarantined row names its line (``<list>:<line>``). Inputs keep the list's order after a stable sort by path
so that the plan does not depend on how the list was produced.

The scan is columnar, as a folder's is: the rows are held as one bytes object each while they are sorted (the
path, its line and its label id: ``_sorted_rows``), then checked one by one into an ``InputTable`` (names blob,
numpy fingerprints, a real path only for a row whose real path is not root/rel); the rows that open one file
are found by one sort of the (device, inode) columns (``columns.same_files``). A scan of 202,000 rows peaked at
794 B a row with an ``InputItem`` per row, 164 B so.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import posixpath

from array import array
from dataclasses import dataclass

import numpy as np

from repack.errors import UsageError
from repack.sources.base import Scan, again_name, alias_reason, clean_label, quarantine_record, sort_key
from repack.sources.columns import _FS, NO_LABEL, InputTable, name_ends, same_files
from repack.sources.confine import Confinement
from repack.sources.scan_pool import scan_pool
from repack.sources.class_index import bound_table_labels, index_labels, numeric_class_index, sorted_labels

LABEL_COLUMNS = ("label", "class", "cls")


def _rows(list_path: str):
    ext = os.path.splitext(list_path)[1].lower()
    # utf-8-sig: a byte order mark at the start (Excel's "CSV UTF-8") is not part of the first column's name
    with open(list_path, encoding="utf-8-sig", newline="", errors="surrogateescape") as fh:
        if ext == ".jsonl":
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    yield lineno, None, f"malformed JSON line: {getattr(exc, 'msg', exc)}"  # an int over 4,300 digits
                    continue
                except RecursionError:
                    yield lineno, None, "malformed JSON line: nested too deeply"
                    continue
                yield lineno, row if isinstance(row, dict) else None, "JSON line is not an object"
        elif ext in (".csv", ".tsv"):
            reader = csv.DictReader(fh, delimiter="\t" if ext == ".tsv" else ",")
            if reader.fieldnames:  # "Path", " label", "Label ": the columns as a spreadsheet shows them
                names = [name.strip().lower() if name.strip().lower() in ("path", *LABEL_COLUMNS) else name
                         for name in reader.fieldnames]
                twice = sorted({name for name in names if names.count(name) > 1} & {"path", *LABEL_COLUMNS})
                if twice:
                    raise UsageError(f"list file {list_path!r}: its header names the {twice[0]!r} column twice "
                                     "(spelled otherwise in case or spaces)")
                reader.fieldnames = names
            if not reader.fieldnames or "path" not in reader.fieldnames:
                raise UsageError(f"list file {list_path!r} needs a header row with a 'path' column")
            while True:
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except csv.Error as exc:  # e.g. a field over the csv module's size limit: that row only
                    yield reader.line_num, None, f"malformed {ext[1:].upper()} row: {exc}"
                    continue
                yield reader.line_num, row, ""
        else:
            raise UsageError(f"list file {list_path!r}: use .csv, .tsv or .jsonl")


def scan_list_file(list_path: str, confinement: Confinement | None = None, workers: int = 1) -> Scan:
    """Read a list file into inputs (an ``InputTable``: columns, no object per row); rows that point nowhere
    are quarantined. ``workers``: processes that check the rows (``PARALLEL_MIN_ROWS`` rows or more).

    Rows are taken in path order (then line order), so which of two rows naming the same file
    is kept does not depend on how the list was written. In a labeled list (any row has a
    label) an unlabeled row is quarantined, as a file outside the class folders is.
    """
    if not os.path.isfile(list_path):
        raise UsageError(f"list file {list_path!r} does not exist")
    base = os.path.dirname(os.path.abspath(list_path))
    conf = (confinement or Confinement()).rooted(base)
    name = os.path.basename(list_path)
    quarantine: list[dict] = []
    rows, labels = _sorted_rows(list_path, name, quarantine)
    found = _checked(rows, labels, conf, base, name, workers)
    del rows
    table, refused = found.without_aliases(base, name)
    quarantine += [record for _, record in sorted(found.refused + refused, key=lambda pr: pr[0])]
    # whether labels are class indices is decided once, by every label read (a set-aside row's too), for the bound
    # check and the class map alike: a missing file labeled "cat" makes 0, 10 and 2 names, not indices
    named = table.label_set() | {q["label"] for q in quarantine if q.get("label") is not None}
    table, over = bound_table_labels(table, index_labels(named))
    table = sorted_labels(table)
    quarantine += over
    return Scan(table, tuple(quarantine), found.labeled, class_index=numeric_class_index(named))


_ROW_TAIL = 12  # a sorted row's bytes: the rel, a NUL, its line (8 bytes, big-endian) and its label id + 1 (4 bytes)


def _sorted_rows(list_path: str, name: str, quarantine: list[dict]) -> tuple[list[bytes], list[str]]:
    """The list's usable rows in path order, then line order (as bytes: ``_ROW_TAIL``, one object per row; a
    NUL sorts before any byte of a path, so the bytes sort as (path, line) do), and the label names by id;
    the unusable rows are quarantined naming their line."""
    rows: list[bytes] = []
    label_ids: dict[str, int] = {}
    for lineno, row, problem in _rows(list_path):
        if row is None:
            quarantine.append(quarantine_record(f"{name}:{lineno}", problem))
            continue
        rel = row.get("path")
        if not isinstance(rel, str) or not rel or "\x00" in rel:
            quarantine.append(quarantine_record(f"{name}:{lineno}", "row has no usable path"))
            continue
        try:
            key = sort_key(rel)
        except UnicodeEncodeError:  # a JSON "\ud800": no file name is spelled so
            quarantine.append(quarantine_record(f"{name}:{lineno}", "row has no usable path (not valid text)"))
            continue
        raw = next((row[c] for c in LABEL_COLUMNS if clean_label(row.get(c)) is not None), None)
        if raw is not None and (isinstance(raw, bool) or not isinstance(raw, (str, int))):  # a JSON list, object...
            quarantine.append(quarantine_record(rel, f"label {json.dumps(raw)[:60]} is not a string or an integer "
                                                     f"({name}:{lineno})"))
            continue
        label = clean_label(raw)
        lid = NO_LABEL if label is None else label_ids.setdefault(label, len(label_ids))
        rows.append(b"%s\0%s%s" % (key, lineno.to_bytes(8, "big"), (lid + 1).to_bytes(4, "big")))
    rows.sort()
    return rows, list(label_ids)


_STAT_COLUMNS = ("size", "mtime", "inode", "device", "line", "pos")


@dataclass
class _Found:
    """The rows that passed the checks, as columns in path order (``pos``: each one's place among the sorted
    rows), and the refused rows' (place, quarantine record)."""

    root: str
    labeled: bool
    label_names: list[str]
    names: bytearray = dataclasses.field(default_factory=bytearray)
    stats: dict[str, array] = dataclasses.field(
        default_factory=lambda: {k: array("q") for k in _STAT_COLUMNS})
    label_ids: array = dataclasses.field(default_factory=lambda: array("i"))
    real_paths: dict[int, str] = dataclasses.field(default_factory=dict)
    refused: list[tuple[int, dict]] = dataclasses.field(default_factory=list)

    def pack(self) -> bytes:
        """As bytes for the pool's answer: a JSON head (real paths, refused rows), then the names, the label ids
        and the stat columns (``unpack``)."""
        head = json.dumps([self.real_paths, self.refused]).encode("utf-8", "surrogateescape")
        columns = [self.stats[k].tobytes() for k in _STAT_COLUMNS]
        return b"".join([b"%d %d %d\n" % (len(head), len(self.names), len(self.label_ids)), head, bytes(self.names),
                         self.label_ids.tobytes(), *columns])

    @classmethod
    def unpack(cls, raw: bytes, root: str, labeled: bool, labels: list[str]) -> "_Found":
        line_end = raw.index(b"\n")
        head_len, names_len, count = map(int, raw[:line_end].split())
        at = line_end + 1
        real_paths, refused = json.loads(raw[at:at + head_len].decode("utf-8", "surrogateescape"))
        at += head_len
        found = cls(root, labeled, labels, bytearray(raw[at:at + names_len]))
        at += names_len
        found.label_ids.frombytes(raw[at:at + 4 * count])
        at += 4 * count
        for key in _STAT_COLUMNS:
            found.stats[key].frombytes(raw[at:at + 8 * count])
            at += 8 * count
        found.real_paths = {int(row): path for row, path in real_paths.items()}
        found.refused = [(place, record) for place, record in refused]
        return found

    def extend(self, other: "_Found") -> None:
        """Append ``other``'s rows (the next rows in sorted order) to these."""
        offset = len(self.label_ids)
        self.names += other.names
        self.label_ids += other.label_ids
        for key in _STAT_COLUMNS:
            self.stats[key] += other.stats[key]
        self.real_paths.update((row + offset, path) for row, path in other.real_paths.items())
        self.refused += other.refused

    def table(self) -> InputTable:
        names = bytes(self.names)
        column = {k: np.frombuffer(v, dtype=np.int64) if len(v) else np.zeros(0, np.int64)
                  for k, v in self.stats.items()}
        return InputTable(self.root, names, name_ends(names), np.array(self.label_ids, dtype=np.int32),
                          tuple(self.label_names), column["size"], column["mtime"], column["inode"], self.real_paths)

    def without_aliases(self, base: str, name: str) -> tuple[InputTable, list[tuple[int, dict]]]:
        """The table of the rows kept: of the rows that open one file (device, inode), the first; each other is
        "listed twice" (the same real path) or an alias naming it, with its place among the rows."""
        table = self.table()
        device = np.frombuffer(self.stats["device"], dtype=np.int64) if len(table) else np.zeros(0, np.int64)
        groups = same_files(table.inodes, device)
        if not groups:
            return table, []
        line, pos = (np.frombuffer(self.stats[k], dtype=np.int64) for k in ("line", "pos"))
        keep = np.ones(len(table), dtype=bool)
        kept_of = {row: group[0] for group in groups for row in group[1:]}
        refused: list[tuple[int, dict]] = []
        seen_again: dict[str, int] = {}
        set_aside: set[str] = set()  # the names of rows listed twice: each its own
        for row in sorted(kept_of):
            kept, rel, label = kept_of[row], table.rel(row), table.label(row)
            keep[row] = False
            where = f"{name}:{int(line[row])}"
            if table.path(row) == table.path(kept):  # the packed row's spelling, or one set aside: named apart
                shown = again_name(rel, seen_again) if table.rel(kept) == rel or rel in set_aside else rel
                set_aside.add(shown)
                record = quarantine_record(shown, f"listed twice ({where})", label)
            else:
                reason = alias_reason(rel, table.path(row), table.rel(kept), base)
                record = quarantine_record(rel, f"{reason} ({where})", label)
            refused.append((int(pos[row]), record))
        return table.take(np.flatnonzero(keep)), refused


PARALLEL_MIN_ROWS = 20_000  # a list this long is checked on a pool (a row's check is ~10 us of lstat and Python)
_CHUNK_ROWS = 25_000


def _checked(rows: list[bytes], labels: list[str], conf: Confinement, base: str, name: str, workers: int) -> _Found:
    """``_check_rows`` of every row, in chunks on ``workers`` processes (``repack.sources.scan_pool``) where the
    list is long enough, else here. ``rows`` is emptied as it is read."""
    labeled = any(row[-4:] != b"\0\0\0\0" for row in rows)
    chunks = [(at, min(at + _CHUNK_ROWS, len(rows))) for at in range(0, len(rows), _CHUNK_ROWS)]
    pool = scan_pool(workers, len(chunks), 2, __name__) if len(rows) >= PARALLEL_MIN_ROWS else None
    if pool is None:
        return _check_rows(rows, labels, labeled, conf, base, name)
    found = _Found(conf.root, labeled, labels)
    with pool:
        parts = pool.map(_check_chunk, *zip(*[(rows[a:b], a, labels, labeled, conf, base, name) for a, b in chunks]))
        rows.clear()
        for part in parts:
            found.extend(_Found.unpack(part, conf.root, labeled, labels))
    return found


def _check_chunk(rows: list[bytes], first: int, labels: list[str], labeled: bool, conf: Confinement, base: str,
                 name: str) -> bytes:
    """A pool task: ``_check_rows`` of the sorted rows from place ``first`` on, packed (``_Found.pack``)."""
    return _check_rows(rows, labels, labeled, conf, base, name, first).pack()


def _check_rows(rows: list[bytes], labels: list[str], labeled: bool, conf: Confinement, base: str, name: str,
                first: int = 0) -> _Found:
    """Each sorted row checked by ``conf`` (``Confinement.check_listed``): its stat kept in columns, or its
    quarantine record. ``rows`` (from place ``first`` among all rows) is emptied as it is read."""
    found = _Found(conf.root, labeled, labels)
    prefix = conf.root + "/"
    real_folders: dict[str, str] = {}  # each row's folder as written -> its real path
    size, mtime, inode, device, line, pos = (found.stats[k] for k in ("size", "mtime", "inode", "device", "line",
                                                                       "pos"))
    for at in range(len(rows)):
        row = rows[at]
        rows[at] = None  # the columns grow as the rows go
        place = first + at
        rel = row[:-_ROW_TAIL - 1].decode(*_FS)
        lineno = int.from_bytes(row[-_ROW_TAIL:-4], "big")
        lid = int.from_bytes(row[-4:], "big") - 1
        label = labels[lid] if lid != NO_LABEL else None
        if found.labeled and label is None:
            found.refused.append((place, quarantine_record(rel, f"no label ({name}:{lineno}) in a labeled list")))
            continue
        path = rel if os.path.isabs(rel) else os.path.join(base, rel)
        checked = conf.check_listed(path, real_folders)
        if checked.reason is None and checked.is_dir:
            checked = dataclasses.replace(checked, reason="not a regular file (folder)")
        if checked.reason is not None:
            found.refused.append((place, quarantine_record(rel, f"{checked.reason} ({name}:{lineno})", label)))
            continue
        st = checked.st
        if checked.real != prefix + rel:
            found.real_paths[len(size)] = checked.real
        found.names += row[:-_ROW_TAIL]
        found.label_ids.append(lid)
        size.append(st.st_size)
        mtime.append(st.st_mtime_ns)
        inode.append(st.st_ino)
        device.append(st.st_dev)
        line.append(lineno)
        pos.append(place)
    return found


def canonical_rel(rel: str, roots: tuple[str, ...]) -> str:
    """A list row's path in one spelling: ``./a.jpg``, ``a//b.jpg`` and an absolute path inside the list's folder
    (``roots``: as named, and its real path) are ``a.jpg``, ``a/b.jpg`` (lexically: ``respell_held`` checks that
    both name one file)."""
    if os.path.isabs(rel):
        path = os.path.normpath(rel)
        for root in roots:
            if path.startswith(root + "/"):
                return posixpath.normpath(path[len(root) + 1:])
        return path
    return posixpath.normpath(rel)


def spelled_otherwise(names):
    """Which of ``names`` (an ``S`` array of a record) ``canonical_rel`` may spell otherwise: absolute ones, and
    those with ``./``, ``//`` or ``/.`` in them (a few, found without a str per name)."""
    if not len(names):
        return np.zeros(0, bool)
    return (np.char.startswith(names, b"/") | np.char.startswith(names, b"./") | (np.char.find(names, b"//") >= 0)
            | (np.char.find(names, b"/.") >= 0))


def respell_held(table: InputTable, known, base: str) -> InputTable:
    """``table`` (an ``--append``'s scan of a list file) with each row that the dataset ``known`` holds, took down
    or quarantined under another spelling of the same path given that spelling (``canonical_rel``): the file is
    known, not new (a list written again with ``./`` paths packed every file a second time). A spelling is taken
    only where it opens the same file. The record's names stay columns: only those spelled otherwise are decoded."""
    from repack.lifecycle.input_columns import encode_names, names_of_blob

    if not len(table):
        return table
    names = names_of_blob(table.names, table.ends)
    _, recorded = known.find(names)
    unknown = np.flatnonzero(~recorded & ~known.is_removed(names)).tolist()
    del names
    if not unknown:
        return table
    roots = tuple(dict.fromkeys((base.rstrip("/"), os.path.realpath(base))))  # the folder as named, and real
    spellings: dict[str, str] = {}  # canonical spelling -> the dataset's, for the names it spells otherwise
    for column in (known.names, known.removed, known.quarantined):  # those found in columns, decoded alone
        for raw in column[spelled_otherwise(column)].tolist():
            name = raw.decode("utf-8", "surrogateescape")
            spellings.setdefault(canonical_rel(name, roots), name)
    canonical = [canonical_rel(table.rel(row), roots) for row in unknown]
    encoded = encode_names(canonical)  # a canonical spelling the dataset holds as it is
    _, as_is = known.find(encoded)
    as_is |= known.is_removed(encoded) | known.is_quarantined(encoded)
    respelled: dict[int, str] = {}
    for row, spelled, held_as_is in zip(unknown, canonical, as_is.tolist()):
        held = spellings.get(spelled) or (spelled if held_as_is else None)
        if held is None or held == table.rel(row):
            continue
        path = held if os.path.isabs(held) else os.path.join(base, held)
        if os.path.realpath(path) == table.path(row):
            respelled[row] = held
    return table.renamed(respelled) if respelled else table
