"""What a source scan yields."""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class InputItem:
    """One input file: where to read it, how to name it, and its label (class name)."""

    path: str          # absolute path used to open the file (may contain surrogate escapes)
    rel: str           # path relative to the source root (or as given in the list file)
    label: str | None  # class name, None when unlabeled
    size: int          # bytes, from stat, used to plan shards before any decoding

    def to_json(self) -> dict:
        return {"path": self.path, "rel": self.rel, "label": self.label, "size": self.size}

    @classmethod
    def from_json(cls, data: dict) -> "InputItem":
        return cls(data["path"], data["rel"], data["label"], int(data["size"]))


@dataclass(frozen=True)
class Scan:
    """Result of enumerating a source: the usable inputs, sorted, and what was set aside."""

    items: tuple[InputItem, ...]
    quarantine: tuple[dict, ...] = ()
    labeled: bool = False
    skipped: int = 0  # hidden files and OS junk, skipped by design

    @property
    def classes(self) -> dict[str, int]:
        """Class name -> index, in sorted class-name order."""
        names = sorted({item.label for item in self.items if item.label is not None} |
                       {q["label"] for q in self.quarantine if q.get("label") is not None})
        return {name: index for index, name in enumerate(names)}


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
