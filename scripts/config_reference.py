"""docs/configuration.md, the reference of every config field, generated from the fields' own descriptions.

.venv/bin/python scripts/config_reference.py           # rewrite docs/configuration.md
.venv/bin/python scripts/config_reference.py --check   # exit 1 if it is out of date (the suite checks)
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from shared.config import TandemConfig

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "configuration.md"

HEADER = """# Configuration reference

Generated from the fields' descriptions (`shared/config.py`, `task_config.py`, `process_config.py`) by
`scripts/config_reference.py`; do not edit by hand (the test suite fails when this page and the code differ).

A config is a TOML file with one table per section below (`[server.vllm]` for a nested one); every field
can also be set on either process's command line as `--section.key=value` (a TOML value: `--lora.r=8`,
`--reward.functions='["gsm8k"]'`), overriding the file. Both processes read the same file; each uses its
sections and checks all of them. `--check-config` prints the resolved config and exits. The shipped
configs are in `deploy/configs/`.
"""


def _type(annotation: typing.Any) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = text or str(annotation).replace("typing.", "")
    return text.replace("NoneType", "None").replace("Literal", "one of ").replace(" | ", " or ")


def _default(value: typing.Any) -> str:
    if isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value)}`" if value is not None else "unset"


def render() -> str:
    out = [HEADER]

    def section(model: type[BaseModel], path: str) -> None:
        fields, nested = [], []
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                nested.append((ann, f"{path}.{name}" if path else name))
            else:
                fields.append((name, f))
        if path:
            out.append(f"\n## `[{path}]`\n")
            if model.__doc__ and model.__doc__ is not BaseModel.__doc__:
                out.append(" ".join(model.__doc__.split()) + "\n")
            out.append("| field | type | default | meaning |\n|---|---|---|---|")
            for name, f in fields:
                meaning = " ".join(f.description.split()).replace("|", "\\|")
                out.append(f"| `{name}` | {_type(f.annotation)} | {_default(f.default)} | {meaning} |")
        for sub, sub_path in nested:
            section(sub, sub_path)

    section(TandemConfig, "")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only check that docs/configuration.md is current")
    args = p.parse_args()
    text = render()
    if args.check:
        if DOC.read_text() != text:
            print(f"{DOC} is out of date: run .venv/bin/python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
