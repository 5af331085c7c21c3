"""Load a page in a real headless Chromium (Debian's `chromium`, installed by `make system-deps`):
a screenshot and every console message the page produced. Offline: the browser resolves no host."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

CONSOLE = re.compile(r":CONSOLE[:(]\d+\)?\] (.*)")


def chromium() -> str:
    """The chromium binary; a clear failure (never a skip) when it is missing."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError("chromium is not installed: run `make system-deps` (apt-get install chromium)")
    return path


def render(page: str | Path, screenshot: str | Path, width: int = 1100, height: int = 1600,
           timeout: float = 120) -> list[str]:
    """Load ``page`` (a local file), save a ``width`` x ``height`` screenshot; returns the console messages."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        proc = subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={profile}",
             f"--screenshot={Path(screenshot).absolute()}", f"--window-size={width},{height}",
             "--hide-scrollbars", "--enable-logging=stderr", "--v=0", Path(page).absolute().as_uri()],
            capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not Path(screenshot).is_file():
        raise RuntimeError(f"chromium exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [m.group(1) for m in map(CONSOLE.search, proc.stderr.splitlines()) if m]


def ink(screenshot: str | Path, color: tuple[int, int, int] | None = None, tolerance: int = 24) -> int:
    """Pixels that are not (near) white, or, with ``color``, pixels within ``tolerance`` of it."""
    pixels = np.asarray(Image.open(screenshot).convert("RGB"), dtype=np.int16)
    if color is None:
        return int((pixels.min(axis=2) < 235).sum())
    return int((np.abs(pixels - np.array(color, dtype=np.int16)).max(axis=2) <= tolerance).sum())
