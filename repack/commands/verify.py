"""The `repack verify` and `repack inspect` commands: read a finished dataset back."""

from __future__ import annotations

import json
import sys

import click

from repack.errors import VERIFICATION_EXIT_CODE, UsageError
from repack.commands.options import LOCATION


def require_dataset_folder(out: str) -> None:
    """UsageError (exit 2) for a local OUT that does not exist, is not a folder, or holds no repack
    dataset nor job at all; a job that has not finished is the manifest reader's to report."""
    from pathlib import Path

    from repack.store import is_remote

    if is_remote(out):
        return
    path = Path(out)
    if not path.exists():
        raise UsageError(f"{out}: does not exist")
    if not path.is_dir():
        raise UsageError(f"{out}: is not a folder (OUT is the folder a repack command wrote)")
    if not (path / "manifest.json").exists() and not (path / ".repack").is_dir():
        raise UsageError(f"{out}: not a repack dataset (no manifest.json)")


@click.command("verify")
@click.argument("out", type=LOCATION)
@click.option("--json", "json_out", is_flag=True, help="Print the result as JSON.")
@click.option("--version", "version", type=click.IntRange(min=1), default=None, metavar="N",
              help="Check dataset version N (its manifest.vN.json) instead of the latest.")
@click.option("--workers", type=click.IntRange(min=1), default=None, metavar="N",
              help="Processes checking shards in parallel (default: the usable CPUs; s3://: downloads overlap "
                   "on threads instead).")
def verify(out, json_out, version, workers):
    """Re-read every file of the dataset in OUT (a folder or s3://bucket/prefix) and check it against its
    manifest: sizes, sha256, each tar's structure against its index, sample counts, the tokenizer,
    and no file the manifest does not name (energon's files are known). The latest version's files;
    a file only an older kept version names is checked by --version N."""
    from repack.commands.options import ProcessEnd
    from repack.lifecycle.verify import verify_report

    require_dataset_folder(out)
    report = verify_report(out, version, workers)
    ProcessEnd.quick = True  # nothing left to wait for: its checking processes leave on their own
    problems = list(report.problems)
    for note in report.unchecked:
        click.echo(f"{out}: not checked: {note}", err=True)
    if report.pending:
        click.echo(f"{out}: pending (an append, remove or gc that did not finish; the next one publishes it or "
                   f"moves it to .repack/rejected/): {', '.join(report.pending[:10])}"
                   + (f" and {len(report.pending) - 10} more" if len(report.pending) > 10 else ""), err=True)
    if json_out:
        click.echo(json.dumps({"ok": not problems, "problems": problems, "unchecked": list(report.unchecked),
                               "pending": list(report.pending)}))
    elif problems:
        click.echo(f"{out}: {len(problems)} problem(s):", err=True)
        for problem in problems:
            click.echo(f"  - {problem}", err=True)
    else:
        click.echo(f"{out}: OK, every file matches the manifest")
    if problems:
        sys.exit(VERIFICATION_EXIT_CODE)


def print_quarantine(files) -> None:
    """Every quarantine record of the dataset, a JSON line each (from the side file where the manifest names one)."""
    from repack.manifest.quarantine_records import checked_file, iter_records, side_file

    data = files.manifest.data
    raw = checked_file(data, files.read_if_present, files.where)
    records = data["quarantine"] if raw is None else iter_records(raw, f"{files.where}/{side_file(data)}")
    out = click.get_text_stream("stdout")
    for record in records:
        out.write(json.dumps(record, sort_keys=True) + "\n")
    out.flush()


@click.command("inspect")
@click.argument("out", type=LOCATION)
@click.option("--json", "json_out", is_flag=True, help="Print the summary as JSON (the data the HTML report shows).")
@click.option("--html", "html_file", default=None, metavar="FILE",
              help="Also write a self-contained HTML report (charts inline, no network) to FILE.")
@click.option("--quarantine", "every_quarantined", is_flag=True,
              help="Print every quarantine record instead, one JSON object per line (the manifest lists the first "
                   "1,000, REPACK_QUARANTINE_LISTED; the rest are in its side file quarantine.records).")
def inspect(out, json_out, html_file, every_quarantined):
    """Summarize the dataset in OUT (a folder or s3://bucket/prefix): counts, sizes, classes, quarantine,
    timing; --html draws it."""
    from repack.errors import VerificationError
    from repack.report.collect import collect, missing_files
    from repack.store.files import open_dataset
    from repack.report.inspect import inspect_lines

    from repack.manifest import ManifestError

    require_dataset_folder(out)
    files = open_dataset(out)
    if every_quarantined:
        print_quarantine(files)
        return
    missing = missing_files(files)
    # the figures below are the manifest's claims about files that are not there: said first, and exit 5
    damage = (f"{out} is damaged: {'; '.join(missing[:3])}{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''}"
              "; run `repack verify`") if missing else None
    if damage and not json_out:
        click.echo(f"DAMAGED: {damage}")  # first, also when the rest cannot be read (a missing index)
    try:
        if html_file:
            from repack.report.html import dataset_page, write_page
            from repack.report.samples import gather

            write_page(html_file, dataset_page({**collect(files), **({"damaged": damage} if damage else {})},
                                               gather(files)))
        if json_out:
            if not missing:  # the summary reads each index: content damaged at the right size fails --json alike
                inspect_lines(files)
            click.echo(json.dumps({**collect(files), **({"damaged": missing} if missing else {})}, sort_keys=True))
        else:
            click.echo("\n".join(inspect_lines(files)))
    except (TypeError, AttributeError, KeyError) as exc:  # a section of another shape than repack writes
        raise ManifestError(f"{out}: the manifest's sections are not what repack writes ({type(exc).__name__}: "
                            f"{exc}); run `repack verify`") from None
    except (ValueError, IndexError, OSError) as exc:  # a file of the right size and damaged content (a token index)
        raise VerificationError(damage or f"{out} is damaged ({type(exc).__name__}: {exc}); run `repack verify`") \
            from None
    if damage:
        raise VerificationError(damage)
    if html_file:
        click.echo(f"report: {html_file}", err=True)
