"""The `repack` command line: assembles the commands of ``repack.commands`` into one group.
This is the one place where exceptions become messages and exit codes."""

from __future__ import annotations

import errno
import json
import os
import signal
import sys

import click

from repack import __version__
from repack.commands.bench import bench
from repack.commands.gc import gc
from repack.commands.envvars import bind_envvars
from repack.commands.help import RepackGroup
from repack.commands.images import images
from repack.commands.merge import merge
from repack.commands.options import LogMode, ProcessEnd
from repack.commands.pull import pull
from repack.commands.remove import remove
from repack.commands.text import text
from repack.commands.verify import inspect, verify
from repack.commands.video import video
from repack.errors import (VERIFICATION_EXIT_CODE, IncompleteJobError, Interrupted, RepackError, UsageError,
                           interrupt_received, note_interrupt)


@click.group(cls=RepackGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="repack")
def cli() -> None:
    """Repack training data once, offline, into formats that keep GPUs fed."""


for _command in (images, video, text, verify, inspect, merge, pull, remove, gc, bench):
    cli.add_command(_command)
bind_envvars(cli)  # REPACK_<COMMAND>_<OPTION> for every option, shown in --help


SIGNAL_EXIT = {signal.SIGTERM: ("SIGTERM", 143), signal.SIGINT: ("SIGINT", 130)}


_HANDLER_PID = [0]  # the process that installed ``_on_signal`` (a forked child inherits the handler)


def _on_signal(signum: int, _frame) -> None:
    """SIGTERM/SIGINT: raise Interrupted (the engine stops workers and removes temps on its way out);
    a second signal gets the default behaviour (kill, KeyboardInterrupt). In a child forked before it set handlers of
    its own (a pool worker starting as the signal came to the process group) the signal ends it as the default
    action does: a raise there printed multiprocessing's traceback of the worker's start."""
    if os.getpid() != _HANDLER_PID[0]:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    raise note_interrupt(Interrupted(*SIGNAL_EXIT[signum]))  # noted: a raise inside C code may be swallowed


def fail(message: str, exit_code: int) -> None:
    """Report a failed command on stderr (``repack: error: ...``; a JSON line with --log-json) and exit."""
    if LogMode.json:
        click.echo(json.dumps({"event": "error", "exit_code": exit_code, "message": message}), err=True)
    else:
        click.echo(f"repack: error: {message}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(exit_code)


UTF8_REEXEC = "REPACK_UTF8_MODE_STARTED"  # set on the process started again in UTF-8 mode: it never starts a third


def _names_in_utf8() -> None:
    """Start this command again in Python's UTF-8 mode where the locale gives file names another encoding (a
    Latin-1 or ASCII locale): names are read, recorded and opened as UTF-8 (undecodable bytes escaped), whatever
    the locale, so one SOURCE gives one dataset on every machine."""
    encoding = sys.getfilesystemencoding()
    if encoding.replace("-", "").lower() == "utf8" or os.environ.get(UTF8_REEXEC):
        return
    argv = list(getattr(sys, "orig_argv", ()))  # the interpreter's own command line: what is started again
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None
    itself = module == "repack" or (len(argv) > 1 and os.path.basename(argv[1]) == "repack")  # console script
    if not itself:  # called from another program (a script on stdin, a wrapper): starting it again would run it twice
        raise UsageError(f"the locale gives file names the encoding {encoding}, not UTF-8, so names would be "
                         "recorded garbled: run with PYTHONUTF8=1 (or a UTF-8 locale)")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, {**os.environ, "PYTHONUTF8": "1", UTF8_REEXEC: "1"})


def main() -> None:
    """Entry point: run the CLI, turning RepackError into a one-line message and exit code."""
    from repack.manifest import ManifestError

    try:
        _names_in_utf8()
    except UsageError as exc:
        fail(str(exc), exc.exit_code)

    # repack's own processes do no BLAS work, and numpy's bundled OpenBLAS starts a thread per CPU at import,
    # which spin (on 16 CPUs ~2 CPU-s per import, beside the walk's processes): one, unless the user set it
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

    for stream in (sys.stdout, sys.stderr):  # non-UTF-8 file names must never crash a summary
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    _HANDLER_PID[0] = os.getpid()
    for signum in SIGNAL_EXIT:  # a signal ignored when repack started (`repack ... &` in a script, nohup) stays so
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _on_signal)
    ProcessEnd.quick = ProcessEnd.after_exit_handlers = False
    try:
        try:
            cli.main(standalone_mode=False)
        except BaseException as exc:  # after a signal, whatever C code made of the handler's raise (an ImportError)
            received = interrupt_received()
            if received is not None and not isinstance(exc, Interrupted):
                raise received from exc
            raise
        _end_if_interrupted()
    except SystemExit as exc:
        if not ProcessEnd.quick:
            raise
        _end_now(exc.code)
    except Interrupted as exc:  # workers stopped and temps removed on the way here
        _end_interrupted(exc)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        if not LogMode.json:
            exc.show()
            sys.exit(exc.exit_code)
        fail(exc.format_message(), exc.exit_code)
    except RepackError as exc:
        fail(str(exc), exc.exit_code)
    except ManifestError as exc:
        fail(str(exc), VERIFICATION_EXIT_CODE)
    except KeyboardInterrupt:
        click.echo("interrupted; re-run the same command to resume", err=True)
        sys.exit(130)
    except OSError as exc:  # an unexpected I/O failure of the job itself (disk full, lost mount)
        where = f": {exc.filename}" if exc.filename else ""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # no bad job: room, then the same command
            fail(f"{exc.strerror or exc}{where}: make room (or raise the limit) and re-run the same command; "
                 "nothing half-done was published", IncompleteJobError.exit_code)
        fail(f"{exc.strerror or exc}{where}", 2)
    except RuntimeError as exc:  # a pool's worker killed (the OOM killer, a signal) outside the engine's retries
        pools = sys.modules.get("concurrent.futures.process")  # imported by whatever ran a pool (not by --help)
        if pools is None or not isinstance(exc, pools.BrokenProcessPool):
            raise
        fail("a worker process died (killed by a signal or out of memory); nothing half-done was published: re-run "
             "the same command", IncompleteJobError.exit_code)
    if ProcessEnd.quick:
        _end_now(0)
    if ProcessEnd.after_exit_handlers:
        _end_after_exit_handlers()


def _end_interrupted(exc: Interrupted) -> None:
    """Say that a signal stopped the command, and exit with its code (143, 130)."""
    if LogMode.json:
        click.echo(json.dumps({"event": "error", "exit_code": exc.exit_code, "message": str(exc)}), err=True)
    else:
        click.echo(f"repack: {exc}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exc.exit_code)  # never wait at exit on a pool's helper threads that a killed worker left waiting


def _end_if_interrupted() -> None:
    """A command that ran on after its signal's raise was swallowed (``repack.errors.note_interrupt``) and got past
    every checkpoint still ends with the signal's exit code."""
    received = interrupt_received()
    if received is not None:
        _end_interrupted(received)


def _end_now(code) -> None:
    """Flush the output and end the process without the interpreter's teardown (``ProcessEnd.quick``)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        code = code or 1
    os._exit(code if isinstance(code, int) else 1)


def _end_after_exit_handlers() -> None:
    """End a finished command as the interpreter's exit would, less its module teardown
    (``ProcessEnd.after_exit_handlers``): first what ``Py_FinalizeEx`` runs before the teardown, in its
    order: ``threading._shutdown`` (joins every non-daemon thread, and runs the threads' exit hooks:
    concurrent.futures' executors finish their queued work), then the atexit handlers (Ray's driver
    shutdown, multiprocessing's children and finalizers, every ``weakref.finalize``, logging's flush);
    then the flush of stdout/stderr and ``os._exit``. Skipped: the ``__del__`` of objects still alive and
    the freeing of the modules (with Ray loaded, its gRPC and C++ core: 0.2-0.3 CPU-s, 0.3-1 s of wall on
    2 busy cores), which is why only a command whose files are all closed sets it."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None:  # another interpreter: its usual exit
        return
    shutdown()
    atexit._run_exitfuncs()  # a signal's raise inside an exit handler is printed and ignored
    _end_if_interrupted()
    _end_now(0)

if __name__ == "__main__":
    main()
