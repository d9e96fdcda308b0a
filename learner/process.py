"""The learner as a process: stop signals, compute threads, how freed memory is kept, and the crash points
the fault tests kill it at. Imports nothing heavy at module level: the stop handler is installed before
torch and DeepSpeed are imported (learner/__main__.py)."""

from __future__ import annotations

import ctypes
import os
import signal
import time


def crash_point(name: str, step: int) -> None:
    """Fault tests: `TANDEM_CRASH_AT=<name>:<step>` SIGKILLs this process at that point of that step,
    so a test can kill the learner exactly between two effects (checkpoint, ack, publish)."""
    if os.environ.get("TANDEM_CRASH_AT") == f"{name}:{step}":
        print(f"[learner] TANDEM_CRASH_AT={name}:{step}: SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class Stop:
    """SIGTERM/SIGINT: finish the step in progress, checkpoint, exit 0. Another signal more than
    `same_stop_s` later aborts the step; one sooner is the same stop delivered twice (SLURM signals every
    process of a job step, the learner's wrapper forwards it too; Ctrl-C reaches the whole process group),
    which must not cost the step."""

    same_stop_s = 2.0

    def __init__(self, clock=time.monotonic):
        self.requested, self._at, self._clock = False, 0.0, clock
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:
            if self._clock() - self._at <= self.same_stop_s:
                return
            raise KeyboardInterrupt(f"{name} while stopping: the step in progress is abandoned")
        self.requested, self._at = True, self._clock()
        print(
            f"[learner] {name}: finishing this step, then checkpoint and exit (another signal, more than "
            f"{self.same_stop_s:.0f} s from now, abandons the step)",
            flush=True,
        )


def pin_threads(n: int | None, log) -> None:
    """learner.threads: compute on n threads, pinned to the last n cores this process may use (a server
    on the same machine takes the first ones, server.vllm.cpu_threads)."""
    if n is None:
        return
    import torch

    cores = sorted(os.sched_getaffinity(0))
    mine = cores[-n:]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    log(f"computing on {len(mine)} thread(s), cores {','.join(map(str, mine))} (learner.threads)")


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(log) -> bool:
    """CPU: keep the memory torch frees inside the process. There torch allocates every micro-batch's
    activations anew with malloc, and glibc gives large freed blocks straight back to the OS (mmap'd
    blocks, the heap's top beyond 128 KiB), so the next micro-batch faults every page in again: some 0.7M
    page faults per step of the CPU benchmark, handled one at a time while the compute threads wait
    (docs/benchmarks.md §3). No mmap'd blocks and no trimming: the footprint stays at its peak, which each
    step reaches anyway. False (nothing changed) where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, 2**31 - 1) != 1:
        return False
    log("freed memory is kept in the process, not returned to the OS (saves re-faulting it each step)")
    return True
