"""Deterministic enumeration of inputs: folder trees and list files, all through one confinement."""

from typing import Callable

from repack.errors import UsageError
from repack.sources.base import InputItem, Scan, clean_labels
from repack.sources.confine import Confinement
from repack.store import is_remote

__all__ = ["Confinement", "InputItem", "Scan", "scan_folder", "scan_foreign", "scan_list_file", "scan_source"]


def __getattr__(name: str):
    """``scan_folder`` and ``scan_list_file``, imported when first asked for: they import numpy, and the folder
    walk (``repack.sources.walk``, a module of this package) starts before numpy is imported."""
    if name == "scan_folder":
        from repack.sources.folder import scan_folder

        return scan_folder
    if name == "scan_list_file":
        from repack.sources.listfile import scan_list_file

        return scan_list_file
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FOREIGN_FORMATS = ("webdataset", "parquet")  # --from: datasets written by other tools (repack.sources.tar_shards, ...)


def scan_foreign(source: str, source_format: str, fields, confinement: Confinement | None = None,
                 workers: int = 1) -> Scan:
    """Enumerate another tool's dataset (``--from webdataset|parquet``; ``fields``: a ``FieldChoice``;
    ``workers``: processes that read local tar shards)."""
    if source_format == "webdataset":
        from repack.sources.tar_shards import scan_tar_shards

        return scan_tar_shards(source, fields, confinement, workers)
    if source_format == "parquet":
        from repack.sources.parquet_images import scan_parquet

        return scan_parquet(source, fields, confinement)
    raise UsageError(f"--from must be folder, {' or '.join(FOREIGN_FORMATS)}, got {source_format!r}")


def scan_source(source: str, *, list_file: bool, confinement: Confinement | None = None, workers: int = 1,
                meanwhile: Callable[[], object] | None = None,
                prefer: Callable[[list[str]], list[bool]] | None = None) -> Scan:
    """Enumerate a folder tree, a list file or an s3:// prefix into sorted inputs plus quarantined entries.

    The confinement's root is the folder, or the list file's folder; its rules apply to every input
    (an s3:// prefix: only its size cap, objects are neither symlinks nor special files). Labels
    follow one rule (``sources.base.clean_label``: surrounding whitespace stripped). ``workers``: processes
    a folder scan may use (``repack.sources.folder``). ``meanwhile``: the driver's own work, run once while a
    folder's walk runs on the pool (other sources: before they are listed). ``prefer``: which of a file's
    several paths a folder scan keeps first (``repack.sources.folder.scan_folder``)."""
    import os

    if meanwhile is not None and (is_remote(source) or list_file):
        meanwhile()
    if is_remote(source):
        if list_file:
            raise UsageError("--list reads a local list file: SOURCE cannot be an s3:// URL with --list")
        from repack.sources.s3 import scan_s3

        return clean_labels(scan_s3(source, confinement or Confinement()))
    from repack.sources.folder import scan_folder
    from repack.sources.listfile import scan_list_file

    root = os.path.dirname(os.path.abspath(source)) if list_file else source
    conf = (confinement or Confinement()).rooted(root)
    return clean_labels(scan_list_file(source, conf, workers) if list_file else
                        scan_folder(source, conf, workers, meanwhile, prefer))
