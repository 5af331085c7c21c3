"""ImageFolder-style scanning: class = first folder level; a flat folder is unlabeled.

Hidden files and OS junk are skipped. Symlinks are followed like torchvision's ImageFolder
does, but a directory loop is never entered twice and a file reached through two paths is
packed once (the first path in sorted order); the other path is quarantined as a duplicate.
With ``follow_symlinks=False`` every symlink is quarantined instead.
"""

from __future__ import annotations

import os
import stat as stat_mod

from repack.errors import UsageError
from repack.sources.base import InputItem, Scan, quarantine_record, sort_key

JUNK_NAMES = frozenset({"Thumbs.db", "thumbs.db", "desktop.ini", "Desktop.ini", "@eaDir", "__MACOSX",
                        "lost+found", "$RECYCLE.BIN", "System Volume Information"})


def is_junk(name: str) -> bool:
    """Hidden files, macOS resource forks and the usual NAS/OS droppings."""
    return name.startswith(".") or name in JUNK_NAMES or name.startswith("@")


def scan_folder(root: str, *, follow_symlinks: bool = True) -> Scan:
    """Enumerate ``root`` recursively; see the module docstring for the rules."""
    if not os.path.exists(root):
        raise UsageError(f"source {root!r} does not exist")
    if not os.path.isdir(root):
        raise UsageError(f"source {root!r} is not a folder (use --list for a list file)")
    root = os.path.abspath(root)
    entries: list[tuple[str, str, os.stat_result]] = []  # (rel, abs, stat)
    quarantine: list[dict] = []
    skipped = 0
    top_dirs: list[str] = []
    top_files = 0

    def walk(folder: str, rel_folder: str, ancestors: frozenset) -> None:
        nonlocal skipped, top_files
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
            is_link = entry.is_symlink()
            if is_link and not follow_symlinks:
                quarantine.append(quarantine_record(rel, "symlink (not followed: --no-follow-symlinks)"))
                continue
            try:
                st = os.stat(entry.path)  # follows links
            except OSError as exc:
                reason = "broken symlink" if is_link else f"unreadable: {exc.strerror}"
                quarantine.append(quarantine_record(rel, reason))
                continue
            if stat_mod.S_ISDIR(st.st_mode):
                ident = (st.st_dev, st.st_ino)
                if ident in ancestors:
                    quarantine.append(quarantine_record(rel, "symlink loop (folder already being scanned)"))
                    continue
                if not rel_folder:
                    top_dirs.append(entry.name)
                walk(entry.path, rel, ancestors | {ident})
            elif stat_mod.S_ISREG(st.st_mode):
                if not rel_folder:
                    top_files += 1
                entries.append((rel, entry.path, st))
            else:
                quarantine.append(quarantine_record(rel, "not a regular file"))

    root_st = os.stat(root)
    walk(root, "", frozenset({(root_st.st_dev, root_st.st_ino)}))
    labeled = bool(top_dirs)
    items: list[InputItem] = []
    seen: dict[tuple[int, int], str] = {}
    for rel, path, st in sorted(entries, key=lambda e: sort_key(e[0])):
        label = rel.split("/", 1)[0] if labeled and "/" in rel else None
        ident = (st.st_dev, st.st_ino)
        if ident in seen:
            quarantine.append(quarantine_record(rel, f"same file as {seen[ident]} (reached twice through symlinks)", label))
            continue
        seen[ident] = rel
        if labeled and label is None:
            quarantine.append(quarantine_record(rel, "file outside the class folders of a labeled tree"))
            continue
        items.append(InputItem(path, rel, label, st.st_size))
    return Scan(tuple(items), tuple(sorted(quarantine, key=lambda q: sort_key(q["source"]))), labeled, skipped)
