"""shared/quick_exit.py: an entry point that ends through it keeps its exit code, its buffered output, its
threads' work and every exit handler's, and skips only the interpreter's teardown (where an object still
referenced from a module would be finalized)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

SCRIPT = """
import atexit, sys, threading, time
from shared import quick_exit

quick_exit.arm()
out = sys.argv[1]

class Torn:  # finalized only by the interpreter's teardown (it stays referenced from this module)
    def __init__(self, path):
        self.path = path

    def __del__(self, open=open):  # module globals may be gone by then
        open(self.path, "w").close()

kept = Torn(out + ".teardown")
atexit.register(lambda: open(out + ".handler", "w").close())  # a library's exit handler, registered later
threading.Thread(target=lambda: (time.sleep(0.3), open(out + ".thread", "w").close())).start()
print("buffered", end="")  # a pipe: block-buffered, not yet written
{end}
"""


@pytest.mark.parametrize("end", ["quick_exit.exit(3)", "raise SystemExit(3)"])
def test_an_exit_through_it_keeps_the_code_output_threads_and_handlers_and_skips_the_teardown(tmp_path, end):
    out = tmp_path / "mark"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(end=end), str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered"
    assert (tmp_path / "mark.thread").exists() and (tmp_path / "mark.handler").exists()
    # quick_exit.exit: the process ends before the teardown; a plain exit still tears down as usual
    assert (tmp_path / "mark.teardown").exists() == (end == "raise SystemExit(3)")


@pytest.mark.parametrize("script", ["tandem-server", "tandem-learner", "tandem-evaluate"])
def test_the_console_scripts_end_through_it_as_python_m_does(monkeypatch, script):
    """pyproject's console scripts point at the entry point that arms quick_exit and exits with main()'s
    code, the one `python -m` runs, not at main() itself (which ends through the ordinary teardown)."""
    import importlib
    import tomllib

    from shared import quick_exit

    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"][script]
    module_name, function = target.split(":")
    module = importlib.import_module(module_name)
    calls = []
    monkeypatch.setattr(module, "main", lambda: 7)
    monkeypatch.setattr(quick_exit, "arm", lambda: calls.append("arm"))
    monkeypatch.setattr(quick_exit, "exit", lambda code: calls.append(code))
    getattr(module, function)()
    assert calls == ["arm", 7]


def test_every_console_script_names_a_function_that_exists():
    import importlib
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"tandem-server", "tandem-learner", "tandem-evaluate", "tandem-preflight"} <= set(scripts)
    for target in scripts.values():
        module_name, function = target.split(":")
        assert callable(getattr(importlib.import_module(module_name), function)), target
