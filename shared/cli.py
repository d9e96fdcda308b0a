"""The command line both entry points share: `--config X.toml`, `--section.key=value` overrides, and a
one-line `error: ...` with exit code 2 for any config problem. Imports nothing heavy."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from shared.config import ConfigError, TandemConfig, load_config, split_overrides

OVERRIDES_HELP = (
    "Any config field can be set on the command line as --section.key=value (TOML syntax for the "
    "value), e.g. --sampling.group_size=8 --server.port=8001. Precedence: defaults < --config file < "
    "overrides. Sections: model, sampling, data, server, lora, grpo, learner, deepspeed; "
    "--check-config prints them all."
)


def parse_cli(
    prog: str,
    description: str,
    argv: list[str] | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
) -> tuple[argparse.Namespace, TandemConfig]:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=OVERRIDES_HELP)
    parser.add_argument("--config", metavar="TOML", help="config file (see deploy/configs/)")
    parser.add_argument(
        "--check-config", action="store_true", help="validate the config, print it resolved as JSON, exit"
    )
    add_arguments(parser)
    try:
        rest, overrides = split_overrides(argv)
        args = parser.parse_args(rest)
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.check_config:
        print(cfg.dump())
        raise SystemExit(0)
    return args, cfg
