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


class SourceUnavailable(RepackError):
    """An input in object storage that its endpoint did not serve after every attempt (connections refused or
    cut, timeouts, throttling, 5xx, credentials that stopped working): a fault of the server, not of the
    input, so its task fails and a re-run asks again; never a quarantine record, which would leave it out of
    the dataset for good."""

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
        self.signal_name = signal_name
        self.exit_code = exit_code


_RECEIVED: list[Interrupted] = []  # the signal the handler raised for, kept in case its raise was swallowed


def note_interrupt(interrupt: Interrupted) -> Interrupted:
    """Remember ``interrupt`` (the signal handler's, before it raises it): a handler runs wherever the main thread
    is, and a raise inside C code that clears errors (an import, a C library calling back into Python) is lost;
    ``raise_if_interrupted`` raises it again at the next checkpoint."""
    _RECEIVED[:] = [interrupt]
    return interrupt


def raise_if_interrupted() -> None:
    """A checkpoint where work goes on (the engine's loop, before a version is published): raise the signal's
    Interrupted again when one came whose raise did not end the command."""
    if _RECEIVED:
        raise Interrupted(_RECEIVED[0].signal_name, _RECEIVED[0].exit_code)


def interrupt_received() -> Interrupted | None:
    """The signal's Interrupted, where one came (see ``note_interrupt``)."""
    return _RECEIVED[0] if _RECEIVED else None


class StrictModeError(RepackError):
    """--strict was given and some inputs were quarantined."""

    exit_code = 6
