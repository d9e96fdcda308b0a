"""Exit a process without the interpreter's teardown.

After `main()` returns, CPython joins the process's threads, runs its exit handlers, and then tears itself
down: a garbage-collection sweep of every object torch, transformers, DeepSpeed and vLLM made, ~2 s of each
2-core stop of the server and of the learner (docs/benchmarks.md §19), which nothing of ours needs. An
entry point calls `arm()` first and ends with `exit(code)`: the threads are joined and every exit handler
runs as before (the trackers' and multiprocessing's included), the streams are flushed, and the process
then ends with `code` where the teardown would begin.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import NoReturn

_code: int | None = None


def _end() -> None:
    if _code is None:  # an exit that did not come through exit() (an uncaught exception): as usual
        return
    logging.shutdown()  # registered before arm() ran, so it would run after this handler
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(_code)


def arm() -> None:
    """Register the ending before the libraries register theirs: exit handlers run last-registered
    first, so theirs run before it."""
    atexit.register(_end)


def exit(code: int) -> NoReturn:  # noqa: A001 (sys.exit's name, on purpose)
    """sys.exit(code), ending the process once the exit handlers have run (after arm())."""
    global _code
    _code = code
    sys.exit(code)
