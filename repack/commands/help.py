"""Help that teaches: job commands list their options in sections (input, output, checking,
running) and end with the exit codes; the top-level command list never cuts a description short.

Click has no option groups; a ``click.Command`` subclass that formats sections is all it takes
(no extra dependency). A command names the options of each section; any option it does not
name (e.g. one added later) falls into "Running", so new options always show up.
"""

from __future__ import annotations

import click

from repack.errors import (VERIFICATION_EXIT_CODE, IncompleteJobError, JobLockedError, NothingPackedError,
                           StrictModeError, UsageError)

SECTIONS = ("input", "output", "checking", "running")

EXIT_CODES: tuple[tuple[str, str], ...] = (
    ("0", "done (or nothing to do: the job in OUT is complete)"),
    (str(UsageError.exit_code), "bad job: missing source, unwritable OUT, bad option, OUT holds another job "
                                "or files of no repack job"),
    (str(JobLockedError.exit_code), "OUT is locked by a live run of the same job"),
    (str(IncompleteJobError.exit_code), "tasks failed, or the disk filled: finished shards are kept, a re-run resumes"),
    (str(VERIFICATION_EXIT_CODE), "verification failed: a file does not match the manifest"),
    (str(StrictModeError.exit_code), "--strict and --strict's condition held (see --strict)"),
    (str(NothingPackedError.exit_code), "inputs were found but nothing was packed (every one quarantined; an "
                                        "--append records them in a version instead, exit 0)"),
    ("130", "interrupted (Ctrl-C, SIGINT): workers stopped, temp files removed; re-run to resume"),
    ("143", "terminated (SIGTERM, e.g. Slurm or Kubernetes): the same; re-run to resume"),
)


class JobCommand(click.Command):
    """A command whose --help shows its options in sections and its exit codes."""

    def __init__(self, *args, sections: dict[str, tuple[str, ...]] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sections = {name: tuple(names) for name, names in (sections or {}).items()}
        unknown = set(self.sections) - set(SECTIONS)
        if unknown:
            raise ValueError(f"unknown option section(s) {sorted(unknown)}; use {SECTIONS}")
        strays = {n for names in self.sections.values() for n in names} - {p.name for p in self.params}
        if strays:
            raise ValueError(f"{self.name}: sections name no such option(s) {sorted(strays)}")

    def section_of(self, param: click.Parameter) -> str:
        """The section an option is listed under ("running" unless the command names it)."""
        return next((name for name, names in self.sections.items() if param.name in names), "running")

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict[str, list[tuple[str, str]]] = {name: [] for name in SECTIONS}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                rows[self.section_of(param)].append(record)
        for name in SECTIONS:
            if rows[name]:
                with formatter.section(f"{name.capitalize()} options"):
                    formatter.write_dl(rows[name])

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Exit codes"):
            formatter.write_dl(list(EXIT_CODES))
        super().format_epilog(ctx, formatter)


class RepackGroup(click.Group):
    """The top-level group: its command list shows each command's first sentence whole."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, cmd.get_short_help_str(limit=10_000)) for name, cmd in
                ((n, self.get_command(ctx, n)) for n in self.list_commands(ctx)) if cmd is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
