"""The `repack merge` command: the manifest of a job run as static partitions."""

from __future__ import annotations

import json
from pathlib import Path

import click

from repack.commands.options import engine_options, report, split_engine_options


@click.command("merge")
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
