"""The `repack bench` command.

The one deliberate place where the CLI reaches the consumer package (``pipelines.bench``):
users want one command. The import happens inside the command, so `repack --help` loads
neither torch nor DALI.
"""

from __future__ import annotations

import json
import sys

import click

from repack.errors import UsageError
from repack.commands.options import LOCATION


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{name} takes comma-separated integers, not {text!r}") from None
    if not values:
        raise UsageError(f"{name} needs at least one value")
    return values


@click.command("bench")
@click.argument("out", type=LOCATION)
@click.option("--source", default=None, help="Also measure the original small-file layout (an image folder tree).")
@click.option("--steps", type=int, default=50, show_default=True, help="Measured steps per setting.")
@click.option("--warmup", type=int, default=5, show_default=True, help="Unmeasured steps first (workers start).")
@click.option("--rounds", type=int, default=3, show_default=True,
              help="Rounds over every setting, in alternating order; each row is the median round, with the "
                   "spread of the rounds (a warning when they disagree, or when the machine was busy).")
@click.option("--loader-workers", "loader_workers", default=None,
              help="DataLoader num_workers to sweep, a comma-separated list (jobs' --workers is one number; "
                   "default: 0,2,4,8,... up to the usable CPUs).")
@click.option("--workers", "legacy_workers", default=None, hidden=True, help="Old name of --loader-workers.")
@click.option("--threads", default=None, help="DALI num_threads to sweep (default: 2,4,8,... up to the usable CPUs).")
@click.option("--batch-size", default="64", show_default=True, help="Batch size(s) to sweep, e.g. 32,64.")
@click.option("--pin-memory/--no-pin-memory", default=None, help="DataLoader pin_memory (default: when CUDA is up).")
@click.option("--persistent-workers/--no-persistent-workers", default=True, show_default=True,
              help="Keep DataLoader workers across epochs (off: each epoch's worker start-up is measured as wait).")
@click.option("--prefetch-factor", type=int, default=2, show_default=True,
              help="DataLoader batches prefetched per worker; DALI prefetch_queue_depth.")
@click.option("--compute-ms", type=float, default=0.0, show_default=True,
              help="Simulated training step per batch (0: none, raw reader speed).")
@click.option("--compute-mode", type=click.Choice(["sleep", "busy"]), default="sleep", show_default=True,
              help="sleep: a GPU-bound step; busy: the step keeps one CPU core busy.")
@click.option("--reader", "readers", default="", help="Only these readers, e.g. torch or dali (default: all).")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="gpu: DALI decodes on device 0 (mixed; its CPU decode is measured too), batches are "
                   "copied to cuda:0. auto: gpu when CUDA is visible, else cpu.")
@click.option("--size", type=int, default=224, show_default=True, help="Images: decode + resize/crop to this.")
@click.option("--seq-len", type=int, default=1024, show_default=True, help="Text: tokens per sequence.")
@click.option("--clip-frames", type=int, default=8, show_default=True, help="Video: frames per clip.")
@click.option("--json", "json_out", is_flag=True, help="Print the full report as JSON on stdout.")
@click.option("--html", "html_file", default=None, metavar="FILE",
              help="Also write a self-contained HTML page plotting samples/s and wait share against workers.")
def bench(out, source, steps, warmup, rounds, loader_workers, legacy_workers, threads, batch_size, pin_memory, persistent_workers,
          prefetch_factor, compute_ms, compute_mode, readers, device, size, seq_len, clip_frames, json_out, html_file):
    """Measure how fast the bundled readers feed a training loop from the dataset in OUT.

    Each row: samples/s (the median of --rounds alternated rounds, and their spread), the time a
    step waits for data, its share of the step, and the implied upper bound on GPU utilization,
    compute / (compute + wait). A busy machine or rounds that disagree are said in a warning.
    """
    from pipelines.bench import BenchError, BenchOptions, format_table, run_bench

    if legacy_workers is not None:
        click.echo("repack bench: warning: --workers is now --loader-workers (a list of DataLoader num_workers)",
                   err=True)
        loader_workers = legacy_workers

    sweeps = {"workers": _ints(loader_workers, "--loader-workers")} if loader_workers is not None else {}
    if threads is not None:
        sweeps["threads"] = _ints(threads, "--threads")
    opts = BenchOptions(steps=steps, warmup=warmup, rounds=rounds, **sweeps, batch_sizes=_ints(batch_size, "--batch-size"),
                        pin_memory=pin_memory, persistent_workers=persistent_workers,
                        prefetch_factor=prefetch_factor, compute_ms=compute_ms, compute_mode=compute_mode,
                        readers=tuple(r.strip() for r in readers.split(",") if r.strip()), device=device,
                        size=size, seq_len=seq_len, clip_frames=clip_frames, source=source)
    progress = None if json_out else (lambda what: click.echo(f"measuring {what} ...", err=True))
    try:
        report = run_bench(out, opts, progress)
    except BenchError as exc:
        raise UsageError(str(exc)) from None
    if html_file:
        from repack.report.html import bench_page, write_page

        write_page(html_file, bench_page(report))
    if json_out:
        for warning in report["warnings"]:
            click.echo(f"repack bench: warning: {warning}", err=True)
        click.echo(json.dumps(report, sort_keys=True))
    else:
        click.echo(format_table(report))
    sys.stdout.flush()
