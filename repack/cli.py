"""The `repack` command line. Each command parses options into a spec and hands it to the
engine; this is the one place where exceptions become messages and exit codes."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from repack import __version__
from repack.config import EngineOptions, ImagesSpec, parse_size
from repack.errors import VERIFICATION_EXIT_CODE, RepackError


def engine_options(fn):
    """Options shared by every job command: how it runs, never what it outputs."""
    decorators = [
        click.option("--workers", type=int, default=None, help="Parallel workers (default: the usable CPUs)."),
        click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True),
        click.option("--ray-address", default=None, help="Ray cluster address (default: start or join a local one)."),
        click.option("--retries", type=int, default=2, show_default=True, help="Retries of a failing task."),
        click.option("--num-nodes", type=int, default=1, show_default=True, help="Static partitions: total nodes."),
        click.option("--node-rank", type=int, default=0, show_default=True, help="Static partitions: this node."),
        click.option("--overwrite", is_flag=True, help="Replace an existing job in OUT run with other options."),
        click.option("--strict", is_flag=True, help="Exit non-zero when any input was quarantined."),
        click.option("--quiet", "-q", is_flag=True, help="No progress bar."),
        click.option("--json", "json_summary", is_flag=True, help="Print a machine-readable summary on stdout."),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


def split_engine_options(kwargs: dict) -> EngineOptions:
    """Pop the engine options out of a command's kwargs."""
    names = ("workers", "executor", "ray_address", "retries", "num_nodes", "node_rank", "overwrite", "strict",
             "quiet", "json_summary")
    values = {n: kwargs.pop(n) for n in names}
    return EngineOptions(**values, command=shlex.join(sys.argv))


def run_job(job, options: EngineOptions) -> None:
    """Run a job through the engine and print its summary."""
    from repack.jobs.engine import Engine

    result = Engine(job, options).run()
    report(job, options, result)


def report(job, options: EngineOptions, result) -> None:
    if result.manifest is None:
        message = (f"partition {options.node_rank} of {options.num_nodes}: {result.ran} task(s) run, "
                   f"{result.skipped} already done; run `repack merge {job.out}` once every node has finished")
        summary = {"partition": options.node_rank, "num_nodes": options.num_nodes, "ran": result.ran,
                   "skipped": result.skipped}
    else:
        head = ("nothing to do: the job in OUT is complete" if result.nothing_to_do
                else f"done in {result.seconds:.1f} s ({result.ran} task(s) run, {result.skipped} resumed)")
        message = "\n".join([head] + job.summary_lines(result.manifest) + [f"manifest: {job.out / 'manifest.json'}"])
        summary = {"out": str(job.out), "ran": result.ran, "skipped": result.skipped,
                   "nothing_to_do": result.nothing_to_do, "seconds": round(result.seconds, 3),
                   "totals": result.manifest["totals"], "quarantine": result.manifest["quarantine"]}
    if options.json_summary:
        click.echo(json.dumps(summary, sort_keys=True))
    if not options.quiet or not options.json_summary:
        click.echo(message, err=options.json_summary)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="repack")
def cli() -> None:
    """Repack training data once, offline, into formats that keep GPUs fed."""


@cli.command()
@click.argument("source")
@click.argument("out")
@click.option("--to", "to", default="webdataset", show_default=True, help="Output format (webdataset, lmdb).")
@click.option("--list", "list_file", is_flag=True, help="SOURCE is a .csv/.tsv/.jsonl list file (path[,label]).")
@click.option("--shard-size", type=int, default=None, help="At most N inputs per shard.")
@click.option("--shard-bytes", default=None, help="At most SIZE per shard, e.g. 512MB (default when no --shard-size).")
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
def images(source, out, to, list_file, shard_size, shard_bytes, shuffle, seed, verify, no_follow, normalize,
           quality, max_side, dedup, max_pixels, **kwargs):
    """Pack an ImageFolder tree (or a list file) SOURCE into shards under OUT."""
    from repack.jobs.images import ImagesJob

    options = split_engine_options(kwargs)
    spec = ImagesSpec(source=str(Path(source).absolute()), out=str(Path(out).absolute()), to=to,
                      list_file=list_file, shard_size=shard_size, shard_bytes=parse_size(shard_bytes),
                      shuffle=shuffle, seed=seed, verify=verify, follow_symlinks=not no_follow,
                      normalize=normalize, quality=quality, max_side=max_side, dedup=dedup, max_pixels=max_pixels)
    run_job(ImagesJob(spec), options)


@cli.command()
@click.argument("out")
@click.option("--json", "json_out", is_flag=True, help="Print the result as JSON.")
def verify(out, json_out):
    """Re-read every file of the dataset in OUT and check it against its manifest."""
    from repack.jobs.verify import verify_dataset

    problems = verify_dataset(out)
    if json_out:
        click.echo(json.dumps({"ok": not problems, "problems": problems}))
    elif problems:
        click.echo(f"{out}: {len(problems)} problem(s):", err=True)
        for problem in problems:
            click.echo(f"  - {problem}", err=True)
    else:
        click.echo(f"{out}: OK, every file matches the manifest")
    if problems:
        sys.exit(VERIFICATION_EXIT_CODE)


@cli.command()
@click.argument("out")
def inspect(out):
    """Print a short human summary of the dataset in OUT."""
    from repack.jobs.verify import inspect_lines

    click.echo("\n".join(inspect_lines(out)))


@cli.command()
@click.argument("out")
@engine_options
def merge(out, **kwargs):
    """Write the manifest of a job run as static partitions (--num-nodes/--node-rank)."""
    from repack.jobs import engine

    options = split_engine_options(kwargs)
    result = engine.merge(Path(out).absolute(), options)
    job = engine.load_job(result.manifest["modality"], json.dumps(
        json.loads((Path(out) / ".repack" / "job.json").read_text())["spec"]))
    report(job, options, result)


from repack.commands_text import text as _text_command  # noqa: E402  (repack text)

cli.add_command(_text_command)
from repack.commands_video import video as _video_command  # noqa: E402  (repack video)
cli.add_command(_video_command)
from repack.commands_bench import bench as _bench_command  # noqa: E402  (repack bench)
cli.add_command(_bench_command)


def main() -> None:
    """Entry point: run the CLI, turning RepackError into a one-line message and exit code."""
    from repack.manifest import ManifestError

    for stream in (sys.stdout, sys.stderr):  # non-UTF-8 file names must never crash a summary
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except RepackError as exc:
        click.echo(f"repack: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except ManifestError as exc:
        click.echo(f"repack: error: {exc}", err=True)
        sys.exit(VERIFICATION_EXIT_CODE)
    except KeyboardInterrupt:
        click.echo("interrupted; re-run the same command to resume", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
