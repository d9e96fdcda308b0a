"""Files written whole or not at all."""

from __future__ import annotations

from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it and a rename: a crash or a full disk
    mid-write leaves the previous file (or none), never half of the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
