"""The `repack` command's entry point: SIGINT and SIGTERM are answered from the first instant, while the
command's modules are still being imported (a Ctrl-C there printed a KeyboardInterrupt traceback); ``repack.cli``
installs the handlers that stop a running job once it is imported."""

from __future__ import annotations

import os
import signal
import sys

EARLY_EXIT = {signal.SIGINT: ("SIGINT", 130), signal.SIGTERM: ("SIGTERM", 143)}


def _before_start(signum: int, _frame) -> None:
    name, code = EARLY_EXIT[signum]
    sys.stderr.write(f"repack: interrupted by {name} while starting; nothing was done\n")
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    """Answer signals at once, then import and run the command line (``repack.cli.main``)."""
    for signum in EARLY_EXIT:  # a signal ignored when repack started (nohup, `&` in a script) stays so
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _before_start)
    from repack.cli import main as run

    run()


if __name__ == "__main__":
    main()
