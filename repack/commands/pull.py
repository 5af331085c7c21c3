"""The `repack pull` command: copy a dataset from object storage to a local folder."""

from __future__ import annotations

import click

from repack.errors import UsageError
from repack.commands.options import LOCATION


def parse_versions(value: str) -> int | None:
    """``latest`` -> 1, ``all`` -> None (every kept version), ``K`` -> the K newest."""
    if value == "latest":
        return 1
    if value == "all":
        return None
    if value.isascii() and value.isdigit() and int(value) >= 1:  # "²" is a digit int() refuses
        return int(value)
    raise UsageError(f"--versions {value!r}: expected latest, all or a positive number of versions")


@click.command("pull")
@click.argument("url", type=LOCATION)
@click.argument("dest", type=LOCATION)
@click.option("--versions", "versions", default="latest", show_default=True, metavar="latest|all|K",
              help="Which versions to copy: the latest, every kept one, or the K newest (readers pinned to "
                   "version=N need N copied).")
def pull(url, dest, versions):
    """Copy the dataset at URL (s3://bucket/prefix) into the local folder DEST, checked.

    The latest version is pinned when the pull starts: a version published meanwhile is not copied, and
    DEST gets exactly the manifest that was checked. Every shard, index and side file is checked
    against the manifest (size, sha256) while it is downloaded, then the copy as `repack verify` checks
    a folder (tar structure against the index, sample counts, the tokenizer's sha256); files already
    in DEST and intact are kept; the manifests are written last. A failed check exits 5.
    """
    from repack.lifecycle.pull import PullSpec
    from repack.lifecycle.pull import pull as pull_dataset
    from repack.manifest.versions import number_of
    from repack.store import is_remote

    if not is_remote(url):
        raise UsageError(f"URL must be an s3:// location, not {url!r}")
    if is_remote(dest):  # Path() of it would be a local folder named "s3:"
        raise UsageError(f"DEST must be a local folder, not {dest!r}: pull copies a dataset out of object storage")
    manifest = pull_dataset(PullSpec(url, dest, parse_versions(versions)))
    click.echo(f"{url} -> {dest}: version {number_of(manifest.data)}, {pulled_files(manifest)}")


def pulled_files(manifest) -> str:
    """What a pull copied and checked, in the dataset's words: N video(s) for a videos dataset (a file
    per sample, checked by size and sha256), else N shard(s) holding M samples."""
    from repack.report.collect import file_unit

    unit = file_unit(manifest.format)
    if unit == "video":
        return f"{len(manifest.shards)} video(s), checked (sizes, sha256)"
    return (f"{len(manifest.shards)} {unit}(s), {manifest.num_samples} samples, checked (sizes, sha256, structure "
            "against the index)")
