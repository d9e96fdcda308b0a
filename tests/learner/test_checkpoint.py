"""Checkpoint files without an engine: what a damaged file is reported as, which checkpoints are kept,
how the record files are cut back on resume, and how a failed write is reported."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from learner import checkpoint as ckpt


def _checkpoint(out: Path, step: int, state: dict | None = None) -> Path:
    """A checkpoint folder shaped like the ones save() writes (zip archives, as torch.save makes)."""
    folder = out / "checkpoints" / f"step-{step}"
    (folder / "ds").mkdir(parents=True)
    for part in (folder / "ds" / "mp_rank_00_model_states.pt", folder / "rng-rank0.pt"):
        with zipfile.ZipFile(part, "w") as z:
            z.writestr("data.pkl", b"x")
    state = state if state is not None else {"step": step, "version": step, "pending_leases": ["a"]}
    (folder / "state.json").write_text(json.dumps(state))
    return folder


def _point(out: Path, name: str) -> None:
    (out / "checkpoints" / "latest").write_text(name)


def test_a_fresh_out_dir_has_no_checkpoint(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_a_good_checkpoint_is_found_with_its_state(tmp_path):
    folder = _checkpoint(tmp_path, 3)
    _point(tmp_path, "step-3")
    found, state = ckpt.latest_checkpoint(tmp_path)
    assert found == folder
    assert (state.step, state.version, state.pending_leases, state.floor_version) == (3, 3, ["a"], 0)


def _state(text: str):
    return lambda out: (out / "checkpoints/step-2/state.json").write_text(text)


@pytest.mark.parametrize(
    ("damage", "named", "says"),
    [
        (lambda out: _point(out, "\x00garbage"), "checkpoints/latest", "does not name a checkpoint"),
        (lambda out: _point(out, "step-9"), "step-9/state.json", "is missing or damaged"),
        (_state('{"step": 2'), "step-2/state.json", "damaged"),  # cut short
        (_state("[1, 2]"), "step-2/state.json", "damaged"),  # not an object
        (_state('{"step": -1, "version": 0}'), "step-2/state.json", "damaged"),  # out of range
        (
            lambda out: (out / "checkpoints/step-2/ds/mp_rank_00_model_states.pt").write_bytes(b"trunc"),
            "step-2/ds/mp_rank_00_model_states.pt",
            "not a complete checkpoint file",
        ),
    ],
)
def test_a_damaged_checkpoint_is_named_with_what_to_do(tmp_path, damage, named, says):
    _checkpoint(tmp_path, 1)
    _checkpoint(tmp_path, 2)
    _point(tmp_path, "step-2")
    damage(tmp_path)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.latest_checkpoint(tmp_path)
    message = str(e.value)
    assert named in message and says in message
    assert "step-1" in message and "echo step-N >" in message  # the way out: an older one that exists


def test_check_out_dir_reports_a_damaged_checkpoint_before_anything_is_built(tmp_path):
    _checkpoint(tmp_path, 1)
    _point(tmp_path, "rubbish")
    with pytest.raises(ckpt.CheckpointError, match="does not name a checkpoint"):
        ckpt.check_out_dir(tmp_path, resume=True, min_free_mb=0)


def test_prune_keeps_the_newest_and_every_kth_and_drops_partial_ones(tmp_path):
    for step in range(1, 13):
        _checkpoint(tmp_path, step)
    # newest 11 (a crash left a partial step-12 beyond it), keep 2, every 5: 5 and 10 stay for good.
    gone = ckpt.prune(tmp_path, newest=11, keep=2, every=5)
    assert gone == [1, 2, 3, 4, 6, 7, 8, 9, 12]
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step-10", "step-11", "step-5"]


def test_published_adapters_are_kept_as_checkpoints_are(tmp_path):
    """One adapter a step would grow out_dir by 7 MB a step (SmolLM2-135M, r = 16) for as long as the run."""
    for v in range(1, 13):
        (tmp_path / "adapters" / f"v{v}").mkdir(parents=True)
    gone = ckpt.prune_adapters(tmp_path, newest=11, keep=2, every=5)
    assert gone == [1, 2, 3, 4, 6, 7, 8, 9]  # v12, past the newest, is not this function's to judge
    assert sorted(int(p.name[1:]) for p in (tmp_path / "adapters").iterdir()) == [5, 10, 11, 12]


def test_truncate_records_cuts_steps_after_the_checkpoint_and_broken_lines(tmp_path):
    lines = [json.dumps({"step": s, "groups": []}) for s in (1, 2, 3)] + ['{"step": 4, "gro']
    (tmp_path / "groups.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    said = []
    ckpt.truncate_records(tmp_path, 2, said.append)
    kept = [json.loads(x)["step"] for x in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert kept == [1, 2]
    assert said == ["groups.jsonl: dropped 2 line(s) after step 2, the checkpoint resumed from"]
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps({"step": 1}) + "\n"  # untouched


def test_a_full_disk_from_torch_save_becomes_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: type("U", (), {"free": 3 * 2**20})())
    with pytest.raises(ckpt.OutDirError) as e, ckpt.writing(tmp_path, "checkpoints/step-2"):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4352 vs 4240")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"could not write checkpoints/step-2 under learner.out_dir={tmp_path}: ")
    assert "No space left on device (3 MB free)" in message and "--resume" in message


def test_a_read_only_out_dir_becomes_one_line(tmp_path):
    expected = "could not write groups.jsonl .*: Read-only file system"
    with pytest.raises(ckpt.OutDirError, match=expected), ckpt.writing(tmp_path, "groups.jsonl"):
        raise OSError(30, "Read-only file system")


def test_damaged_inflight_leases_are_named(tmp_path):
    (tmp_path / "inflight_leases.json").write_text('{"not": "a list"}')
    with pytest.raises(ckpt.CheckpointError, match="inflight_leases.json is damaged"):
        ckpt.read_inflight(tmp_path)
    (tmp_path / "inflight_leases.json").write_text('["a", "b"]')
    assert ckpt.read_inflight(tmp_path) == ["a", "b"]


def test_a_damaged_replay_file_is_named_with_its_line(tmp_path):
    f = tmp_path / "groups.jsonl"
    f.write_text('{"step": 1, "groups": []}\nnot json\n')
    with pytest.raises(ckpt.CheckpointError, match=r"groups.jsonl, line 2: not a groups.jsonl record"):
        ckpt.replay_groups(str(f), 2)


def test_a_diverged_step_is_stopped_before_it_is_saved():
    import types

    import torch

    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    engine = types.SimpleNamespace(module=model)
    ckpt.check_finite(engine, 3)  # finite: nothing to say
    with torch.no_grad():
        model.bias.fill_(float("nan"))  # frozen: not ours to judge
    ckpt.check_finite(engine, 3)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(
        ckpt.CheckpointError, match=r"step 3 left non-finite LoRA weights \(1 tensors, e.g. weight\)"
    ):
        ckpt.check_finite(engine, 3)
