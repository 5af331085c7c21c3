"""Deterministic enumeration of inputs: folder trees and list files."""

from repack.sources.base import InputItem, Scan
from repack.sources.folder import scan_folder
from repack.sources.listfile import scan_list_file

__all__ = ["InputItem", "Scan", "scan_folder", "scan_list_file", "scan_source"]


def scan_source(source: str, *, list_file: bool, follow_symlinks: bool = True) -> Scan:
    """Enumerate a folder tree or a list file into sorted inputs plus quarantined entries."""
    if list_file:
        return scan_list_file(source)
    return scan_folder(source, follow_symlinks=follow_symlinks)
