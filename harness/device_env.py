"""Run a module as it would run on a smaller GPU: `python -m harness.device_env MODULE ARGS` runs
`python -m MODULE ARGS` with the process's CUDA allocations capped at $TANDEM_CUDA_CAP_MIB (PyTorch's
per-process memory fraction), so that a run on a large GPU fails where it would on a small one. The variable
is removed from the environment first: processes it starts are not capped twice. Without it, or without
CUDA, the module runs as it would."""

from __future__ import annotations

import os
import runpy
import sys

CAP_ENV = "TANDEM_CUDA_CAP_MIB"


def cap_cuda_memory(mib: float) -> float | None:
    """Caps this process's CUDA allocations at `mib`; returns the fraction set, None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, mib * 2**20 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return fraction


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m harness.device_env MODULE [ARGS...]")
    cap = os.environ.pop(CAP_ENV, None)
    if cap:
        fraction = cap_cuda_memory(float(cap))
        print(
            f"[device_env] CUDA allocations capped at {float(cap):.0f} MiB (fraction {fraction})", flush=True
        )
    sys.argv = argv
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
