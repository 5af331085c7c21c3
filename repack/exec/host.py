"""Whether a worker shares the driver's folder for a job (one machine, one folder) or has its own."""

from __future__ import annotations

import os
from pathlib import Path


def _boot_id() -> str:
    """This kernel's boot id (Linux): containers on one host share it; another host's differs."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def job_folder(out: str) -> Path:
    """The local folder a job's writers write into on this machine: OUT itself, or for an object
    store this machine's scratch for it (``$REPACK_SCRATCH``, set per node)."""
    from repack.store import is_remote

    if is_remote(out):
        from repack.store.s3 import scratch_folder

        return scratch_folder(out)
    return Path(out)


def host_token(folder: Path) -> str:
    """A token equal in two processes exactly when both run on one kernel and ``folder`` is the same
    folder there (device and inode): they share its files and page cache. Empty (equal to no
    token) for a missing folder or without a boot id."""
    boot = _boot_id()
    try:
        st = os.stat(folder)
    except OSError:
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}" if boot else ""
