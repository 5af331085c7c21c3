"""Deterministic enumeration of inputs: folder trees and list files, all through one confinement."""

from repack.sources.base import InputItem, Scan
from repack.sources.confine import Confinement
from repack.sources.folder import scan_folder
from repack.sources.listfile import scan_list_file

__all__ = ["Confinement", "InputItem", "Scan", "scan_folder", "scan_list_file", "scan_source"]


def scan_source(source: str, *, list_file: bool, confinement: Confinement | None = None) -> Scan:
    """Enumerate a folder tree or a list file into sorted inputs plus quarantined entries.

    The confinement's root is the folder, or the list file's folder; its rules apply to every input."""
    import os

    root = os.path.dirname(os.path.abspath(source)) if list_file else source
    conf = (confinement or Confinement()).rooted(root)
    if list_file:
        return scan_list_file(source, conf)
    return scan_folder(source, conf)
