"""The `repack images` command."""

from __future__ import annotations

import contextlib

import click

from repack.commands.options import (LOCATION, engine_options, job_command, location, run_job, source_options,
                                     split_engine_options)
from repack.config import ImagesSpec, parse_size
from repack.errors import UsageError
from repack.store import is_remote


@job_command("images", input=("list_file", "source_format", "image_field", "label_field", "append"),
             output=("to", "shard_size", "shard_bytes", "shuffle", "seed", "normalize", "quality", "max_side",
                     "dedup", "sample_json"),
             checking=("verify", "max_pixels", "max_file_size"))
@click.argument("source", type=LOCATION)
@click.argument("out", type=LOCATION)
@click.option("--to", "to", type=click.Choice(["webdataset", "lmdb"]), default="webdataset", show_default=True,
              help="Output format: WebDataset tar shards (+ DALI .idx) or one LMDB file.")
@click.option("--list", "list_file", is_flag=True, help="SOURCE is a .csv/.tsv/.jsonl list file (path[,label]).")
@click.option("--from", "source_format", type=click.Choice(["folder", "webdataset", "parquet"]), default="folder",
              show_default=True, help="What SOURCE is: an image tree (or --list file), tar shards written by another "
                                      "tool (webdataset ShardWriter, img2dataset), or parquet files with an image "
                                      "column (Hugging Face datasets export).")
@click.option("--image-field", default=None, metavar="NAME",
              help="--from webdataset|parquet: the image member's extension (e.g. jpg) or column (default: found by "
                   "type).")
@click.option("--label-field", default=None, metavar="NAME",
              help="--from webdataset|parquet: the label member's extension (e.g. cls) or column (default: cls/label/"
                   "class, or the ClassLabel column).")
@click.option("--append", is_flag=True,
              help="OUT holds a dataset: pack only the inputs it does not hold yet (same path, size and mtime; "
                   "s3://: key, size and ETag; an mtime or ETag alone changed: compared by content) into new shards and "
                   "publish them as its next version.")
@click.option("--shard-size", type=int, default=None,
              help="At most N inputs per shard (tiny samples: 16384 makes a remove rewrite less).")
@click.option("--shard-bytes", default=None, help="At most SIZE per shard, e.g. 512MB (default when no --shard-size).")
@click.option("--chunk-size", type=int, default=ImagesSpec.chunk_size, show_default=True,
              help="At most N inputs per task (the work unit; webdataset shards are assembled from chunks: their "
                   "bytes do not depend on it; an LMDB's task records do).")
@click.option("--shuffle", is_flag=True, help="Shuffle inputs across shards before cutting.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed for --shuffle (>= 0: Python's shuffle seeds with |seed|, so -1 would be seed 1's order).")
@click.option("--verify", type=click.Choice(["decode", "header", "none"]), default="decode", show_default=True,
              help="How hard each image is checked before it is packed.")
@click.option("--normalize", is_flag=True, help="Re-encode non-conforming images as baseline 4:2:0 RGB JPEG.")
@click.option("--quality", type=int, default=90, show_default=True, help="JPEG quality of --normalize output.")
@click.option("--max-side", type=int, default=None, help="With --normalize: downscale so the longer side <= N.")
@click.option("--dedup", is_flag=True, help="Drop exact duplicates (same content), keeping the first.")
@click.option("--sample-json/--no-sample-json", default=True, show_default=True,
              help="Write a .json member per sample (source path, class, size, carried metadata). Each tar member "
                   "costs a 512-byte header plus padding to 512: --no-sample-json saves 1 KB or more per sample, "
                   "for tiny samples (see docs/images.md 'Tiny samples'). --append keeps the dataset's choice.")
@click.option("--max-pixels", type=int, default=178_956_970, show_default=True,
              help="Quarantine images declaring more pixels (decompression bombs).")
@click.option("--max-file-size", default="256MiB", show_default=True,
              help="Quarantine input files larger than SIZE, from their size (never read).")
@source_options
@engine_options
def images(source, out, to, list_file, source_format, image_field, label_field, append, shard_size, shard_bytes, chunk_size, shuffle, seed, verify, no_follow, normalize,
           quality, max_side, dedup, sample_json, max_pixels, max_file_size, allow_outside, **kwargs):
    """Pack an ImageFolder tree (or a list file) SOURCE into shards under OUT."""
    options = split_engine_options(kwargs)
    if is_remote(out) and to == "lmdb":
        raise UsageError("--to lmdb writes one local database file: OUT must be a local folder, not "
                         f"{out!r} (write it locally, or use --to webdataset for object storage)")
    spec = ImagesSpec(source=location(source), out=location(out), to=to, list_file=list_file,
                      shard_size=shard_size, shard_bytes=parse_size(shard_bytes), chunk_size=chunk_size,
                      shuffle=shuffle, seed=seed, verify=verify, follow_symlinks=not no_follow,
                      allow_outside_source=allow_outside, max_file_size=parse_size(max_file_size),
                      normalize=normalize, quality=quality, max_side=max_side, dedup=dedup, sample_json=sample_json, max_pixels=max_pixels,
                      source_format=source_format, image_field=image_field, label_field=label_field)
    if append:
        from repack.commands.versions import run_append

        run_append(spec, options)
        return
    with walked_ahead(spec):  # the folder walk starts before the job's modules are imported
        from repack.jobs.images import ImagesJob

        run_job(ImagesJob(spec), options)


def walked_ahead(spec: ImagesSpec):
    """The walk of a folder SOURCE started now, for the job's scan to take (``repack.sources.walk.walk_ahead``),
    in forked children that leave no thread in this process: the processes forked next (the local pool,
    ``--executor ray``'s driver pool) still fork rather than start through a forkserver. Not for ``--append``:
    its critical path is the child that reads the dataset's record, forked after the append's imports,
    which the walk's 16 processes slow down (1M tiny files + 1%, 16 cores, 4 alternated rounds on two machines:
    1.38-1.86 s without the walk ahead, 1.53-1.81 s with it; docs/benchmarks.md, stop 44)."""
    if not spec.walks_folder():
        return contextlib.nullcontext()
    from repack.exec.cpus import available_cpus
    from repack.sources.walk import walk_ahead

    return walk_ahead(spec.source, spec.confinement(), available_cpus())
