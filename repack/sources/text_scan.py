"""The folder scan of `repack text` as columns, walked in parallel over the top-level folders.

The rules are ``text_docs.walk_folder``'s (hidden entries skipped, only names that ``text_kinds.classify`` as a
text input kept, folder symlinks followed inside the root after the whole real tree, a folder scanned
once by (st_dev, st_ino), aliases of one file read once under the real path); only the shape differs:
each top-level real folder is walked by its own task on a process pool (``repack.sources.folder``'s
pattern), which sends back its files sorted by byte path as one names blob, int64 stats and one kind
code per file (``KIND_CODES``), plus the folders it visited and the folder symlinks it met. The driver
concatenates the parts in the byte order of the root's entries (a folder's name taken with its "/"),
which is the sorted listing, and never decodes a rel: the result is an ``InputTable``
(``repack.sources.columns``) and a kind-code column, no object per file.

A folder reached twice by real paths from two parts (a bind mount) sends the scan back to one serial
walk of the whole tree (the first path in walk order is the one scanned); folder symlinks are walked
in the driver after the real tree, and the listing is then sorted once.
"""

from __future__ import annotations

import bisect
import json
import os
import stat as stat_mod
from dataclasses import dataclass, field

import numpy as np

from repack.sources.base import alias_reason, pick_real_paths, sort_key
from repack.sources.columns import NO_LABEL, InputTable, join_names, name_ends
from repack.sources.confine import Confinement
from repack.sources.scan_pool import scan_pool
from repack.sources.text_kinds import classify, unread_reason
from repack.sources.walk import is_junk, walk_order

KINDS = ("jsonl", "txt", "parquet")
COMPRESSION_CODES = ("", "gz", "zst")
KIND_CODES = {(kind, comp): k * len(COMPRESSION_CODES) + c
              for k, kind in enumerate(KINDS) for c, comp in enumerate(COMPRESSION_CODES)}
KIND_OF = {code: pair for pair, code in KIND_CODES.items()}
PARALLEL_MIN_FOLDERS = 4  # top-level folders from which the walk runs on a process pool


@dataclass(frozen=True, eq=False)
class TextInputs:
    """The text inputs in plan order: ``table`` (names, fingerprints, real paths) and ``codes`` (uint8, one
    ``KIND_CODES`` value per row)."""

    table: InputTable
    codes: np.ndarray

    def __len__(self) -> int:
        return len(self.table)

    def kind(self, row: int) -> tuple[str, str]:
        """(kind, compression) of a row."""
        return KIND_OF[int(self.codes[row])]

    def take(self, rows) -> "TextInputs":
        index = np.asarray(rows, dtype=np.int64)
        return TextInputs(self.table.take(index), self.codes[index] if len(index) else np.zeros(0, np.uint8))

    @classmethod
    def of_files(cls, files: list) -> "TextInputs":
        """From ``text_docs.TextFile`` rows (a list file, a single file, an s3:// listing)."""
        root = ""
        if files:
            first = files[0]
            if first.path.endswith("/" + first.rel):
                root = first.path[:-len(first.rel) - 1]
        real = {row: f.path for row, f in enumerate(files) if f.path != f"{root}/{f.rel}"}
        table = InputTable.of_rels(root, [f.rel for f in files], np.full(len(files), NO_LABEL), (),
                                   [f.size for f in files], [f.mtime_ns for f in files], [f.ino for f in files], real)
        codes = np.array([KIND_CODES[(f.kind, f.compression)] for f in files], dtype=np.uint8)
        return cls(table, codes)


@dataclass
class _Walk:
    """What the walk of one folder (and below) found, as the serial walk would, in columns."""

    rels: list[str] = field(default_factory=list)
    stats: list[int] = field(default_factory=list)   # size, mtime_ns, inode, device per file, flat
    codes: bytearray = field(default_factory=bytearray)
    real_paths: dict[int, str] = field(default_factory=dict)  # row -> real path where not root/rel
    reasons: dict[int, str] = field(default_factory=dict)     # row -> why it may not be read
    quarantine: list[dict] = field(default_factory=list)
    skipped: int = 0
    links: list[list[str]] = field(default_factory=list)      # [real, rel] of folder symlinks met
    visited: list[list] = field(default_factory=list)         # [dev, ino, rel] of each folder scanned

    def add(self, rel: str, code: int, st: os.stat_result | None, real: str | None, reason: str | None) -> None:
        row = len(self.rels)
        self.rels.append(rel)
        self.codes.append(code)
        self.stats += (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev) if st is not None else (0, 0, 0, 0)
        if real is not None:
            self.real_paths[row] = real
        if reason is not None:
            self.reasons[row] = reason

    def sorted_pack(self) -> bytes:
        """The result, its files sorted by byte path, as bytes (a JSON head, the names blob, stats, codes)."""
        keys = [sort_key(rel) for rel in self.rels]
        order = sorted(range(len(keys)), key=keys.__getitem__)
        where = {old: new for new, old in enumerate(order)}
        stats = np.asarray(self.stats, dtype=np.int64).reshape(-1, 4)[order] if order else np.zeros((0, 4), np.int64)
        codes = np.frombuffer(bytes(self.codes), np.uint8)[order] if order else np.zeros(0, np.uint8)
        head = json.dumps([{where[k]: v for k, v in self.real_paths.items()}, {where[k]: v for k, v in
                           self.reasons.items()}, self.quarantine, self.skipped, self.links, self.visited],
                          ensure_ascii=False).encode("utf-8", "surrogateescape")
        names = join_names([self.rels[i] for i in order])
        return b"%d %d %d\n" % (len(head), len(names), len(order)) + head + names + stats.tobytes() + codes.tobytes()


@dataclass(frozen=True)
class _Part:
    names: bytes
    stats: np.ndarray  # (N, 4)
    codes: np.ndarray
    real_paths: dict[int, str]
    reasons: dict[int, str]
    quarantine: list[dict]
    skipped: int
    links: list[list[str]]
    visited: list[list]

    @classmethod
    def unpack(cls, raw: bytes) -> "_Part":
        line, _, rest = raw.partition(b"\n")
        head_len, names_len, count = map(int, line.split())
        real, reasons, quarantine, skipped, links, visited = json.loads(rest[:head_len].decode("utf-8",
                                                                                               "surrogateescape"))
        at = head_len + names_len
        stats = np.frombuffer(rest[at:at + 32 * count], np.int64).reshape(-1, 4)
        codes = np.frombuffer(rest[at + 32 * count:], np.uint8)
        return cls(rest[head_len:at], stats, codes, {int(k): v for k, v in real.items()},
                   {int(k): v for k, v in reasons.items()}, quarantine, skipped, links, visited)


def _scan(conf: Confinement, folder: str, rel: str, found: _Walk, visited: set, descend: bool = True) -> None:
    """``walk_folder``'s scan of one folder into ``found`` (real sub-folders walked at once when ``descend``)."""

    try:
        with os.scandir(folder) as listing:
            entries = walk_order(list(listing))  # byte order, a folder's name with its "/": as images and s3://
    except OSError as exc:
        found.quarantine.append({"source": rel or ".", "line": None, "reason": f"unreadable folder: {exc.strerror}"})
        return
    codes = KIND_CODES
    canonical = folder == (f"{conf.root}/{rel}" if rel else conf.root)
    for entry in entries:
        name = entry.name
        child = f"{rel}/{name}" if rel else name
        if is_junk(name):  # hidden names and OS droppings: the rule of the image walk and of an s3:// listing
            found.skipped += 1
            continue
        if entry.is_dir(follow_symlinks=False):
            if descend:
                _visit(conf, entry.path, child, found, visited)
            else:
                found.links.append(["", child])  # a top-level folder: walked by its own task ("" marks it)
            continue
        kind = classify(name)
        if kind is None and not entry.is_symlink():
            unread = unread_reason(name)
            if unread is not None:  # looks like a text input: named, never dropped without a word
                found.quarantine.append({"source": child, "line": None, "reason": unread})
            else:
                found.skipped += 1  # not a text input: never stat'ed
            continue
        if kind is not None and entry.is_file(follow_symlinks=False):  # d_type: a regular file, no symlink
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as exc:
                found.add(child, codes[kind], None, "", f"unreadable: {exc.strerror}")
                continue
            if not stat_mod.S_ISREG(st.st_mode):  # replaced since the folder was read
                _add_checked(found, child, codes[kind], conf.check(entry.path, parent_is_real=True), conf)
            else:
                found.add(child, codes[kind], st, None if canonical else entry.path, conf.size_refusal(st.st_size))
            continue
        checked = conf.check(entry.path, parent_is_real=True)
        if checked.reason is not None and checked.is_link:  # whatever its name: reported, never followed
            found.quarantine.append({"source": child, "line": None, "reason": checked.reason})
        elif checked.reason is None and checked.is_dir:
            found.links.append([checked.real, child])
        elif kind is None:
            found.skipped += 1
        else:
            _add_checked(found, child, codes[kind], checked, conf)


def _add_checked(found: _Walk, rel: str, code: int, checked, conf: Confinement) -> None:
    reason = checked.reason
    if reason is None and stat_mod.S_ISDIR(checked.st.st_mode):
        reason = "not a regular file (folder)"
    real = checked.real if checked.real != f"{conf.root}/{rel}" else None
    found.add(rel, code, checked.st, real, reason)


def _visit(conf: Confinement, folder: str, rel: str, found: _Walk, visited: set) -> None:
    try:
        st = os.stat(folder)
    except OSError as exc:
        found.quarantine.append({"source": rel, "line": None, "reason": f"unreadable folder: {exc.strerror}"})
        return
    key = (st.st_dev, st.st_ino)
    if key in visited:
        found.quarantine.append({"source": rel, "line": None, "reason": f"folder already scanned as "
                                 f"{visited[key] or '.'} (symlink loop or second link): skipped"})
        return
    visited[key] = rel
    found.visited.append([st.st_dev, st.st_ino, rel])
    _scan(conf, folder, rel, found, visited)


def _walk_top_folder(args: tuple) -> bytes:
    """Pool task: the real tree under one top-level folder, packed."""
    conf, path, rel = args
    found = _Walk()
    _visit(conf, path, rel, found, {})
    return found.sorted_pack()


def scan_text_folder(conf: Confinement, workers: int = 1) -> tuple[TextInputs, list[dict], int]:
    """The text inputs under ``conf.root`` (sorted), quarantine records (in the serial walk's order) and the
    count of skipped files."""
    root = conf.root
    st = os.stat(root)
    top = _Walk()
    visited = {(st.st_dev, st.st_ino): ""}
    top.visited.append([st.st_dev, st.st_ino, ""])
    _scan(conf, root, "", top, visited, descend=False)
    folders = [rel for real, rel in top.links if real == ""]
    top.links = [link for link in top.links if link[0] != ""]
    tasks = [(conf, f"{root}/{rel}", rel) for rel in folders]
    pool = scan_pool(workers, len(tasks), PARALLEL_MIN_FOLDERS, __name__)
    if pool is not None:
        with pool:
            parts = [_Part.unpack(raw) for raw in pool.map(_walk_top_folder, tasks, chunksize=4)]
    else:
        parts = [_Part.unpack(_walk_top_folder(task)) for task in tasks]
    seen: dict[tuple[int, int], str] = {}
    for dev, ino, rel in [v for part in [top, *parts] for v in part.visited]:
        if (dev, ino) in seen:  # one folder under two real paths: the serial walk says which is scanned
            return _serial(conf)
        seen[(dev, ino)] = rel
    first = _Part.unpack(top.sorted_pack())
    # files: the root's own files and the folders' parts in byte order ("name/" for a folder)
    folder_keys = [sort_key(rel + "/") for rel in folders]
    root_rels = first.names.split(b"\0")[:-1]
    slots = [bisect.bisect_left(folder_keys, name) for name in root_rels]  # root files before folder k
    pieces: list[tuple[_Part, int, int]] = []  # (part, first row, end row)
    row = 0
    for k, part in enumerate(parts):
        end = bisect.bisect_right(slots, k)
        if end > row:
            pieces.append((first, row, end))
            row = end
        pieces.append((part, 0, len(part.codes)))
    if row < len(root_rels):
        pieces.append((first, row, len(root_rels)))
    # quarantine: the serial walk's order (the root's entries by name, a folder's records where it stands)
    by_name = dict(zip(folders, parts))
    quarantine = _root_ordered_quarantine(first, folders, by_name)
    skipped = sum(part.skipped for part in [first, *parts])
    links = [link for part in [first, *parts] for link in part.links]
    table, codes, real_paths, reasons, stats = _join(root, pieces)
    if links:
        table, codes, real_paths, reasons, stats, more_q, more_skipped = _walk_links(conf, links, seen, table, codes,
                                                                                    real_paths, reasons, stats)
        quarantine += more_q
        skipped += more_skipped
    return _checked_inputs(conf, table, codes, real_paths, reasons, stats, quarantine), quarantine, skipped


def _serial(conf: Confinement) -> tuple[TextInputs, list[dict], int]:
    """The whole tree walked in this process, in one part (the same rules, without the split by folder)."""
    whole = _Walk()
    visited: dict = {}
    _visit(conf, conf.root, "", whole, visited)
    part = _Part.unpack(whole.sorted_pack())
    quarantine = list(part.quarantine)
    table, codes, real_paths, reasons, stats = _join(conf.root, [(part, 0, len(part.codes))])
    skipped = part.skipped
    if part.links:
        table, codes, real_paths, reasons, stats, more_q, more_skipped = _walk_links(conf, part.links, visited, table,
                                                                                    codes, real_paths, reasons, stats)
        quarantine += more_q
        skipped += more_skipped
    return _checked_inputs(conf, table, codes, real_paths, reasons, stats, quarantine), quarantine, skipped


def _root_ordered_quarantine(first: _Part, folders: list[str], by_name: dict) -> list[dict]:
    """The root's records and each top-level folder's, in the walk's order of the root's entries (by bytes,
    a folder's name with its "/")."""
    named = set(folders)

    def entry_key(source: str) -> bytes:
        name = source.split("/", 1)[0]
        return sort_key(name + "/" if name in named else name)

    records = [(entry_key(q["source"]), 0, n, q) for n, q in enumerate(first.quarantine)]
    records += [(sort_key(name + "/"), 1, n, q) for name in folders for n, q in enumerate(by_name[name].quarantine)]
    return [q for *_, q in sorted(records, key=lambda r: (r[0], r[1], r[2]))]


def _join(root: str, pieces: list) -> tuple:
    names = b"".join(part.names[_start(part, a):_start(part, b)] for part, a, b in pieces)
    stats = np.concatenate([part.stats[a:b] for part, a, b in pieces]) if pieces else np.zeros((0, 4), np.int64)
    codes = np.concatenate([part.codes[a:b] for part, a, b in pieces]) if pieces else np.zeros(0, np.uint8)
    real_paths, reasons, at = {}, {}, 0
    for part, a, b in pieces:
        for source, target in ((part.real_paths, real_paths), (part.reasons, reasons)):
            target.update((at + row - a, value) for row, value in source.items() if a <= row < b)
        at += b - a
    ends = name_ends(names)
    table = InputTable(root, names, ends, np.full(len(ends), NO_LABEL, np.int32), (), stats[:, 0].copy(),
                       stats[:, 1].copy(), stats[:, 2].copy(), real_paths)
    return table, codes, real_paths, reasons, stats


def _start(part: _Part, row: int) -> int:
    """Where row ``row`` of a part's names blob begins (its end when ``row`` is its row count)."""
    if row == 0:
        return 0
    return int(name_ends(part.names)[row - 1]) + 1


def _walk_links(conf: Confinement, links: list, seen: dict, table: InputTable, codes, real_paths, reasons, stats):
    """``walk_folder``'s second stage (folder symlinks, in name order, after the real tree), then one sort."""
    found = _Walk()
    visited = {key: rel for key, rel in seen.items()}
    pending = [tuple(link) for link in links]
    while pending:
        pending.sort(key=lambda pr: sort_key(pr[1]))
        real, rel = pending.pop(0)
        found.links = []
        _visit(conf, real, rel, found, visited)
        pending += [tuple(link) for link in found.links]
    rels = table.rels + found.rels
    all_stats = np.concatenate([stats, np.asarray(found.stats, np.int64).reshape(-1, 4)])
    all_codes = np.concatenate([codes, np.frombuffer(bytes(found.codes), np.uint8)])
    n = len(table)
    real_all = {**real_paths, **{n + k: v for k, v in found.real_paths.items()}}
    reason_all = {**reasons, **{n + k: v for k, v in found.reasons.items()}}
    order = sorted(range(len(rels)), key=lambda i: sort_key(rels[i]))
    where = {old: new for new, old in enumerate(order)}
    rels = [rels[i] for i in order]
    all_stats, all_codes = all_stats[order], all_codes[order]
    real_all = {where[k]: v for k, v in real_all.items()}
    reason_all = {where[k]: v for k, v in reason_all.items()}
    out = InputTable.of_rels(conf.root, rels, np.full(len(rels), NO_LABEL), (), all_stats[:, 0], all_stats[:, 1],
                             all_stats[:, 2], real_all)
    return out, all_codes, real_all, reason_all, all_stats, found.quarantine, found.skipped


NOT_UTF8 = "file name is not valid UTF-8 (a token dataset names its source files in UTF-8): rename it"


def not_utf8_names(table: InputTable) -> dict[int, str]:
    """{row: NOT_UTF8} of the files whose name is not UTF-8 (the names blob decoded once where all are)."""
    try:
        table.names.decode("utf-8")
        return {}
    except UnicodeDecodeError:
        pass
    starts, ends = table.starts, table.ends
    bad = {}
    for row in range(len(table)):
        try:
            table.names[int(starts[row]):int(ends[row])].decode("utf-8")
        except UnicodeDecodeError:
            bad[row] = NOT_UTF8
    return bad


def _checked_inputs(conf: Confinement, table: InputTable, codes: np.ndarray, real_paths: dict, reasons: dict,
                    stats: np.ndarray, quarantine: list[dict]) -> TextInputs:
    """``list_text_files``' last steps on columns: refused files quarantined (sorted order), aliases of one
    file (equal device and inode) read once under the real path, the others quarantined naming it."""
    keep = np.ones(len(table), dtype=bool)
    reasons = {**reasons, **not_utf8_names(table)}
    for row in sorted(reasons):
        quarantine.append({"source": table.rel(row), "line": None, "reason": reasons[row]})
        keep[row] = False
    readable = np.flatnonzero(keep)
    devices, inodes = stats[readable, 3], stats[readable, 2]
    order = np.lexsort((readable, inodes, devices))
    same = (inodes[order][1:] == inodes[order][:-1]) & (devices[order][1:] == devices[order][:-1])
    if same.any():
        rows = sorted({int(readable[order[i + d]]) for i in np.flatnonzero(same).tolist() for d in (0, 1)})
        entries = [(table.rel(r), real_paths.get(r, f"{conf.root}/{table.rel(r)}"),
                    os.stat_result((0, int(stats[r, 2]), int(stats[r, 3])) + (0,) * 7)) for r in rows]
        aliases = pick_real_paths(entries, conf.root)
        for r, (rel, real, _) in zip(rows, entries):
            if rel in aliases:
                quarantine.append({"source": rel, "line": None,
                                   "reason": alias_reason(rel, real, aliases[rel], conf.root)})
                keep[r] = False
    if keep.all():
        return TextInputs(table, codes)
    return TextInputs(table, codes).take(np.flatnonzero(keep))
