"""The learner's command line: bad configs and an unreachable server end in one clear line, not a
traceback; --help imports no heavy stack."""

import subprocess
import sys

import pytest

from tests.helpers import REPO, free_port, proc_env


def _learner(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "learner", "--config", "deploy/configs/cpu.toml", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env=proc_env(),
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--learner.grad_accum=3"],
            "batch size: learner.prompts_per_step x sampling.group_size = 2 x 8 = 16",
        ),
        (["--learner.bogus=1"], "invalid config: learner.bogus: unknown key"),
        (["--sampling.group_size=1"], "sampling.group_size: Input should be greater than or equal to 2"),
        (["--model.name=/nonexistent/model"], "model folder /nonexistent/model has no config.json"),
        (["--learner.lr=-1"], "learner.lr: Input should be greater than 0"),
    ],
)
def test_bad_config_is_one_line_and_nonzero(args, message, tmp_path):
    out = _learner(*args, f"--learner.out_dir={tmp_path}/run")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr


def test_unwritable_out_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    out = _learner(f"--learner.out_dir={blocker}/run")
    assert out.returncode == 2
    assert out.stderr.strip().startswith(f"error: learner.out_dir={blocker}/run is not writable")


def test_full_disk_fails_before_training(tmp_path):
    """A disk without room for checkpoints (here: asking for more free space than any disk has)."""
    out = _learner(f"--learner.out_dir={tmp_path}/run", "--learner.min_free_mb=1e12")
    assert out.returncode == 2
    assert out.stderr.strip().startswith(f"error: learner.out_dir={tmp_path}/run: only ")
    assert "MB free, need >= 1000000000000 MB" in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_unreachable_server_gives_a_clear_message_after_a_bounded_wait(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    out = _learner(
        f"--learner.server_urls={url}", "--learner.connect_timeout_s=3", f"--learner.out_dir={tmp_path}/r"
    )
    assert out.returncode == 3, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: rollout server at {url} did not become healthy within 3 s")


def test_help_imports_no_heavy_stack():
    code = (
        "import sys, runpy\n"
        "for mod in ('learner', 'rollout_server'):\n"
        "    sys.argv = [mod, '--help']\n"
        "    try: runpy.run_module(mod, run_name='__main__')\n"
        "    except SystemExit: pass\n"
        "heavy = ('torch', 'deepspeed', 'vllm', 'transformers')\n"
        "print('HEAVY', sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "--resume" in out.stdout and "--section.key=value" in out.stdout
    assert "HEAVY []" in out.stdout, out.stdout[-500:]


def test_help_lists_every_config_field_with_its_default_and_description():
    from shared.cli import config_fields
    from shared.config import TandemConfig

    text = config_fields()
    for section, field in TandemConfig.model_fields.items():
        for name, f in field.annotation.model_fields.items():
            if hasattr(f.annotation, "model_fields"):  # a subsection: its own fields are listed
                assert f"[{section}.{name}]" in text
                continue
            assert f"--{section}.{name}=" in text, (section, name)
    assert "  --learner.shared_prompt=true\n      encode each prompt once" in text
    assert '  --server.adapter_mode="lora"\n' in text


def test_two_single_process_learners_can_run_side_by_side(tmp_path):
    # Each initialises torch.distributed before waiting for its server; without a launcher they must
    # not share a fixed MASTER_PORT (the second used to die with EADDRINUSE).
    url = f"http://127.0.0.1:{free_port()}"
    args = [
        "--config",
        "deploy/configs/cpu.toml",
        f"--learner.server_urls={url}",
        "--learner.connect_timeout_s=8",
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "learner", *args, f"--learner.out_dir={tmp_path}/r{i}"],
            cwd=REPO, env=proc_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 3, err[-2000:]
        assert "did not become healthy" in err


def test_a_damaged_checkpoint_is_named_before_anything_starts(tmp_path):
    """`checkpoints/latest` pointing at garbage: one line naming it, with the way out, before the model
    is built or the server asked (that is why no server is running here)."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("PK\x03\x04garbage")
    out = _learner(f"--learner.out_dir={tmp_path}/run", "--resume")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path}/run/checkpoints/latest does not name")
    assert "Point it at an older checkpoint" in lines[0]
