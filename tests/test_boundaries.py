"""STYLE.md §1: rollout_server and learner never import each other; shared imports neither nor any heavy
stack at module level; vllm is imported in one module and deepspeed in one module."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _files(pkg: str):
    return sorted((REPO / pkg).rglob("*.py"))


def test_server_and_learner_do_not_import_each_other():
    for f in _files("rollout_server"):
        assert "learner" not in _imports(f), f
    for f in _files("learner"):
        assert "rollout_server" not in _imports(f), f


def test_shared_is_light_at_import():
    for f in _files("shared"):
        heavy = _top_level_imports(f) & {
            "torch",
            "vllm",
            "deepspeed",
            "fastapi",
            "transformers",
            "learner",
            "rollout_server",
        }
        assert not heavy, (f, heavy)


def test_one_module_imports_each_engine():
    users = {
        engine: sorted(
            str(f.relative_to(REPO))
            for pkg in ("shared", "rollout_server", "learner")
            for f in _files(pkg)
            if engine in _imports(f)
        )
        for engine in ("vllm", "deepspeed")
    }
    assert users == {"vllm": ["rollout_server/engines/vllm.py"], "deepspeed": ["learner/engine.py"]}


def _module_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports, at any level (function-local imports too)."""
    mods = {
        ".".join(f.relative_to(REPO).with_suffix("").parts): f
        for pkg in ("shared", "rollout_server", "learner")
        for f in _files(pkg)
    }
    graph = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in mods and t != name}
        graph[name] = deps
    return graph


def test_no_import_cycles():
    graph, state, path = _module_graph(), {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycle = path[path.index(d) :] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    app = "rollout_server.serving.app"
    assert app in graph and graph[app]  # the graph is really built


# The rollout server's wings, and the other wings each may import (tool_calls.py, the tool-call format, sits
# beside them for all): engines sample and score, production makes groups with an engine, environments
# from outside tandem play on production's formats, serving puts them all on HTTP.
WINGS = {
    "engines": set(),
    "production": {"engines"},
    "environments": {"engines", "production"},
    "serving": {"engines", "production", "environments"},
}


def test_each_wing_of_the_rollout_server_imports_only_the_wings_below_it():
    graph = _module_graph()
    wing = lambda m: m.split(".")[1] if m.startswith("rollout_server.") else None  # noqa: E731
    modules = [m for m in graph if m.startswith("rollout_server.")]
    assert {wing(m) for m in modules} >= set(WINGS)  # every wing exists
    for m in modules:
        if wing(m) not in WINGS:  # the package root: __main__, tool_calls
            assert m in ("rollout_server.__init__", "rollout_server.__main__", "rollout_server.tool_calls"), m
            continue
        for d in graph[m]:
            if wing(d) in WINGS and wing(d) != wing(m):
                assert wing(d) in WINGS[wing(m)], f"{m} imports {d}: {wing(m)} never imports {wing(d)}"


def test_the_product_imports_no_test_or_script_support():
    """harness/ (starting processes, free ports, made-up adapters), tests/ and scripts/ serve the product;
    it never imports them (a product module needing one of them has a test's concern in it)."""
    for pkg in ("shared", "rollout_server", "learner"):
        for f in _files(pkg):
            support = _imports(f) & {"harness", "tests", "scripts"}
            assert not support, (str(f.relative_to(REPO)), support)


def test_the_learners_step_math_never_reaches_its_servers():
    """The step's math (and the batch it trains on) reaches no HTTP module, directly or through another:
    the conversation with the servers is learner/servers.py's, and the loop joins the two."""
    graph = _module_graph()
    http = {"learner.servers", "learner.client", "learner.pool"}
    for start in ("learner.step", "learner.grpo", "learner.batch", "learner.pulled", "learner.engine"):
        seen, todo = set(), [start]
        while todo:
            for d in graph[todo.pop()] - seen:
                seen.add(d)
                todo.append(d)
        assert not seen & http, (start, sorted(seen & http))
