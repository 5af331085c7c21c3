"""What the version commands share: running an append and saying what was published."""

from __future__ import annotations

import json

import click

from repack.config import EngineOptions


def say_published(out: str, manifest: dict, published: bool, what: str, options: EngineOptions,
                  seconds: float, none_reason: str = "nothing new", extra: dict | None = None) -> None:
    """One line (or a JSON summary with --json, plus ``extra``): the version now published, or that none was."""
    from repack.manifest.versions import number_of

    number = number_of(manifest)
    if published:
        message = f"published version {number} of {out}: {what} ({seconds:.1f} s)"
    else:
        message = f"{none_reason}: version {number} of {out} unchanged, nothing published"
    if options.json_summary:
        click.echo(json.dumps({"out": out, "version": number, "published": published,
                               "totals": manifest["totals"], **(extra or {})}, sort_keys=True))
    if not options.quiet or not published:
        click.echo(message, err=options.json_summary)


def run_append(spec, options: EngineOptions, note: str = "") -> None:
    """`repack images|text|video --append` (``note``: said after the counts)."""
    from repack.jobs.append import append

    result = append(spec, options)
    left_out = (f"; {result.removed_skipped} removed source(s) found again and left out"
                if result.removed_skipped else "")
    say_published(spec.out, result.manifest, result.published,
                  f"{result.added} new sample(s), {result.manifest['totals']['samples']} in all{left_out}{note}",
                  options, result.seconds, none_reason=f"nothing new{left_out}",
                  extra={"removed_skipped": result.removed_skipped})
