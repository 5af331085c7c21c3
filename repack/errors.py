"""The few exception types a job can fail with (cli.py maps them to exit codes), and
``stable_reason``: an exception as quarantine text that is the same on every run."""

import re

_ADDRESS = re.compile(r"\s*<[^<>]*? at 0x[0-9a-fA-F]+>")
REASON_MAX = 300


def stable_reason(exc: BaseException, prefix: str = "") -> str:
    """``Type: message`` without object reprs or memory addresses, at most REASON_MAX characters."""
    message = _ADDRESS.sub("", str(exc)).strip()
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return (prefix + text)[:REASON_MAX]


class RepackError(Exception):
    """A job-level failure with a message meant for the user (exit code 2)."""

    exit_code = 2


class UsageError(RepackError):
    """Bad options or bad source/output locations, detected before any work."""


class JobLockedError(RepackError):
    """Another live process is running the same job (or partition) on OUT."""

    exit_code = 3


class IncompleteJobError(RepackError):
    """Tasks failed or are missing; finished shards stay valid and resumable."""

    exit_code = 4


# A dataset that does not match its manifest, or a manifest that cannot be trusted.
VERIFICATION_EXIT_CODE = 5


class VerificationError(RepackError):
    """Data that does not match its manifest (``repack pull``: a copied object fails its checks)."""

    exit_code = VERIFICATION_EXIT_CODE


class ConfinementError(RepackError):
    """A store asked to write or delete outside its root (a ``..``, an absolute path, a symbolic link on
    the way, a key outside the prefix): refused, nothing touched."""

    exit_code = VERIFICATION_EXIT_CODE


class NothingPackedError(RepackError):
    """Inputs were found but every one was quarantined: the dataset is empty."""

    exit_code = 7


class Interrupted(BaseException):
    """SIGTERM (exit 143) or SIGINT (exit 130), raised by cli.main's signal handler. A BaseException
    (like KeyboardInterrupt) so that no per-record ``except Exception`` swallows it; the engine stops
    the workers and removes temp files on its way out."""

    def __init__(self, signal_name: str, exit_code: int) -> None:
        super().__init__(f"interrupted by {signal_name}: workers stopped, temp files removed; finished shards "
                         "are kept, re-run the same command to resume")
        self.exit_code = exit_code


class StrictModeError(RepackError):
    """--strict was given and some inputs were quarantined."""

    exit_code = 6
