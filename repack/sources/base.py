"""What a source scan yields."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class InputItem:
    """One input file: where to read it, how to name it, and its label (class name)."""

    path: str          # absolute path used to open the file (may contain surrogate escapes)
    rel: str           # path relative to the source root (or as given in the list file)
    label: str | None  # class name, None when unlabeled
    size: int          # bytes, from stat, used to plan shards before any decoding
    mtime_ns: int = 0  # with size and inode: the fingerprint a task checks before reading (resume)
    ino: int = 0

    @property
    def fingerprint(self) -> list[int]:
        return [self.size, self.mtime_ns, self.ino]

    def to_json(self) -> dict:
        return {"path": self.path, "rel": self.rel, "label": self.label, "size": self.size,
                "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, data: dict) -> "InputItem":
        size, mtime_ns, ino = data.get("fingerprint") or (data["size"], 0, 0)
        return cls(data["path"], data["rel"], data["label"], int(size), int(mtime_ns), int(ino))

    @classmethod
    def from_stat(cls, path: str, rel: str, label: str | None, st: os.stat_result) -> "InputItem":
        return cls(path, rel, label, st.st_size, st.st_mtime_ns, st.st_ino)

    def entry_fields(self) -> dict:
        """What a task's input entry needs beyond path, rel, label and fingerprint (nothing for a file)."""
        return {}


@dataclass(frozen=True)
class MemberItem(InputItem):
    """An input stored inside another file (a tar member, a parquet row): ``path`` is that file,
    ``size`` the member's bytes, and the fingerprint is the container's (checked before reading)."""

    container: tuple[int, ...] = ()              # the container's fingerprint ([size, mtime_ns, inode]; s3: [size, ETag value])
    member: tuple[tuple[str, object], ...] = ()  # where inside: (offset, size) of a tar member, (row, column) of a row
    meta: tuple[tuple[str, str], ...] = ()       # kept in the sample's metadata: source_file, source_key, ...

    @property
    def fingerprint(self) -> list[int]:
        return list(self.container)

    def entry_fields(self) -> dict:
        return {"member": dict(self.member), "meta": dict(self.meta)}


@dataclass(frozen=True)
class FieldChoice:
    """Which member (tar: extension) or column (parquet) holds the image and the label; None: found by type."""

    image: str | None = None
    label: str | None = None


@dataclass(frozen=True)
class Scan:
    """Result of enumerating a source: the usable inputs, sorted, and what was set aside."""

    items: Sequence[InputItem]  # a tuple, or a columnar ``repack.sources.columns.InputTable`` (folder scans)
    quarantine: tuple[dict, ...] = ()
    labeled: bool = False
    skipped: int = 0  # hidden files and OS junk, skipped by design
    class_index: tuple[tuple[str, int], ...] = ()  # a source's own class indices (foreign datasets), else sorted names
    not_carried: tuple[tuple[str, int], ...] = ()  # foreign datasets: members/columns not packed, and how many

    @property
    def classes(self) -> dict[str, int]:
        """Class name -> index: the source's own indices when it has them, else in sorted class-name order."""
        if self.class_index:
            return dict(self.class_index)
        labels = self.items.label_set() if hasattr(self.items, "label_set") else \
            {item.label for item in self.items if item.label is not None}
        names = sorted(labels |
                       {q["label"] for q in self.quarantine if q.get("label") is not None})
        return {name: index for index, name in enumerate(names)}


def clean_label(raw) -> str | None:
    """The one label rule, applied wherever labels are read (list-file columns, class folder names,
    s3 prefixes): surrounding whitespace is stripped, so ``"cat "`` and ``"cat"`` are one class;
    a label that is empty after stripping is no label."""
    if raw is None:
        return None
    text = str(raw).strip()
    return text or None


def clean_labels(scan: "Scan") -> "Scan":
    """``scan`` with ``clean_label`` applied to every item and quarantine record; an item whose class
    name is only whitespace (a folder named " ") is quarantined with the reason."""
    items: list[InputItem] = []
    quarantine = [q if q.get("label") is None else {**q, "label": clean_label(q["label"])} for q in scan.quarantine]
    if hasattr(scan.items, "clean_labels"):  # columns: the rule applies to the label names
        table, refused = scan.items.clean_labels()
        quarantine = [{k: v for k, v in q.items() if not (k == "label" and v is None)} for q in quarantine + refused]
        return dataclasses.replace(scan, items=table, quarantine=tuple(quarantine))
    for item in scan.items:
        label = clean_label(item.label)
        if item.label is not None and label is None:
            quarantine.append(quarantine_record(item.rel, f"class name {item.label!r} is empty once its surrounding "
                                                          "whitespace is stripped"))
        elif label != item.label:
            items.append(dataclasses.replace(item, label=label))
        else:
            items.append(item)
    quarantine = [{k: v for k, v in q.items() if not (k == "label" and v is None)} for q in quarantine]
    return dataclasses.replace(scan, items=tuple(items), quarantine=tuple(quarantine))


_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


def sort_key(rel: str) -> bytes:
    """Byte order of the file-system encoding: stable whatever the locale (``os.fsencode``, inlined:
    it runs for every entry of a scan)."""
    return rel.encode(_FS_ENCODING, _FS_ERRORS)


def quarantine_record(rel: str, reason: str, label: str | None = None) -> dict:
    """A quarantine entry: which input and why it was not packed."""
    record = {"source": rel, "reason": reason}
    if label is not None:
        record["label"] = label
    return record


def pick_real_paths(entries: list[tuple[str, str, os.stat_result]], root: str) -> dict[str, str]:
    """For files reached through several paths (``entries``: (rel, real path, stat), sorted): {rel: the
    rel kept instead} for every rel that is not kept (empty when each file is reached once). The
    real path (no symlink on the way) wins over an alias; between real paths (hard links) the
    first in sorted order."""
    first: dict[tuple[int, int], tuple[str, str]] = {}
    groups: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for rel, real, st in entries:
        ident = (st.st_dev, st.st_ino)
        seen = first.setdefault(ident, (rel, real))
        if seen[0] != rel:  # a second path to the same file (the same rel listed twice is not one)
            groups.setdefault(ident, [seen]).append((rel, real))
    aliases: dict[str, str] = {}
    for group in groups.values():
        winner = next((rel for rel, real in group if real == os.path.normpath(os.path.join(root, rel))), group[0][0])
        aliases.update((rel, winner) for rel, _ in group if rel != winner)
    return aliases


def alias_reason(rel: str, real: str, kept: str, root: str) -> str:
    """Why ``rel`` is not read: the same file is read under ``kept``."""
    how = ("symlink inside the source root" if real != os.path.normpath(os.path.join(root, rel))
           else "hard link or second path")
    return f"same file as {kept} ({how}): read once, under {kept}"


def join_names(rels) -> bytes:
    """``rels`` (str) as a names blob: each encoded and followed by one NUL; ValueError for a rel that holds a
    NUL (no such path can exist)."""
    blob = "\0".join(rels).encode("utf-8", "surrogateescape")
    if not blob and not rels:
        return b""
    blob += b"\0"
    if blob.count(0) != len(rels):
        raise ValueError("an input path holds a NUL byte")
    return blob


def again_name(rel: str, seen_again: dict[str, int]) -> str:
    """The name of another copy of ``rel`` (a tar's second member of one name, a list's row naming a listed file
    again) set aside beside the packed one: ``rel (again, 2)``, ``(again, 3)``... Apart from the packed name (an
    --append plans a quarantined name again when it changes: the packed copy would get a second sample), and
    from where it lies (the same name when the list or shard is written again in another order)."""
    seen_again[rel] = seen_again.get(rel, 1) + 1
    return f"{rel} (again, {seen_again[rel]})"


def copy_base(name: str) -> str | None:
    """The packed name that ``again_name`` made ``name`` from, or None where ``name`` is no such copy's."""
    base, sep, tail = name.rpartition(" (again, ")
    return base if sep and tail.endswith(")") and tail[:-1].isdigit() else None
