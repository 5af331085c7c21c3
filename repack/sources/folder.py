"""ImageFolder-style scanning: class = first folder level; a flat folder is unlabeled.

Hidden files and OS junk are skipped. Every entry goes through the source's ``Confinement``
(``repack.sources.confine``): symlinks are followed inside the source root only (a link leaving
it is quarantined unless allowed), FIFOs, sockets and devices are quarantined, never opened,
and files over the size cap are quarantined from their size. A directory loop is never entered
twice. A file reached through two paths is packed once under its real path (the path without
a symlink), and the alias is quarantined naming it; of two real paths (hard links) the first in
sorted order wins. With ``follow_symlinks=False`` every symlink is quarantined instead.
"""

from __future__ import annotations

import os

from repack.errors import UsageError
from repack.sources.base import InputItem, Scan, alias_reason, pick_real_paths, quarantine_record, sort_key
from repack.sources.confine import Confinement

JUNK_NAMES = frozenset({"Thumbs.db", "thumbs.db", "desktop.ini", "Desktop.ini", "@eaDir", "__MACOSX",
                        "lost+found", "$RECYCLE.BIN", "System Volume Information"})


def is_junk(name: str) -> bool:
    """Hidden files, macOS resource forks and the usual NAS/OS droppings."""
    return name.startswith(".") or name in JUNK_NAMES or name.startswith("@")


def scan_folder(root: str, confinement: Confinement | None = None) -> Scan:
    """Enumerate ``root`` recursively; see the module docstring for the rules."""
    if not os.path.exists(root):
        raise UsageError(f"source {root!r} does not exist")
    if not os.path.isdir(root):
        raise UsageError(f"source {root!r} is not a folder (use --list for a list file)")
    conf = (confinement or Confinement()).rooted(root)
    entries: list[tuple[str, str, os.stat_result]] = []  # (rel, real path, stat)
    quarantine: list[dict] = []
    skipped = 0
    top_dirs: list[str] = []

    def walk(folder: str, rel_folder: str, ancestors: frozenset) -> None:
        nonlocal skipped
        try:
            with os.scandir(folder) as it:
                children = sorted(it, key=lambda e: sort_key(e.name))
        except OSError as exc:
            quarantine.append(quarantine_record(rel_folder or ".", f"unreadable folder: {exc.strerror}"))
            return
        for entry in children:
            if is_junk(entry.name):
                skipped += 1
                continue
            rel = f"{rel_folder}/{entry.name}" if rel_folder else entry.name
            checked = conf.check(entry.path, parent_is_real=True)  # ``folder`` is a real path
            if checked.reason is not None:
                quarantine.append(quarantine_record(rel, checked.reason))
            elif checked.is_dir:
                ident = (checked.st.st_dev, checked.st.st_ino)
                if ident in ancestors:
                    quarantine.append(quarantine_record(rel, "symlink loop (folder already being scanned)"))
                    continue
                if not rel_folder:
                    top_dirs.append(entry.name)
                walk(checked.real, rel, ancestors | {ident})
            else:
                entries.append((rel, checked.real, checked.st))

    root_st = os.stat(conf.root)
    walk(conf.root, "", frozenset({(root_st.st_dev, root_st.st_ino)}))
    walk = None  # noqa: F841 - it refers to itself: the cycle would keep every entry alive until a full GC
    labeled = bool(top_dirs)
    entries.sort(key=lambda e: sort_key(e[0]))
    aliases = pick_real_paths(entries, conf.root)
    items: list[InputItem] = []
    for rel, real, st in entries:
        label = rel.split("/", 1)[0] if labeled and "/" in rel else None
        if rel in aliases:
            quarantine.append(quarantine_record(rel, alias_reason(rel, real, aliases[rel], conf.root), label))
            continue
        if labeled and label is None:
            quarantine.append(quarantine_record(rel, "file outside the class folders of a labeled tree"))
            continue
        items.append(InputItem.from_stat(real, rel, label, st))
    return Scan(tuple(items), tuple(sorted(quarantine, key=lambda q: sort_key(q["source"]))), labeled, skipped)
