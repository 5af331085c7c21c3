"""What every job command shares: the engine options, turning them into EngineOptions, running a
job through the engine and printing its summary."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from repack.commands.help import JobCommand
from repack.config import EngineOptions

# Sections of the options every job command shares (source_options, engine_options); the other
# engine options are "running".
SHARED_SECTIONS = {"input": ("no_follow", "allow_outside"), "checking": ("strict",)}


def job_command(name: str, **sections: tuple[str, ...]):
    """``click.command`` for a job: its options listed by section (input, output, checking; the rest
    and the engine options: running) and the exit codes at the end of --help."""
    for section, names in SHARED_SECTIONS.items():
        sections[section] = tuple(sections.get(section, ())) + names
    return click.command(name, cls=JobCommand, sections=sections)


class LogMode:
    """How this process reports to its log: ``json`` once a command was given --log-json (or its
    variable), so that ``repack.cli`` prints even an error as a JSON line."""

    json = False


class ProcessEnd:
    """``quick``: set by a command that leaves nothing for the interpreter's exit to do (no pool, thread
    to join, temporary file or child it must wait for; `repack verify`): ``repack.cli.main`` then ends
    the process with ``os._exit`` once the output is flushed, without the teardown of numpy and the
    other modules (~50-130 ms of wall at the very end on the 2-core VM).

    ``after_exit_handlers``: set by a job command that ran on Ray, and by ``--append`` and ``remove``, once
    they return (shards, indexes and manifest written and closed, the summary printed): ``repack.cli.main``
    then joins the threads and runs the atexit handlers as the interpreter's exit does, and ends with
    ``os._exit`` without the teardown of the modules (Ray's, numpy's)."""

    quick = False
    after_exit_handlers = False


def _remember_log_json(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        LogMode.json = True
    return value


STRICT_HELP = ("When any input was quarantined{also}: exit 6 and publish no manifest.json, so OUT is not a "
               "dataset; the shards stay, the would-be manifest is OUT/.repack/strict-manifest.json; a re-run "
               "without --strict publishes it.")


def engine_options(fn=None, *, strict_also: str = ""):
    """Options shared by every job command: how it runs, never what it outputs (``strict_also``: what
    else this command's --strict refuses, said in its help)."""
    if fn is None:
        return lambda f: engine_options(f, strict_also=strict_also)
    decorators = [
        click.option("--workers", type=int, default=None, help="Parallel workers (default: the usable CPUs)."),
        click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                     help="Where tasks run: a process pool on this machine, or a Ray cluster."),
        click.option("--ray-address", default=None, help="Ray cluster address (default: start or join a local one)."),
        click.option("--ray-driver-cpus", type=int, default=None, metavar="N",
                     help="Ray: CPUs of the driver's node that run tasks in a local process pool, held from Ray "
                          "for the job (default: as many as Ray has free there, at most --workers; 0: every task "
                          "is a Ray task)."),
        click.option("--retries", type=int, default=2, show_default=True, help="Retries of a failing task."),
        click.option("--num-nodes", type=int, default=1, show_default=True, help="Static partitions: total nodes."),
        click.option("--node-rank", type=int, default=0, show_default=True, help="Static partitions: this node."),
        click.option("--overwrite", is_flag=True,
                     help="Replace the job or dataset in OUT (run with other options or another command), or pack "
                          "into a folder that is not empty and holds no repack job."),
        click.option("--strict", is_flag=True, help=STRICT_HELP.format(also=strict_also)),
        click.option("--quiet", "-q", is_flag=True,
                     help="No progress bar, no progress lines (the summary stays; with --json only the JSON)."),
        click.option("--json", "json_summary", is_flag=True, help="Print a machine-readable summary on stdout."),
        click.option("--progress-every", type=float, default=30.0, show_default=True, metavar="SECONDS",
                     help="When stderr is not a terminal (a batch job): one progress line every SECONDS "
                          "(done/total, rate, ETA, quarantined so far)."),
        click.option("--log-json", is_flag=True, is_eager=True, callback=_remember_log_json,
                     help="Progress lines, the final summary and any error as JSON lines on stderr (for log "
                          "collectors)."),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


class _Location(click.ParamType):
    """A SOURCE, OUT, DEST or URL argument: any string but an empty one (an unset shell variable, ``"$OUT"``, was
    taken for the current folder: a job wrote its shards there, a gc or remove worked on it)."""

    name = "path"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail(f"{value!r} is empty (an unset shell variable?): name a folder, a file or an s3:// URL",
                      param, ctx)
        return value


LOCATION = _Location()


def location(path_or_url: str) -> str:
    """A job's SOURCE/OUT as the spec holds it: an s3:// URL as given, a local path made absolute."""
    from repack.store import is_remote

    return path_or_url if is_remote(path_or_url) else str(Path(path_or_url).absolute())


def source_options(fn):
    """What every job command may read (the confinement rules of ``repack.sources.confine``)."""
    fn = click.option("--allow-outside-source", "allow_outside", is_flag=True,
                      help="Read symlink targets (and list-file paths) outside the source root "
                           "(default: quarantined as 'symlink leaves the source root').")(fn)
    return click.option("--no-follow-symlinks", "no_follow", is_flag=True,
                        help="Quarantine every symlink instead of following it inside the source root.")(fn)


def split_engine_options(kwargs: dict) -> EngineOptions:
    """Pop the engine options out of a command's kwargs."""
    names = ("workers", "executor", "ray_address", "ray_driver_cpus", "retries", "num_nodes", "node_rank", "overwrite", "strict",
             "quiet", "json_summary", "progress_every", "log_json")
    values = {n: kwargs.pop(n) for n in names}
    return EngineOptions(**values, command=shlex.join(sys.argv))


def run_job(job, options: EngineOptions) -> None:
    """Run a job through the engine and print its summary."""
    from repack.jobs.engine import Engine

    result = Engine(job, options).run()
    report(job, options, result)
    if options.executor == "ray":  # every output is closed and published: skip the teardown of Ray's modules
        ProcessEnd.after_exit_handlers = True
        _leave_ray_at_exit()


def _leave_ray_at_exit() -> None:
    """A job that joined a running cluster leaves it by exiting, without ``ray.shutdown`` (~0.27 s, its core
    worker's threads joined in timed waits): the cluster marks the job finished when the driver's connection
    drops, as on a shutdown (the GCS's job table: dead, with its end time, alike). A local instance started
    for the job was shut down by the executor already (it owns the instance's processes)."""
    import atexit

    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", bool)():
        atexit.unregister(ray.shutdown)


def report(job, options: EngineOptions, result) -> None:
    if result.manifest is None:
        message = (f"partition {options.node_rank} of {options.num_nodes}: {result.ran} task(s) run, "
                   f"{result.skipped} already done; run `repack merge {job.store.url}` once every node has finished")
        summary = {"partition": options.node_rank, "num_nodes": options.num_nodes, "ran": result.ran,
                   "skipped": result.skipped}
    else:
        head = ("nothing to do: the job in OUT is complete" if result.nothing_to_do
                else f"done in {result.seconds:.1f} s ({result.ran} task(s) run, {result.skipped} resumed)")
        message = "\n".join([head] + job.summary_lines(result.manifest) + [f"manifest: {job.store.url}/manifest.json"])
        summary = {"out": job.store.url, "ran": result.ran, "skipped": result.skipped,
                   "nothing_to_do": result.nothing_to_do, "seconds": round(result.seconds, 3),
                   "totals": result.manifest["totals"], "quarantine": result.manifest["quarantine"]}
    say_summary(message, summary, options, job.name)


def say_summary(message: str, summary: dict, options: EngineOptions, job: str, always: bool = False) -> None:
    """The end of every job command (a run, --append, remove): the JSON summary on stdout with --json;
    the human ``message`` (on stderr when stdout carries JSON), or a JSON line with --log-json. --quiet
    (which stops progress output) drops the human message only beside --json, unless ``always``."""
    if options.json_summary:
        click.echo(json.dumps(summary, sort_keys=True))
    if options.log_json:
        click.echo(json.dumps({"event": "summary", "job": job, **summary}, sort_keys=True), err=True)
    elif always or not (options.quiet and options.json_summary):
        click.echo(message, err=options.json_summary)
