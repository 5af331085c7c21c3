"""Deterministic enumeration of inputs: folder trees and list files, all through one confinement."""

from repack.errors import UsageError
from repack.sources.base import InputItem, Scan, clean_labels
from repack.sources.confine import Confinement
from repack.sources.folder import scan_folder
from repack.sources.listfile import scan_list_file
from repack.store import is_remote

__all__ = ["Confinement", "InputItem", "Scan", "scan_folder", "scan_list_file", "scan_source"]


def scan_source(source: str, *, list_file: bool, confinement: Confinement | None = None) -> Scan:
    """Enumerate a folder tree, a list file or an s3:// prefix into sorted inputs plus quarantined entries.

    The confinement's root is the folder, or the list file's folder; its rules apply to every input
    (an s3:// prefix: only its size cap, objects are neither symlinks nor special files). Labels
    follow one rule (``sources.base.clean_label``: surrounding whitespace stripped)."""
    import os

    if is_remote(source):
        if list_file:
            raise UsageError("--list reads a local list file: SOURCE cannot be an s3:// URL with --list")
        from repack.sources.s3 import scan_s3

        return clean_labels(scan_s3(source, confinement or Confinement()))
    root = os.path.dirname(os.path.abspath(source)) if list_file else source
    conf = (confinement or Confinement()).rooted(root)
    return clean_labels(scan_list_file(source, conf) if list_file else scan_folder(source, conf))
