"""The `repack gc` command."""

from __future__ import annotations

import json

import click

from repack.config import format_size
from repack.commands.options import LOCATION


@click.command("gc")
@click.argument("out", type=LOCATION)
@click.option("--keep", type=click.IntRange(min=1), default=1, show_default=True, metavar="K",
              help="Keep the K newest versions (and every file they name).")
@click.option("--json", "json_summary", is_flag=True, help="Print a machine-readable summary on stdout.")
def gc(out, keep, json_summary):
    """Delete the files of the dataset in OUT that no kept version names (removed samples' bytes go)."""
    from repack.commands.options import location
    from repack.lifecycle.gc import collect_garbage

    result = collect_garbage(location(out), keep)
    if json_summary:
        click.echo(json.dumps({"kept": list(result.kept), "deleted_versions": list(result.deleted_versions),
                               "deleted_files": list(result.deleted_files), "freed_bytes": result.freed_bytes}))
    else:
        click.echo(f"kept version(s) {', '.join(map(str, result.kept))}; deleted "
                   f"{len(result.deleted_versions)} older version(s) and {len(result.deleted_files)} file(s), "
                   f"{format_size(result.freed_bytes)} freed")
