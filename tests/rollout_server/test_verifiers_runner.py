"""env.kind = "verifiers" without an engine: an episode's trace becomes a completion only when every span
the model sampled is what the engine answered (rollout_server/verifiers_runner.as_played), and the config
and --check-config errors a user meets first, one line each."""

from __future__ import annotations

from array import array
from types import SimpleNamespace as NS

import pytest

from rollout_server.environments.verifiers_runner import as_played
from rollout_server.serving.token_api import Record, Records, digest
from shared import verifiers_tasks
from shared.cli import check_task
from shared.config import ConfigError, TandemConfig

# Two turns: the prompt, the model's first turn, two tokens the harness adds, the model's second turn.
PROMPT, TURN1, ADDED, TURN2 = [1, 2, 3], [10, 11], [20, 21], [12, 13]
LPS1, LPS2 = [-0.5, -0.25], [-1.0, -2.0]


def _records(version: int = 1) -> Records:
    records = Records()
    for i, (prompt, tokens, lps) in enumerate([(PROMPT, TURN1, LPS1), (PROMPT + TURN1 + ADDED, TURN2, LPS2)]):
        record = Record(version, len(prompt), digest(prompt), array("q", tokens), array("d", lps), "stop")
        records.add(f"r{i}", 0, prompt, record)
    return records


def _episode(lps2=LPS2, tokens2=TURN2, trainable=(True,), ok=True) -> NS:
    ids = PROMPT + TURN1 + ADDED + tokens2
    mask = [False] * 3 + [True] * 2 + [False] * 2 + [True] * 2
    spread = [0.0] * 3 + LPS1 + [0.0] * 2 + list(lps2)
    branch = NS(trainable=True, token_ids=ids, sampled_mask=mask, logprobs=spread)
    rewards = {"correct": NS(score=1.0, weight=1.0), "style": NS(score=0.5, weight=2.0), "judge": None}
    traces = [
        NS(agent=NS(trainable=t), branches=[branch], rewards=rewards, errors=[], last_reply="12",
           calls=[NS(finish_reason="stop"), NS(finish_reason="length")])
        for t in trainable
    ]  # fmt: skip
    errors = [] if ok else [NS(type="HarnessError", message="the program exited 1")]
    return NS(traces=traces, ok=ok, errors=errors)


def test_an_episode_the_engine_produced_becomes_a_masked_completion():
    played = as_played(_episode(), _records(), 1)
    assert played.prompt_ids == PROMPT
    assert played.token_ids == TURN1 + ADDED + TURN2
    assert played.mask == [1, 1, 0, 0, 1, 1]
    assert played.logprobs == LPS1 + LPS2
    assert played.rewards == {"correct": 1.0, "style": 0.5}  # an unscored judge (None) is left out
    assert played.total == 1.0 * 1.0 + 0.5 * 2.0
    assert played.finish_reason == "length" and played.last_reply == "12" and played.failed is None
    failed = as_played(_episode(ok=False), _records(), 1)
    assert failed.failed == "HarnessError: the program exited 1"


@pytest.mark.parametrize(
    "episode, version, reason",
    [
        (_episode(lps2=[-1.0, -2.0000001]), 1, "the logprobs differ from the engine's"),
        (_episode(tokens2=[12, 14]), 1, "no engine answer to this prompt"),
        (_episode(), 2, "was answered by version 1, not 2"),
        (_episode(trainable=(True, True)), 1, "2 trainable traces"),
        (_episode(trainable=(False,)), 1, "0 trainable traces"),
    ],
)
def test_an_episode_not_exactly_the_engines_is_refused_with_the_reason(episode, version, reason):
    why = as_played(episode, _records(), version)
    assert isinstance(why, str) and reason in why


def test_the_config_needs_a_taskset_and_keeps_env_verifiers_to_its_kind():
    with pytest.raises(ValueError, match=r"env.kind = 'verifiers' needs env.verifiers = \{taskset"):
        TandemConfig(env={"kind": "verifiers"})
    with pytest.raises(ValueError, match="env.verifiers is for env.kind = 'verifiers', not 'single_turn'"):
        TandemConfig(env={"verifiers": {"taskset": {"id": "x"}}})


def test_a_missing_or_unsupported_library_is_one_line(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(ConfigError, match=r"needs the verifiers library: pip install 'tandem\[verifiers\]'"):
        verifiers_tasks.import_verifiers()
    monkeypatch.setattr(metadata, "version", lambda name: "0.3.9")
    with pytest.raises(ConfigError, match=r"verifiers 0.3.9 is installed, tandem supports >=0.4.0,<0.5"):
        verifiers_tasks.import_verifiers()


def test_check_config_names_an_environment_that_cannot_be_loaded():
    pytest.importorskip("verifiers")
    cfg = TandemConfig(env={"kind": "verifiers", "verifiers": {"taskset": {"id": "no_such_taskset"}}})
    with pytest.raises(ConfigError) as e:
        check_task(cfg)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("env.verifiers: the environment of taskset 'no_such_taskset' cannot be loaded")
    assert "taskset 'no_such_taskset' not found" in message


def test_the_extra_pins_the_supported_versions():
    import tomllib
    from pathlib import Path

    extras = tomllib.loads(Path("pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"verifiers{verifiers_tasks.SUPPORTED}" in extras["verifiers"]


def test_the_tasks_split_into_trained_and_held_out_and_seats_default_to_the_local_path(monkeypatch):
    pytest.importorskip("verifiers")
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    env = {"kind": "verifiers", "verifiers": {"taskset": {"id": "two_turn_sums"}}, "verifiers_eval": 100}
    cfg = TandemConfig(env=env).env
    problems, held = verifiers_tasks.problems(cfg), verifiers_tasks.held_out(cfg)
    tasks = verifiers_tasks.load(cfg)[1]
    assert len(tasks) == 1000 and len(problems) == 900 and held == tasks[900:]
    assert problems[7].id == "two_turn_sums-7" and problems[7].metadata["verifiers_task"] == 7
    assert problems[7].question == tasks[7].data.prompt_text
    assert problems[7].conversation() == [{"role": "user", "content": tasks[7].data.prompt_text}]
    seat = verifiers_tasks.env_config(cfg).player
    assert seat.harness.id == "null" and seat.runtime.type == "subprocess"
    pinned = {**env, "verifiers": {"taskset": {"id": "two_turn_sums"}, "player": {"harness": {"id": "bash"}}}}
    assert verifiers_tasks.env_config(TandemConfig(env=pinned).env).player.harness.id == "bash"
    with pytest.raises(ValueError, match="env.verifiers_eval must leave tasks to train on"):
        TandemConfig(env={**env, "verifiers_limit": 100})


def test_the_process_is_prepared_for_the_librarys_runtimes(monkeypatch, tmp_path):
    """The token in the variable the library's client reads, this venv's bin on PATH (its `uv`), and
    PYTHONPATH absolute: the subprocess runtime starts a taskset's tool server as `python -m <module>` in a
    folder of its own, where PYTHONPATH=examples would find nothing."""
    import os
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["examples", "", "/abs/tasks"]))
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.setenv(verifiers_tasks.KEY_VAR, "")  # (so that the test's values are undone after it)
    assert verifiers_tasks.prepare_process("s3cret") == verifiers_tasks.KEY_VAR
    assert os.environ[verifiers_tasks.KEY_VAR] == "s3cret"
    assert os.environ["PATH"].split(os.pathsep) == [os.path.dirname(sys.executable), "/usr/bin"]
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "examples"), "/abs/tasks"]
    verifiers_tasks.prepare_process(None)
    assert os.environ[verifiers_tasks.KEY_VAR] == "none"
