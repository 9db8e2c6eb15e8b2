"""Leave the process with a given status, exit handlers run, and nothing after.

A process that read a Delta table through ``deltalake``'s pyarrow dataset can
abort while the interpreter finalizes ("terminate called without an active
exception", exit status 134; delta-rs#2184: C++ thread pools torn down while
deltalake's Python filesystem handler is still registered with them), after
all of its work is done. :func:`leave` runs the registered exit handlers (the
user's among them), flushes the standard streams, and ends the process with
``os._exit``, so that the status is the one the program chose.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


def leave(status: int) -> NoReturn:
    """Run the exit handlers, flush stdout and stderr, and exit with ``status``."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)
