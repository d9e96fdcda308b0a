"""python -m rollout_server --config deploy/configs/cpu.toml [--section.key=value ...]"""

from __future__ import annotations

import sys
from typing import NoReturn

from shared import quick_exit
from shared.cli import parse_cli
from shared.config import ConfigError, check_exposure

DESCRIPTION = (
    "tandem rollout server: samples G completions per prompt with vLLM (or HF), scores them with the "
    "verifier, queues scored groups for the learner (pull/lease/ack over HTTP), and hot-loads the LoRA "
    "adapters the learner publishes, one new engine name per version."
)


def main(argv: list[str] | None = None) -> int:
    _, cfg = parse_cli("python -m rollout_server", DESCRIPTION, argv, lambda p: None, check=check_exposure)
    try:
        check_exposure(cfg)  # before anything heavy: an open server never starts
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    from rollout_server.serving.serve import serve  # heavy imports only after the config is known to be good

    return serve(cfg)


def run() -> NoReturn:
    """The entry point (`python -m`, and the `tandem-server` console script): main() ending through
    shared/quick_exit.py, without the interpreter's teardown."""
    quick_exit.arm()
    quick_exit.exit(main())


if __name__ == "__main__":  # vLLM's engine spawns processes: this guard is required
    run()
