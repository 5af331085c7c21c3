"""List files: .csv, .tsv (header row with a ``path`` column) and .jsonl ({"path", "label"}).

Paths are relative to the list file's folder, or absolute; the list file's folder is the source
root of the ``Confinement`` (a path outside it, or a symlink leaving it, is quarantined unless
``--allow-outside-source``; FIFOs, devices and files over the size cap are quarantined). The label column is optional
(``label``, ``class`` or ``cls``; surrounding whitespace stripped, ``sources.base.clean_label``).
Every quarantined row names its line (``<list>:<line>``). Inputs keep the list's order after a stable sort by path
so that the plan does not depend on how the list was produced.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import posixpath

from repack.errors import UsageError
from repack.sources.base import InputItem, Scan, again_name, alias_reason, clean_label, quarantine_record, sort_key
from repack.sources.tar_shards import bound_index_labels, numeric_class_index
from repack.sources.confine import Confinement

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
                    yield lineno, None, f"malformed JSON line: {exc.msg}"
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


def scan_list_file(list_path: str, confinement: Confinement | None = None) -> Scan:
    """Read a list file into inputs; rows that point nowhere are quarantined.

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
    rows: list[tuple[str, int, str | None]] = []
    for lineno, row, problem in _rows(list_path):
        if row is None:
            quarantine.append(quarantine_record(f"{name}:{lineno}", problem))
            continue
        rel = row.get("path")
        if not isinstance(rel, str) or not rel or "\x00" in rel:
            quarantine.append(quarantine_record(f"{name}:{lineno}", "row has no usable path"))
            continue
        raw = next((row[c] for c in LABEL_COLUMNS if clean_label(row.get(c)) is not None), None)
        if raw is not None and (isinstance(raw, bool) or not isinstance(raw, (str, int))):  # a JSON list, object...
            quarantine.append(quarantine_record(rel, f"label {json.dumps(raw)[:60]} is not a string or an integer "
                                                     f"({name}:{lineno})"))
            continue
        rows.append((rel, lineno, clean_label(raw)))
    rows.sort(key=lambda r: (sort_key(r[0]), r[1]))
    labeled = any(label is not None for _, _, label in rows)
    items: list[InputItem] = []
    seen: dict[str, str] = {}  # real path -> the rel it is packed under
    seen_again: dict[str, int] = {}
    set_aside: set[str] = set()  # the names of rows listed twice: each its own
    read_as: dict[tuple[int, int], str] = {}  # (device, inode) -> the rel it is read under: a hard link is one file
    real_folders: dict[str, str] = {}  # each row's folder as written -> its real path (``Confinement.check_listed``)
    for rel, lineno, label in rows:
        if labeled and label is None:
            quarantine.append(quarantine_record(rel, f"no label ({name}:{lineno}) in a labeled list"))
            continue
        path = rel if os.path.isabs(rel) else os.path.join(base, rel)
        checked = conf.check_listed(path, real_folders)
        if checked.reason is None and checked.is_dir:
            checked = dataclasses.replace(checked, reason="not a regular file (folder)")
        if checked.reason is not None:
            quarantine.append(quarantine_record(rel, f"{checked.reason} ({name}:{lineno})", label))
            continue
        if checked.real in seen:  # the packed row's spelling, or one set aside already: named apart (``again_name``)
            shown = again_name(rel, seen_again) if seen[checked.real] == rel or rel in set_aside else rel
            set_aside.add(shown)
            quarantine.append(quarantine_record(shown, f"listed twice ({name}:{lineno})", label))
            continue
        ident = (checked.st.st_dev, checked.st.st_ino)
        if ident in read_as:
            quarantine.append(quarantine_record(rel, f"{alias_reason(rel, checked.real, read_as[ident], base)} "
                                                     f"({name}:{lineno})", label))
            continue
        seen[checked.real] = rel
        read_as[ident] = rel
        items.append(InputItem.from_stat(checked.real, rel, label, checked.st))
    # labels that are all class indices (JSON integers, or "2" and "10" in a CSV) keep their values, as a converted
    # source's do; else they are names, indexed in sorted order
    items = bound_index_labels(items, quarantine)
    labels = {item.label for item in items} | {q["label"] for q in quarantine if q.get("label") is not None}
    return Scan(tuple(items), tuple(quarantine), labeled, class_index=numeric_class_index(labels - {None}))


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
    import numpy as np

    if not len(names):
        return np.zeros(0, bool)
    return (np.char.startswith(names, b"/") | np.char.startswith(names, b"./") | (np.char.find(names, b"//") >= 0)
            | (np.char.find(names, b"/.") >= 0))


def respell_held(items: list, known, base: str) -> list:
    """``items`` of a list file (an ``--append``'s scan), each one that the dataset ``known`` holds, took down or
    quarantined under another spelling of the same path given that spelling (``canonical_rel``): the file is
    known, not new (a list written again with ``./`` paths packed every file a second time). A spelling is taken
    only where it opens the same file. The record's names stay columns: only those spelled otherwise are decoded."""
    import numpy as np

    from repack.lifecycle.input_columns import encode_names

    if not items:
        return items
    names = encode_names([item.rel for item in items])
    _, recorded = known.find(names)
    unknown = np.flatnonzero(~recorded & ~known.is_removed(names)).tolist()
    if not unknown:
        return items
    roots = tuple(dict.fromkeys((base.rstrip("/"), os.path.realpath(base))))  # the folder as named, and real
    spellings: dict[str, str] = {}  # canonical spelling -> the dataset's, for the names it spells otherwise
    for column in (known.names, known.removed, known.quarantined):  # those found in columns, decoded alone
        for raw in column[spelled_otherwise(column)].tolist():
            name = raw.decode("utf-8", "surrogateescape")
            spellings.setdefault(canonical_rel(name, roots), name)
    canonical = [canonical_rel(items[i].rel, roots) for i in unknown]
    encoded = encode_names(canonical)  # a canonical spelling the dataset holds as it is
    _, as_is = known.find(encoded)
    as_is |= known.is_removed(encoded) | known.is_quarantined(encoded)
    items = list(items)
    for i, spelled, held_as_is in zip(unknown, canonical, as_is.tolist()):
        item = items[i]
        held = spellings.get(spelled) or (spelled if held_as_is else None)
        if held is None or held == item.rel:
            continue
        path = held if os.path.isabs(held) else os.path.join(base, held)
        if os.path.realpath(path) == item.path:
            items[i] = dataclasses.replace(item, rel=held)
    return items
