"""The `repack remove` command."""

from __future__ import annotations

import click

from repack.commands.versions import say_published
from repack.config import EngineOptions
from repack.errors import UsageError
from repack.commands.options import LOCATION


@click.command("remove")
@click.argument("out", type=LOCATION)
@click.option("--sources", "sources_file", default=None, metavar="FILE",
              help="Remove the samples of these source paths (one per line, as in each sample's json 'path', or "
                   "whole paths inside SOURCE).")
@click.option("--keys", "keys_file", default=None, metavar="FILE", help="Remove the samples of these keys (one per line).")
@click.option("--null", "-0", "null", is_flag=True,
              help="FILE's names end at NUL bytes (find -print0), taken exactly: for names holding a newline, "
                   "ending with a carriage return or starting with a byte order mark, which a line drops.")
@click.option("--json", "json_summary", is_flag=True, help="Print a machine-readable summary on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="With --json: only the JSON summary.")
def remove(out, sources_file, keys_file, null, json_summary, quiet):
    """Publish the next version of the dataset in OUT without some samples: only the shards holding them
    are rewritten (under new names); `repack gc` then deletes the old files."""
    from repack.commands.options import location
    from repack.lifecycle.remove import RemoveSpec, read_names, remove_samples

    if (sources_file is None) == (keys_file is None):
        raise UsageError("name what to remove with exactly one of --sources FILE or --keys FILE")
    by, path = ("sources", sources_file) if sources_file else ("keys", keys_file)
    result = remove_samples(RemoveSpec(location(out), read_names(path, null=null), by))
    for name in result.not_found[:20]:
        click.echo(f"not found in the dataset: {name}", err=True)
    if len(result.not_found) > 20:
        click.echo(f"... and {len(result.not_found) - 20} more not found", err=True)
    say_published(location(out), result.manifest, result.published,
                  f"{result.removed} sample(s) removed, "
                  f"{_taken_down(result.manifest)}{len(result.not_found)} name(s) not found",
                  EngineOptions(quiet=quiet, json_summary=json_summary), result.seconds,
                  none_reason="no named sample found", command="remove")


def _taken_down(manifest: dict) -> str:
    """The quarantined inputs the published remove took down, in words (empty when none)."""
    named = ((manifest.get("dataset_version") or {}).get("change") or {}).get("removed_quarantined") or ()
    return f"{len(named)} quarantined input(s) taken down, " if named else ""
