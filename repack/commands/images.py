"""The `repack images` command."""

from __future__ import annotations

from pathlib import Path

import click

from repack.commands.options import engine_options, run_job, split_engine_options
from repack.config import ImagesSpec, parse_size


@click.command("images")
@click.argument("source")
@click.argument("out")
@click.option("--to", "to", default="webdataset", show_default=True, help="Output format (webdataset, lmdb).")
@click.option("--list", "list_file", is_flag=True, help="SOURCE is a .csv/.tsv/.jsonl list file (path[,label]).")
@click.option("--shard-size", type=int, default=None, help="At most N inputs per shard.")
@click.option("--shard-bytes", default=None, help="At most SIZE per shard, e.g. 512MB (default when no --shard-size).")
@click.option("--chunk-size", type=int, default=128, show_default=True,
              help="At most N inputs per task (work unit; shards are assembled from chunks, their bytes do not depend on it).")
@click.option("--shuffle", is_flag=True, help="Shuffle inputs across shards before cutting.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --shuffle.")
@click.option("--verify", type=click.Choice(["decode", "header", "none"]), default="decode", show_default=True,
              help="How hard each image is checked before it is packed.")
@click.option("--no-follow-symlinks", "no_follow", is_flag=True, help="Quarantine symlinks instead of following.")
@click.option("--normalize", is_flag=True, help="Re-encode non-conforming images as baseline 4:2:0 RGB JPEG.")
@click.option("--quality", type=int, default=90, show_default=True, help="JPEG quality of --normalize output.")
@click.option("--max-side", type=int, default=None, help="With --normalize: downscale so the longer side <= N.")
@click.option("--dedup", is_flag=True, help="Drop exact duplicates (same content), keeping the first.")
@click.option("--max-pixels", type=int, default=178_956_970, show_default=True,
              help="Quarantine images declaring more pixels (decompression bombs).")
@engine_options
def images(source, out, to, list_file, shard_size, shard_bytes, chunk_size, shuffle, seed, verify, no_follow, normalize,
           quality, max_side, dedup, max_pixels, **kwargs):
    """Pack an ImageFolder tree (or a list file) SOURCE into shards under OUT."""
    from repack.jobs.images import ImagesJob

    options = split_engine_options(kwargs)
    spec = ImagesSpec(source=str(Path(source).absolute()), out=str(Path(out).absolute()), to=to,
                      list_file=list_file, shard_size=shard_size, shard_bytes=parse_size(shard_bytes), chunk_size=chunk_size,
                      shuffle=shuffle, seed=seed, verify=verify, follow_symlinks=not no_follow,
                      normalize=normalize, quality=quality, max_side=max_side, dedup=dedup, max_pixels=max_pixels)
    run_job(ImagesJob(spec), options)
