"""The `repack pull` command: copy a dataset from object storage to a local folder."""

from __future__ import annotations

import click

from repack.errors import UsageError


@click.command("pull")
@click.argument("url")
@click.argument("dest")
def pull(url, dest):
    """Copy the dataset at URL (s3://bucket/prefix) into the local folder DEST, checked.

    Every shard, index and side file is checked against the manifest (size, sha256) while it is
    downloaded, then the copy as `repack verify` checks a folder (tar structure against the index,
    sample counts, the tokenizer's sha256); files already in DEST and intact are kept; the manifest
    is written last. A failed check exits 5.
    """
    from repack.jobs.pull import pull as pull_dataset
    from repack.store import is_remote

    if not is_remote(url):
        raise UsageError(f"URL must be an s3:// location, not {url!r}")
    manifest = pull_dataset(url, dest)
    click.echo(f"{url} -> {dest}: {len(manifest.shards)} shard(s), {manifest.num_samples} samples, "
               "checked (sizes, sha256, structure against the index)")
