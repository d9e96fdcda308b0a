"""env.kind = "verifiers": an environment of the `verifiers` library (its v1 API: a taskset of tasks, the
agents' seats, each played by a harness program on a runtime), loaded from env.verifiers, and its tasks as
tandem's problems. What plays the episodes on tandem's engine is
rollout_server/environments/verifiers_runner.py.

The library is optional (`pip install 'tandem[verifiers]'`) and moves fast: SUPPORTED is the range tandem
is tested on, checked at start and by --check-config. A seat that names no harness gets the library's
`null` harness (a chat loop with the task's tools) and one that names no runtime the `subprocess` runtime
(the harness program runs on this machine): the library's own defaults (the `bash` harness, the `prime`
runtime) need a sandbox or a hosted login."""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any

from shared.config import ConfigError, EnvConfig
from shared.datasets import Problem

SUPPORTED = ">=0.4.0,<0.5"  # the `verifiers.v1` API as tandem calls it (keep in step with pyproject)


def import_verifiers():
    """The library's v1 API, or a ConfigError naming what to install."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    try:
        version = metadata.version("verifiers")
    except metadata.PackageNotFoundError:
        raise ConfigError(
            "env.kind = 'verifiers' needs the verifiers library: pip install 'tandem[verifiers]'"
        ) from None
    if version not in SpecifierSet(SUPPORTED):
        raise ConfigError(
            f"env.kind = 'verifiers': verifiers {version} is installed, tandem supports {SUPPORTED} "
            "(pip install 'tandem[verifiers]')"
        )
    import verifiers.v1 as vf

    return vf


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def env_config(cfg: EnvConfig):
    """The library's EnvConfig from env.verifiers, with tandem's defaults for each seat that sets none."""
    import_verifiers()
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import default_harness_id, resolve_env_config

    raw: dict[str, Any] = json.loads(json.dumps(cfg.verifiers))  # a copy, as plain JSON
    taskset = raw["taskset"]["id"]
    try:
        resolved = resolve_env_config(raw)
        bundled = default_harness_id(taskset) != "bash"  # the taskset ships its own harness
        for name, seat in agent_config_fields(resolved).items():
            given = raw.get(name) if isinstance(raw.get(name), dict) else {}
            patch = {}
            if seat.harness is None and not bundled:
                patch["harness"] = {"id": "null"}
            if "runtime" not in given and getattr(seat.runtime, "type", None) == "prime":
                patch["runtime"] = {"type": "subprocess"}
            if patch:
                raw[name] = {**given, **patch}
        return resolve_env_config(raw)
    except Exception as e:  # noqa: BLE001 - whatever the library raises becomes one line naming the field
        msg = f"env.verifiers: the environment of taskset '{taskset}' cannot be loaded: {_one_line(e)}"
        raise ConfigError(msg) from None


BRIDGE = "rollout_server.environments.verifiers_renderer.BridgeRenderer"  # env.renderer = "bridge"


def renderer_config(cfg: EnvConfig):
    """env.renderer as the library's RendererConfig for its training client (None: "auto", the library
    chooses). A name of the `renderers` library wins over an import path of the same spelling ("qwen3.5").
    Raises ConfigError naming the field."""
    import_verifiers()
    if cfg.renderer == "auto":
        return None
    from pydantic import TypeAdapter, ValidationError
    from renderers import RendererConfig

    adapter = TypeAdapter(RendererConfig)
    if cfg.renderer == "bridge":
        return adapter.validate_python({"name": "custom", "import_path": BRIDGE})
    try:
        return adapter.validate_python({"name": cfg.renderer})
    except ValidationError as e:  # not a name: an import path, or one line saying what it could be
        if not any(c in cfg.renderer for c in ".:/"):
            names = next(
                (x["ctx"]["expected_tags"] for x in e.errors() if "expected_tags" in x.get("ctx", {})), ""
            )
            msg = f"env.renderer = '{cfg.renderer}': not 'bridge', 'auto', a renderer's name ({names}) or a "
            raise ConfigError(msg + "renderer class ('module.Class' / 'path/to/file.py:Class')") from None
    try:
        return adapter.validate_python({"name": "custom", "import_path": cfg.renderer})
    except Exception as e:  # noqa: BLE001 - the library's reason, on one line
        msg = f"env.renderer = '{cfg.renderer}': not a renderer's name, nor an importable renderer class: "
        raise ConfigError(msg + _one_line(e)) from None


@functools.lru_cache(maxsize=1)
def _load(key: str):
    cfg = EnvConfig.model_validate_json(key)
    renderer_config(cfg)
    config = env_config(cfg)
    from verifiers.v1.utils.loaders import load_environment

    taskset = config.taskset.id
    try:
        env = load_environment(config)
        tasks = list(env.taskset.take(cfg.verifiers_limit))
    except Exception as e:  # noqa: BLE001 - as above
        raise ConfigError(f"env.verifiers: taskset '{taskset}' cannot be loaded: {_one_line(e)}") from None
    if not tasks:
        raise ConfigError(f"env.verifiers: taskset '{taskset}' has no tasks")
    return env, tasks


def load(cfg: EnvConfig):
    """(the library's Env, its tasks): built once per process for one config (the server's problems and
    its runner share them). Raises ConfigError with one line naming what is wrong."""
    return _load(cfg.model_dump_json())


KEY_VAR = "TANDEM_VERIFIERS_KEY"  # the variable the library's clients read the server's token from


def prepare_process(token: str | None) -> str:
    """This process ready to run the library's episodes against a tandem server: the server's bearer token
    (None: it has none) in KEY_VAR, whose name is returned for the library's client config; this
    environment's bin folder on PATH, for the `uv` the subprocess runtime prepares harness programs with;
    and PYTHONPATH's folders absolute, for the tool servers that runtime starts in folders of its own
    (`python -m <taskset module>`: with PYTHONPATH=examples they would not find it)."""
    os.environ[KEY_VAR] = token or "none"
    if paths := os.environ.get("PYTHONPATH"):
        os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in paths.split(os.pathsep) if p)
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    return KEY_VAR


def trace_rewards(trace) -> tuple[dict[str, float], float]:
    """A trace's rewards by name and their total, the library's weighted sum; a reward the rubric left
    unset (None) counts in neither."""
    scored = {name: r for name, r in trace.rewards.items() if r is not None}
    by_name = {name: float(r.score) for name, r in scored.items()}
    return by_name, sum(float(r.score) * float(r.weight) for r in scored.values())


def held_out(cfg: EnvConfig) -> list:
    """The tasks learner.evaluate plays: the last env.verifiers_eval of load(cfg)'s (never trained on)."""
    tasks = load(cfg)[1]
    return tasks[len(tasks) - cfg.verifiers_eval :] if cfg.verifiers_eval else []


def problems(cfg: EnvConfig) -> list[Problem]:
    """The tasks trained on as tandem's problems, in the taskset's order (without the held-out ones): the id
    names the taskset and the task's position, the conversation is the task's system prompt and prompt
    (what the model is first shown; the harness renders it), metadata['verifiers_task'] the task's index
    in load(cfg)[1]."""
    env, tasks = load(cfg)
    name = env.config.taskset.id
    if cfg.verifiers_eval and len(tasks) <= cfg.verifiers_eval:
        raise ConfigError(
            f"env.verifiers_eval = {cfg.verifiers_eval} holds out all {len(tasks)} tasks of taskset '{name}'"
        )
    out = []
    for i, task in enumerate(tasks[: len(tasks) - cfg.verifiers_eval]):
        data = task.data
        prompt = data.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else []
        if not isinstance(prompt, str) and prompt:
            messages = [_message(m) for m in prompt]
        if data.system_prompt:
            messages.insert(0, {"role": "system", "content": data.system_prompt})
        out.append(Problem(f"{name}-{i}", data.prompt_text, "", tuple(messages), {"verifiers_task": i}))
    return out


def _message(m) -> dict[str, str]:
    d = m.model_dump() if hasattr(m, "model_dump") else dict(m)
    content = d.get("content")
    text = content if isinstance(content, str) else json.dumps(content)
    return {"role": str(d.get("role", "user")), "content": text}
