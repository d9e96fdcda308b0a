"""The design the code cites is in the repository: every `docs/design.md §N` names a section of
docs/design.md, every `docs/<page>.md` a code comment or page names exists, and nothing cites the spec that
lives outside the repository (a bare DESIGN.md)."""

import re
import subprocess

from tests.helpers import REPO

SECTION = re.compile(r"docs/design\.md §(\d+)")
THIS = "tests/test_design_refs.py"  # (names the outside spec, to refuse it)
PAGE = re.compile(r"\bdocs/([\w-]+\.md)\b")


def _tracked() -> dict[str, str]:
    """Text of every file git tracks (or would: untracked, not ignored), by path."""
    names = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    out = {}
    for name in names:
        path = REPO / name
        if path.is_file() and path.suffix in (".py", ".md", ".toml", ".sh", ".yml", ".txt", ""):
            out[name] = path.read_text(errors="replace")
    return out


def test_every_design_reference_resolves():
    design = (REPO / "docs" / "design.md").read_text()
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", design, re.M)}
    assert sections == set(range(1, len(sections) + 1)), sections
    files = _tracked()
    cited = {(name, int(n)) for name, text in files.items() for n in SECTION.findall(text)}
    assert len(cited) >= 15  # the code's references found (the pattern is not silently wrong)
    assert not [c for c in cited if c[1] not in sections], "a reference to a section design.md lacks"
    pages = {(name, page) for name, text in files.items() for page in PAGE.findall(text)}
    assert not [p for p in pages if not (REPO / "docs" / p[1]).is_file()], "a docs page that is not there"
    outside = [n for n, text in files.items() if re.search(r"\bDESIGN\.md", text) and n != THIS]
    assert outside == [], f"cites the design spec outside the repository: {outside}"
