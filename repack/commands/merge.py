"""The `repack merge` command: the manifest of a job run as static partitions."""

from __future__ import annotations

import json

import click

from repack.commands.options import engine_options, location, report, split_engine_options


@click.command("merge")
@click.argument("out")
@engine_options
def merge(out, **kwargs):
    """Write the manifest of a job run as static partitions (--num-nodes/--node-rank)."""
    from repack.jobs import engine
    from repack.store import open_store

    options = split_engine_options(kwargs)
    result = engine.merge(location(out), options)
    state = engine.read_json(open_store(location(out)), ".repack/job.json")
    report(engine.load_job(result.manifest["modality"], json.dumps(state["spec"])), options, result)
