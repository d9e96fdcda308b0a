"""The benchmark scripts' command lines. The GPU benchmark cannot run here; its --dry-run checks the
arguments and builds the 1.5B model on the meta device."""

import subprocess
import sys

import pytest

from tests.helpers import REPO


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=timeout)


def test_gpu_benchmark_dry_run_builds_the_production_model():
    out = _run("scripts/bench_gpu.py", "--dry-run")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "dry run ok: Qwen2ForCausalLM with 1.777B parameters (28 layers, hidden 1536, vocab 151936)"
        in out.stdout
    )
    assert "a step = 2 x G=4 completions, 4096 tokens; cap 8 GiB" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--prompts", "0"], "--prompts must be >= 1"), (["--gpu-gib", "-1"], "--gpu-gib must be > 0")],
)
def test_gpu_benchmark_rejects_bad_arguments(args, message):
    out = _run("scripts/bench_gpu.py", "--dry-run", *args)
    assert out.returncode == 2 and message in out.stderr


@pytest.mark.parametrize(
    "script", ["bench_rollout.py", "bench_trl.py", "bench_publish.py", "bench_learner.py", "demo.py"]
)
def test_benchmark_help(script):
    out = _run(f"scripts/{script}", "--help", timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout


def test_trl_benchmark_checks_the_shared_config_before_starting_anything():
    out = _run("scripts/bench_trl.py", "--lr", "0", timeout=120)
    assert out.returncode == 2
    assert "invalid config: learner.lr: Input should be greater than 0 (got 0.0)" in out.stderr
