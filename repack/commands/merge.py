"""The `repack merge` command: the manifest of a job run as static partitions."""

from __future__ import annotations

import json
import shlex
import sys

import click

from repack.commands.options import LOCATION, location, report
from repack.config import EngineOptions


@click.command("merge")
@click.argument("out", type=LOCATION)
@click.option("--quiet", "-q", is_flag=True, help="With --json: no summary on stderr.")
@click.option("--json", "json_summary", is_flag=True, help="Print a machine-readable summary on stdout.")
@click.option("--strict/--no-strict", default=None, help="Exit 6 and publish no manifest.json if any input was "
              "quarantined. Default: --strict when a partition was run with --strict.")
def merge(out, quiet, json_summary, strict):
    """Write the manifest of a job run as static partitions (--num-nodes/--node-rank), once all finished.

    Runs no task: it checks that every planned task of every partition finished, then writes
    OUT/manifest.json. Exit codes: 0 done, 2 no job in OUT, 3 a partition is still running (named), 4 tasks
    missing (listed), 6 --strict refused the dataset (given here or to any partition).
    """
    from repack.jobs import engine
    from repack.store import open_store

    options = EngineOptions(quiet=quiet, json_summary=json_summary, command=shlex.join(sys.argv),
                            executor="partitions")  # the manifest's run.executor: the tasks ran in the partitions
    result = engine.merge(location(out), options, strict)
    state = engine.read_json(open_store(location(out)), ".repack/job.json")
    report(engine.load_job(result.manifest["modality"], json.dumps({**state["spec"], "out": location(out)})), options,
           result)
