"""``python -m repack`` (and the ``repack`` program: ``run``). ``verify`` starts hashing its dataset's
tars before the command line's imports (``repack.lifecycle.verify_ahead``) and, once it has printed its
answer, leaves without the interpreter's teardown of numpy and the pool modules (~40 ms of one core at
the very end) and without joining its pool's idle workers (they die with it: PR_SET_PDEATHSIG)."""

import os
import sys


def run() -> None:
    """The ``repack`` command line."""
    if sys.argv[1:2] != ["verify"]:
        from repack.cli import main

        main()
        return
    from repack.lifecycle.verify_ahead import start_verify_hashing

    start_verify_hashing(sys.argv[2:])
    checks = sys.modules.get("repack.lifecycle.verify_shards")  # imported when the checks started ahead
    if checks is not None:
        checks.LEAVE_WORKERS = True  # their exits are not waited for: they die with this process
    from repack.cli import main

    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    if checks is not None:
        checks.stop_ahead(wait=False)  # never taken over (the command failed first): they die with us
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
