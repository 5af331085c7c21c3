"""A process that dies with its parent: on Linux, prctl(PR_SET_PDEATHSIG, SIGKILL). Apart from the ffmpeg
helpers so that processes forked before the heavy imports (verify's hashers) pay for ctypes only."""

from __future__ import annotations

import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (a no-op off Linux). Also the
    ``preexec_fn`` of ffmpeg/ffprobe children, so a killed repack leaves no ffmpeg running."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
