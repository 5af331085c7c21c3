"""The `repack merge` command: the manifest of a job run as static partitions."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from repack.commands.options import report
from repack.config import EngineOptions


@click.command("merge")
@click.argument("out")
@click.option("--quiet", "-q", is_flag=True, help="With --json: no summary on stderr.")
@click.option("--json", "json_summary", is_flag=True, help="Print a machine-readable summary on stdout.")
def merge(out, quiet, json_summary):
    """Write the manifest of a job run as static partitions (--num-nodes/--node-rank), once all finished.

    Runs no task: it checks that every planned task of every partition finished, then writes
    OUT/manifest.json. Exit codes: 0 done, 2 no job in OUT, 4 tasks missing (listed).
    """
    from repack.jobs import engine

    options = EngineOptions(quiet=quiet, json_summary=json_summary, command=shlex.join(sys.argv))
    result = engine.merge(Path(out).absolute(), options)
    job = engine.load_job(result.manifest["modality"], json.dumps(
        json.loads((Path(out) / ".repack" / "job.json").read_text())["spec"]))
    report(job, options, result)
