"""The walk of a folder tree (``repack.sources.folder`` turns it into a scan), apart so that it imports no
numpy: `repack images` starts it before anything heavy is imported (``walk_ahead``).

Each top-level folder is walked by its own task, in byte order (see ``repack.sources.folder``), on a
pool of ``workers`` processes (``repack.sources.scan_pool``) when there are at least
``PARALLEL_MIN_FOLDERS`` of them, or started ahead in forked children that leave no thread in this
process (``repack.exec.forked.ForkedTasks``). A walk sends back bytes: a JSON head, the names blob, the
stats as int64 (``_Found.pack``).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

from repack.exec.forked import ForkedTasks
from repack.sources.base import join_names, quarantine_record, sort_key
from repack.sources.confine import Confinement
from repack.sources.scan_pool import scan_pool, start_method

# OS and NAS droppings by name (Synology's @eaDir and #recycle, QNAP's @Recycle and @Recently-Snapshot); a name
# merely starting with "@" (an "@2x" icon, an "@user" class) is a file like any other
JUNK_NAMES = frozenset({"Thumbs.db", "thumbs.db", "desktop.ini", "Desktop.ini", "@eaDir", "__MACOSX",
                        "lost+found", "$RECYCLE.BIN", "System Volume Information", "@Recycle", "@Recently-Snapshot",
                        "#recycle", "#snapshot", "@SynoResource"})
PARALLEL_MIN_FOLDERS = 8  # top-level folders from which the scan runs on a process pool
MAX_DEPTH = 256  # folder levels below the root walked; a deeper folder is quarantined (the walk recurses per level)


def is_junk(name: str) -> bool:
    """Hidden files (macOS resource forks among them) and the usual NAS/OS droppings (``JUNK_NAMES``)."""
    return name.startswith(".") or name in JUNK_NAMES


@dataclass
class _Found:
    """What the walk of one folder (and below) found: file columns, refusals, skipped junk."""

    rels: list[str] = field(default_factory=list)
    stats: list[int] = field(default_factory=list)  # size, mtime_ns, inode, device per file, flat
    real_paths: dict[int, str] = field(default_factory=dict)  # row -> real path where not root/rel
    quarantine: list[dict] = field(default_factory=list)
    skipped: int = 0
    top_dirs: list[str] = field(default_factory=list)

    def pack(self) -> bytes:
        """The result as bytes (what a scan worker sends back: no pickled objects): a head, the names blob
        (``repack.sources.base.join_names``), the stats as int64. The head is JSON, or empty for a folder of
        plain files only (no refusal, no junk, no link, no subfolder): the usual one, read without a parse."""
        extras = self.real_paths or self.quarantine or self.skipped or self.top_dirs
        head = json.dumps([self.real_paths, self.quarantine, self.skipped, self.top_dirs, len(self.rels)],
                          ensure_ascii=False).encode("utf-8", "surrogateescape") if extras else b""
        names = join_names(self.rels)
        ints = array.array("q", self.stats).tobytes()
        return b"%d %d\n" % (len(head), len(names)) + head + names + ints


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # d_type; a symlink: its target (one stat)
    except OSError:
        return False


def walk_order(entries: list[os.DirEntry]) -> list[os.DirEntry]:
    """A folder's entries in walk order: by the bytes of their name, a folder's (a symlink to one too) with
    "/". All-ASCII names (the usual case) sort as str, in the same order."""
    keys = [entry.name + "/" if _is_dir(entry) else entry.name for entry in entries]
    if not "".join(keys).isascii():
        keys = [sort_key(key) for key in keys]
    return [entries[i] for i in sorted(range(len(entries)), key=keys.__getitem__)]


def _walk(conf: Confinement, folder: str, rel_folder: str, ancestors: frozenset, found: _Found) -> None:
    """Scan ``folder`` (a real path; ``rel_folder`` its path under the root) into ``found``."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        found.quarantine.append(quarantine_record(rel_folder or ".", f"unreadable folder: {exc.strerror}"))
        return
    try:
        _walk_open(conf, folder, fd, rel_folder, ancestors, found)
    finally:
        os.close(fd)


def _walk_open(conf: Confinement, folder: str, fd: int, rel_folder: str, ancestors: frozenset, found: _Found) -> None:
    """``_walk`` of the folder open at ``fd``: its entries are listed and stat'ed relative to the descriptor
    (``fstatat``: no walk of the folder's path again per file)."""
    try:
        with os.scandir(fd) as it:
            children = walk_order(list(it))
    except OSError as exc:
        found.quarantine.append(quarantine_record(rel_folder or ".", f"unreadable folder: {exc.strerror}"))
        return
    canonical = folder == (f"{conf.root}/{rel_folder}" if rel_folder else conf.root)
    rels, stats = found.rels, found.stats
    junk = JUNK_NAMES
    for entry in children:
        name = entry.name
        if name[0] == "." or name in junk:  # is_junk, inlined: it runs for every entry
            found.skipped += 1
            continue
        rel = f"{rel_folder}/{name}" if rel_folder else name
        try:
            plain_file = entry.is_file(follow_symlinks=False)  # d_type: no system call
            st = entry.stat(follow_symlinks=False) if plain_file else None  # fstatat(fd, name)
        except OSError:
            plain_file = False
        if plain_file:  # a regular file in a real folder inside the root: its own real path
            too_big = conf.size_refusal(st.st_size)
            if too_big is not None:
                found.quarantine.append(quarantine_record(rel, too_big))
                continue
            if not canonical:
                found.real_paths[len(rels)] = f"{folder}/{name}"
            rels.append(rel)
            stats += (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
            continue
        checked = conf.check(f"{folder}/{name}", parent_is_real=True)  # symlinks, folders, special files
        if checked.reason is not None:
            found.quarantine.append(quarantine_record(rel, checked.reason))
        elif checked.is_dir:
            ident = (checked.st.st_dev, checked.st.st_ino)
            if ident in ancestors:
                found.quarantine.append(quarantine_record(rel, "symlink loop (folder already being scanned)"))
                continue
            if len(ancestors) > MAX_DEPTH:
                found.quarantine.append(quarantine_record(rel, f"folder nested over {MAX_DEPTH} levels below SOURCE "
                                                               "(not walked)"))
                continue
            if not rel_folder:
                found.top_dirs.append(name)
            _walk(conf, checked.real, rel, ancestors | {ident}, found)
        else:
            if checked.real != f"{conf.root}/{rel}":
                found.real_paths[len(rels)] = checked.real
            rels.append(rel)
            st = checked.st
            stats += (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _scan_top_folder(args: tuple) -> bytes:
    """Pool task: the walk of one top-level folder, packed."""
    conf, path, name, ancestors = args
    found = _Found()
    _walk(conf, path, name, frozenset(map(tuple, ancestors)), found)
    return found.pack()


def _top_level(conf: Confinement, root_ident: tuple) -> tuple[_Found, list[tuple]]:
    """The root's own files and refusals, and the (path, name, ancestors) of each top-level folder to walk."""
    found = _Found()
    folders: list[tuple] = []
    try:
        with os.scandir(conf.root) as it:
            children = walk_order(list(it))
    except OSError as exc:
        found.quarantine.append(quarantine_record(".", f"unreadable folder: {exc.strerror}"))
        return found, folders
    for entry in children:
        if is_junk(entry.name):
            found.skipped += 1
            continue
        checked = conf.check(entry.path, parent_is_real=True)
        if checked.reason is not None:
            found.quarantine.append(quarantine_record(entry.name, checked.reason))
        elif checked.is_dir:
            ident = (checked.st.st_dev, checked.st.st_ino)
            if ident == root_ident:
                found.quarantine.append(quarantine_record(entry.name, "symlink loop (folder already being scanned)"))
                continue
            found.top_dirs.append(entry.name)
            folders.append((checked.real, entry.name, [root_ident, ident]))
        else:
            if checked.real != f"{conf.root}/{entry.name}":
                found.real_paths[len(found.rels)] = checked.real
            found.rels.append(entry.name)
            st = checked.st
            found.stats += (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
    return found, folders


@dataclass
class Walks:
    """The walks of a root's top-level folders, submitted to their pool (None: they run in this process)."""

    conf: Confinement
    workers: int
    top: _Found
    tasks: list[tuple]
    pool: object = None
    results: Iterator[bytes] | None = None
    children: ForkedTasks | None = None  # the walks in forked children instead of a pool (``forked``)

    @classmethod
    def start(cls, conf: Confinement, workers: int, forked: bool = False) -> "Walks":
        """List the root (``conf.root``), then submit the walks of its top-level folders when there are enough of
        them for a pool (see the module docstring). ``forked``: where the pool would fork, the walks run in
        forked children that leave no thread in this process (``repack.exec.forked.ForkedTasks``) instead."""
        root_st = os.stat(conf.root)
        top, folders = _top_level(conf, (root_st.st_dev, root_st.st_ino))
        walks = cls(conf, workers, top, [(conf, *folder) for folder in folders])
        if forked and start_method(workers, len(walks.tasks), PARALLEL_MIN_FOLDERS) == "fork":
            walks.children = ForkedTasks(_scan_top_folder, walks.tasks, workers)
            return walks
        walks.pool = scan_pool(workers, len(walks.tasks), PARALLEL_MIN_FOLDERS, __name__)
        if walks.pool is not None:
            try:
                walks.results = walks.pool.map(_scan_top_folder, walks.tasks, chunksize=4)  # the workers are busy
            except BaseException:
                walks.stop()
                raise
        return walks

    def parts(self, meanwhile: Callable[[], object] | None = None) -> list[bytes]:
        """Every folder's walk (``_Found.pack``), the root's own files first, running ``meanwhile`` in this process
        while the pool walks (serial: before the walks); the pool ends with them."""
        try:
            if meanwhile is not None:
                meanwhile()
            walked = self.results if self.pool is not None else None
            if self.children is not None:
                walked = self.children.results()  # None: a child failed, and its error is raised below
            if walked is None:
                walked = map(_scan_top_folder, self.tasks)
            return [self.top.pack(), *walked]
        finally:
            self.stop()

    def stop(self) -> None:
        """Cancel the walks not started (none once all were taken) and wait for the pool's workers to end (end
        the forked children not waited for)."""
        if self.children is not None:
            self.children.stop()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


_AHEAD: list[Walks] = []  # walks started by walk_ahead that no scan took yet


@contextlib.contextmanager
def walk_ahead(root: str, confinement: Confinement, workers: int) -> Iterator[None]:
    """Start the walk of folder ``root`` now, so that what the caller imports and checks next runs while forked
    children walk (``ForkedTasks``, forked from a process that has imported little, no thread left here; a pool
    where a thread already runs); ``scan_folder`` of the same root,
    rules and workers inside the block takes it. A walk that no scan took (a refusal before the plan) is
    cancelled on leaving the block. Where the scan would not use a pool (one worker, few folders: a flat
    folder of files) only the root's listing is done now, and the scan takes that. Nothing starts where
    ``root`` is no readable folder: ``scan_folder`` then does it all, and says what is wrong."""
    walks = None
    if os.path.isdir(root):
        try:
            walks = Walks.start(confinement.rooted(root), workers, forked=True)
        except OSError:
            walks = None
    if walks is not None:
        _AHEAD.append(walks)
    try:
        yield
    finally:
        if walks is not None and walks in _AHEAD:
            _AHEAD.remove(walks)
            walks.stop()


def taken_ahead(conf: Confinement, workers: int) -> Walks | None:
    for walks in _AHEAD:
        if walks.conf == conf and walks.workers == workers:
            _AHEAD.remove(walks)
            return walks
    return None
