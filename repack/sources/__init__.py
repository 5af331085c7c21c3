"""Deterministic enumeration of inputs: folder trees and list files."""

from repack.errors import UsageError
from repack.sources.base import InputItem, Scan
from repack.sources.folder import scan_folder
from repack.sources.listfile import scan_list_file
from repack.store import is_remote

__all__ = ["InputItem", "Scan", "scan_folder", "scan_list_file", "scan_source"]


def scan_source(source: str, *, list_file: bool, follow_symlinks: bool = True) -> Scan:
    """Enumerate a folder tree or a list file into sorted inputs plus quarantined entries."""
    if is_remote(source):
        if list_file:
            raise UsageError("--list reads a local list file: SOURCE cannot be an s3:// URL with --list")
        from repack.sources.s3 import scan_s3

        return scan_s3(source)
    if list_file:
        return scan_list_file(source)
    return scan_folder(source, follow_symlinks=follow_symlinks)
