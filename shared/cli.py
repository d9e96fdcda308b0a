"""The command line both entry points share: `--config X.toml`, `--section.key=value` overrides, and a
one-line `error: ...` with exit code 2 for any config problem. Imports nothing heavy."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable

from shared.config import ConfigError, TandemConfig, load_config, split_overrides

OVERRIDES_HELP = """\
Any config field can be set on the command line as --section.key=value (TOML syntax for the value),
e.g. --sampling.group_size=8 --server.port=8001. Precedence: defaults < --config file < overrides;
--check-config prints the resolved config."""


def config_fields(width: int = 100) -> str:
    """Every config field with its default and description, by section: the --help epilog."""
    import textwrap

    from pydantic import BaseModel

    lines: list[str] = []

    def walk(model: type[BaseModel], defaults: dict, prefix: str) -> None:
        for name, f in model.model_fields.items():
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                lines.append(f"[{prefix}{name}]")
                walk(f.annotation, defaults[name], f"{prefix}{name}.")
                continue
            lines.append(f"  --{prefix}{name}={json.dumps(defaults[name])}")
            if f.description:
                lines.extend(
                    textwrap.wrap(f.description, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
                )

    walk(TandemConfig, TandemConfig().model_dump(), "")
    return "\n".join(lines)


def parse_cli(
    prog: str,
    description: str,
    argv: list[str] | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    check: Callable[[TandemConfig], None] | None = None,
) -> tuple[argparse.Namespace, TandemConfig]:
    """`check`: what --check-config checks for this process besides check_task (it raises ConfigError)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=OVERRIDES_HELP
        + "\n\nConfig fields (defaults; a --config file may set others):\n"
        + config_fields(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="TOML", help="config file (see deploy/configs/)")
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="validate the config (and import the reward functions, read a custom dataset's columns), "
        "print it resolved as JSON, exit",
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
        try:
            check_task(cfg)
            if check is not None:
                check(cfg)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        print(cfg.dump())
        raise SystemExit(0)
    return args, cfg


def check_trackers(cfg: TandemConfig) -> None:
    """The learner's: the experiment trackers of learner.report_to are installed (each is an extra), a
    ConfigError if not. Not the server's to check: its image need not have them."""
    report_to = cfg.learner.report_to
    missing = [n for n in report_to if n != "tensorboard" and importlib.util.find_spec(n) is None]
    if missing:
        raise ConfigError(
            f"learner.report_to names {', '.join(missing)}, not installed: "
            f"pip install 'tandem[{','.join(missing)}]'"
        )


def check_task(cfg: TandemConfig) -> None:
    """What --check-config can check beyond the config's own fields without loading a model: that every
    reward function and the environment's functions import and take the documented arguments, and that
    a custom dataset reads and has the mapped columns. Raises ConfigError."""
    from shared.datasets import DatasetError, load_problems
    from shared.rewards import load_env, resolve

    resolve(cfg.reward)
    if cfg.env.turns:
        load_env(cfg.env)
    if cfg.env.kind == "verifiers":  # the library, its version, the environment and its tasks
        from shared import verifiers_tasks

        verifiers_tasks.load(cfg.env)
    elif cfg.data.task in ("custom", "reasoning_gym"):
        try:
            load_problems(cfg.data)
        except DatasetError as e:
            raise ConfigError(str(e)) from None
