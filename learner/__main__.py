"""python -m learner --config deploy/configs/cpu.toml [--resume] [--section.key=value ...]

Several processes: `deepspeed --num_gpus N -m learner ...` or `torchrun --nproc-per-node N -m learner ...`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from shared import quick_exit
from shared.cli import check_trackers, parse_cli
from shared.config import TandemConfig, check_server_urls

DESCRIPTION = (
    "tandem learner: pulls scored groups from the rollout server, takes GRPO steps on a LoRA adapter "
    "with DeepSpeed ZeRO-2, and publishes each new adapter version back to the server."
)


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in learner.out_dir"
    )
    # Appended by the deepspeed launcher; LOCAL_RANK is read from the environment.
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)


def _check(cfg: TandemConfig) -> None:
    """What --check-config checks for the learner besides the task (ConfigError: one line)."""
    check_trackers(cfg)
    check_server_urls(cfg)


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_cli("python -m learner", DESCRIPTION, argv, _args, check=_check)
    from learner.process import Stop

    stop = Stop()  # before the heavy imports: a SIGTERM from here on is a clean stop (exit 0)
    from learner.checkpoint import CheckpointError, check_out_dir
    from learner.client import ServerError
    from shared.config import ConfigError, check_batch_size
    from shared.models import ModelError, resolve_model

    try:
        check_batch_size(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        _check(cfg)
        if int(os.environ.get("RANK", "0")) == 0:
            check_out_dir(Path(cfg.learner.out_dir), args.resume, cfg.learner.min_free_mb)
        model_path = resolve_model(cfg.model.name)
        from learner.train import run  # torch, transformers, deepspeed: only once the config is good

        if stop.requested:
            print("[learner] stopped before the run began: nothing to save", flush=True)
            return 0
        return run(cfg, model_path, args.resume, stop)
    except (ConfigError, ModelError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 3


def run() -> NoReturn:
    """The entry point (`python -m`, and the `tandem-learner` console script): main() ending through
    shared/quick_exit.py, without the interpreter's teardown."""
    quick_exit.arm()
    quick_exit.exit(main())


if __name__ == "__main__":
    run()
