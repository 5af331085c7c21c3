"""The few exception types a job can fail with; cli.py maps them to exit codes."""


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


class StrictModeError(RepackError):
    """--strict was given and some inputs were quarantined."""

    exit_code = 6
