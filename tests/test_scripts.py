"""The benchmark scripts' command lines. The GPU benchmark cannot run here; its --dry-run checks the
arguments, builds the 1.5B model on the meta device and its tokenizer, and runs the memory preflight on the
config the product's server and learner would run with."""

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
    assert "tokenizer of 151936 ids" in out.stdout  # every id the random model samples decodes
    assert "a step = 2 x G=4 completions, 4096 tokens; cap 8 GiB" in out.stdout
    assert "preflight: the config fits" in out.stdout  # the production config, resized to the run


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--prompts", "0"], "--prompts must be >= 1"), (["--gpu-gib", "-1"], "--gpu-gib must be > 0")],
)
def test_gpu_benchmark_rejects_bad_arguments(args, message):
    out = _run("scripts/bench_gpu.py", "--dry-run", *args)
    assert out.returncode == 2 and message in out.stderr


@pytest.mark.parametrize(
    "script",
    [
        "bench_rollout.py",
        "bench_trl.py",
        "bench_publish.py",
        "bench_server_memory.py",
        "bench_agent.py",
        "config_reference.py",
        "bench_learner.py",
        "demo.py",
        "demo_matrix.py",
        "sampling_check.py",
        "soak.py",
        "gpu_kit.py",
        "profile_decode.py",
        "profile_compile.py",
        "bench_streaming.py",
        "bench_start_stop.py",
    ],
)
def test_benchmark_help(script):
    out = _run(f"scripts/{script}", "--help", timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout


def test_trl_benchmark_checks_the_shared_config_before_starting_anything():
    out = _run("scripts/bench_trl.py", "--lr", "0", timeout=120)
    assert out.returncode == 2
    assert "invalid config: learner.lr: Input should be greater than 0 (got 0.0)" in out.stderr


def test_gpu_benchmark_files_each_memory_sample_under_the_phase_the_run_was_in():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "scripts/bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # The server's event log of a time-sliced run: the learner sleeps it to build, wakes it, trains...
    events = [
        {"t": 10, "event": "sleep"}, {"t": 20, "event": "wake"}, {"t": 29, "event": "lease"},
        {"t": 30, "event": "sleep"}, {"t": 40, "event": "publish", "version": 1}, {"t": 41, "event": "wake"},
    ]  # fmt: skip
    bounds = bench.phases(events, healthy_at=5, learner_at=6)
    assert [name for _, name in bounds] == [
        "server start", "server up, learner starting", "learner build (server asleep)",
        "step 1: rollout (server awake)", "step 1: training", "publish v1 (server asleep)",
        "step 2: rollout (server awake)",
    ]  # fmt: skip
    samples = [  # (time, MiB per process, MiB used on the GPU)
        (3, {"server": 100}, 200), (12, {"server": 50, "learner": 300}, 400),
        (25, {"server": 900, "learner": 40}, 1000), (26, {"server": 950, "learner": 30}, 1010),
        (35, {"learner": 3000}, 3100),
    ]  # fmt: skip
    table = bench.peaks(samples, bounds)
    assert table["step 1: rollout (server awake)"] == {"server": 950, "learner": 40, "GPU used": 1010}
    assert table["step 1: training"] == {"learner": 3000, "GPU used": 3100}
    # On CPU the learner builds with the server awake: its first sleep is already step 1's training.
    cpu = [{"t": 10, "event": "lease"}, {"t": 11, "event": "sleep"}, {"t": 12, "event": "wake"}]
    assert [name for _, name in bench.phases(cpu, healthy_at=5, learner_at=6)][2:] == [
        "step 1: training", "step 2: rollout (server awake)",
    ]  # fmt: skip


def test_trl_benchmark_breaks_a_tandem_step_into_its_phases():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_trl", REPO / "scripts/bench_trl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def step(pull, train, save=0.1, publish=0.05, rest=0.2):
        phases = {"perf/pull_s": pull, "perf/train_s": train, "perf/save_s": save, "perf/publish_s": publish}
        return phases | {"perf/step_s": sum(phases.values()) + rest}

    records = [step(3.0, 5.0), step(4.0, 6.0, rest=0.4), step(3.5, 4.0)]  # the timed steps
    events = [  # as the server logs them: the warm-up's groups come before any wake, then a wake after each
        # step's handoff starts the next step's rollout; lease/sleep lines in between are skipped
        {"t": 0.0, "event": "group"}, {"t": 9.0, "event": "wake"}, {"t": 11.5, "event": "group"},
        {"t": 11.6, "event": "group"}, {"t": 20.0, "event": "wake"}, {"t": 20.1, "event": "sleep"},
        {"t": 23.0, "event": "group"}, {"t": 30.0, "event": "wake"}, {"t": 33.5, "event": "group"},
        {"t": 40.0, "event": "wake"},  # after the last step: nothing follows
    ]  # fmt: skip
    out = bench.breakdown(records, events)
    labels = list(out)
    assert [out[k] for k in labels[:5]] == pytest.approx([3.5, 5.0, 0.1, 0.05, 0.2])  # medians
    assert labels[0].startswith("pull") and labels[1].startswith("train") and labels[4].startswith("other")
    assert out[labels[5]] == pytest.approx(3.0)  # median of 2.5, 3.0, 3.5: one per timed step


def test_the_demo_runs_larger_only_where_the_cpu_computes_in_bf16():
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", REPO / "scripts/demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.demo_choices("float32") == ["--model.dtype=auto"]  # cpu.toml's 2 prompts x 12 steps
    larger = demo.demo_choices("bfloat16")
    assert larger[0] == "--model.dtype=auto"
    assert {
        "--learner.prompts_per_step=4",
        "--server.prompts_per_batch=8",
        "--learner.steps=24",
        "--server.queue_size=8",
    } <= set(larger)


def test_the_demo_shows_the_learner_s_line_when_its_steps_carry_no_signal(tmp_path, capsys):
    import importlib.util

    from learner.metrics import NO_SIGNAL_STEPS, SignalWatch

    spec = importlib.util.spec_from_file_location("demo", REPO / "scripts/demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    told = []
    watch = SignalWatch(lambda line: told.append(f"[learner] {line}"))  # as the learner's log() prints it
    for _ in range(NO_SIGNAL_STEPS):
        watch.observe({"reward/mean": 0.0, "reward/std": 0.0, "groups/degenerate": 1.0})
    log = tmp_path / "learner.log"
    log.write_text("\n".join(["step    3/12 v3 | reward 0.000 | degenerate 1.00", *told, "noise"]) + "\n")
    finished = type("Proc", (), {"alive": lambda self: False})()
    demo.follow(finished, log)
    shown = capsys.readouterr().out.splitlines()
    assert shown == ["  step    3/12 v3 | reward 0.000 | degenerate 1.00", f"  {told[0]}"]
    assert "no learning signal in the last 3 steps" in shown[1]


def test_the_calculator_example_is_a_task_the_server_takes_and_scores_only_the_product(tmp_path):
    """examples/calculator.py as scripts/bench_agent.py runs it: its splits share no problem, the reward is
    1 only when the last turn ends with the product, and the server's --check-config accepts the task
    (imports the tool and the reward, loads the data)."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import calculator
    finally:
        sys.path.remove(str(REPO / "examples"))
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from bench_agent import TASK
    finally:
        sys.path.remove(str(REPO / "scripts"))
    import json

    folder = calculator.write(tmp_path / "calc", train=300, test=50)
    train, test = (
        [json.loads(x) for x in (folder / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "test")
    )
    assert len(train) == 300 and len(test) == 50
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    a, b = map(int, test[0]["id"].split("x"))
    assert test[0]["answer"] == str(a * b) and calculator.multiply(a, b) == a * b
    assert test[0]["messages"][-1] == {"role": "user", "content": f"What is {a} * {b}?"}
    assert calculator.solved(f"The answer is {a * b}.", str(a * b), "", {}) == 1.0
    assert calculator.solved(f"{a * b} is not it, {a * b + 1}", str(a * b), "", {}) == 0.0
    assert calculator.solved("I do not know.", str(a * b), "", {}) == 0.0
    out = _run("-m", "rollout_server", *TASK, f"--data.path={folder}", "--check-config", timeout=120)
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert cfg["env"]["tools"] == ["examples/calculator.py:multiply"] and cfg["env"]["kind"] == "tools"


def test_the_limit_model_counts_a_step_by_hand():
    """scripts/limits.py on a toy decoder at 1 FLOP/s and 1 byte/s: its seconds are its counts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("limits", REPO / "scripts/limits.py")
    limits = importlib.util.module_from_spec(spec)
    sys.modules["limits"] = limits  # its dataclasses look their module up
    spec.loader.exec_module(limits)
    shapes = limits.Shapes(d=2, inner=3, layers=1, heads=1, kv_heads=1, head_dim=2, vocab=5)
    # q,o 2x2; k,v 2x2; MLP 3x(2x3)
    assert (shapes.layer_weights, shapes.head_weights) == (2 * 4 + 8 + 18, 10)
    group = {"prompt_token_ids": [1, 2], "completions": [{"token_ids": [3]}, {"token_ids": [4, 5]}]}
    unit = limits.Rates(flops=1.0, bandwidth=1.0)
    # training: prompt 2*34*2 + attention 8*(0+1); completions 2*44*n + attention 8*ctx: 144 + 104 + 216
    assert limits.training_floor([group], shapes, unit, forwards=2.0) == 2 * 464
    # generation: prefill 2*44*2 + 8 = 184; decode t=0: 2 live, compute 2*(88+16) = 208 > read 88+2*16;
    # t=1: 1 live at context 3, compute 88+24 = read 88+24 = 112
    assert limits.generation_floor([group], shapes, unit, bytes_per=2) == 184 + 208 + 112
    assert limits.decode_step_floor([2, 2], shapes, unit, bytes_per=2) == (208, 88 + 2 * 16)
    cfg = {"grpo": {"beta": 0.04, "old_logprobs": "recompute"}}
    assert limits.forwards_per_step(cfg) == 4.0
    assert limits.forwards_per_step({"grpo": {"beta": 0.0, "old_logprobs": "sampler"}}) == 2.0


def test_the_agent_benchmark_s_reasoning_gym_tasks_hold_out_what_it_evaluates():
    """Each reasoning-gym task of scripts/bench_agent.py makes a held-out split of at least the 50 problems
    the benchmark scores (a config whose questions repeat leaves fewer after the train split's are removed:
    one-word letter_counting kept 43 of 100), and the majority baseline it prints is that split's."""
    pytest.importorskip("reasoning_gym")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from bench_agent import REASONING_GYM, majority_baseline, rg_data
    finally:
        sys.path.remove(str(REPO / "scripts"))
    from shared.datasets import load_problems
    from shared.task_config import DataConfig

    for name in REASONING_GYM:
        held_out = load_problems(
            DataConfig(task="reasoning_gym", seed=1, reasoning_gym=rg_data(name)), "test"
        )
        assert len(held_out) >= 50, name
        answer, share = majority_baseline(name, 1, 50)
        answers = [p.answer for p in held_out[:50]]
        assert share == answers.count(answer) / 50 == max(answers.count(a) for a in answers) / 50, name
    assert majority_baseline("syllogism", 1, 50) == ("Yes", 0.76)  # docs/benchmarks.md §13, seed 1
