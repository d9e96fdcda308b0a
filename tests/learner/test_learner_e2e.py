"""The learner end to end: a real rollout server (vLLM backend) as a subprocess, the real DeepSpeed ZeRO-2
engine, SmolLM2-135M, on CPU. One server for the module; each test starts its own learner(s)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner.metrics import STEP_KEYS
from learner.trackers import mlflow_name
from shared.protocol import is_degenerate
from tests.helpers import SMALL_LEARNER, SMALL_RUN, Proc, free_port, start_learner, start_server

pytestmark = pytest.mark.slow

SERVER = [
    *SMALL_RUN,
    "--sampling.max_new_tokens=48",
    "--server.queue_size=6",
    "--server.lease_s=60",
]
LEARNER = [
    *SMALL_LEARNER,
    "--grpo.beta=0.04",  # the KL term and its metric (cpu.toml turns it off for speed)
]
# Two processes vs one on the same groups, fp32: the gradients agree to float rounding, and Adam's first
# step moves each element by ±lr·g/(|g|+eps) ≈ ±lr. A flipped element would differ by 2·lr = 4e-4.
ADAPTER_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("learner-server")
    proc, client = start_server(tmp, [*SERVER, "--server.backend=vllm"])
    yield proc, client, tmp
    client.close()
    proc.stop()


def learner(server_url: str, out: Path, extra: list[str], log: Path, launcher: list[str] = ()) -> Proc:
    return start_learner(server_url, out, log, [*SERVER, *LEARNER, *extra], launcher)


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():  # the server writes its event log from its first event on
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _lora(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def three_steps(server, tmp_path_factory):
    proc_s, client, tmp = server
    out = tmp_path_factory.mktemp("three") / "run"
    started = time.time()
    # Dynamic sampling: a step of all-degenerate groups has no gradient at step 1 (zero advantages, and the
    # KL is zero while B = 0), and 3 steps x 2 groups of 4 all wrong happened once at 35 % accuracy.
    # keep_checkpoints=3: adapters/v1 too (kept as checkpoints are), which the tests below compare
    extra = ["--learner.steps=3", "--learner.dynamic_sampling=true", "--learner.keep_checkpoints=3"]
    p = learner(client.url, out, extra, out.parent / "learner.log")
    rc = p.wait(timeout=900)
    assert rc == 0, p.log()[-5000:]
    return out, started, time.time(), p.log()


def test_three_steps_train_the_adapter_and_leave_the_base_alone(server, three_steps):
    _, client, _ = server
    out, _, _, log = three_steps
    assert client.health().policy_version == 3
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["step"] == 3 and summary["policy_version"] == 3
    assert summary["base_sha256_start"] == summary["base_sha256_end"]  # frozen base: bit-identical
    # LoRA B starts at zero (step 0 is the base model) and must have moved; A is trained too.
    v1, v3 = _lora(out / "adapters" / "v1"), _lora(out / "adapters" / "v3")
    b_keys = [k for k in v3 if "lora_B" in k]
    assert b_keys and all(v3[k].abs().max() > 0 for k in b_keys)
    assert any(not torch.equal(v1[k], v3[k]) for k in v3)
    assert "step    3/3 v3" in log


def test_metrics_hold_every_diagnostic_for_every_step(three_steps):
    out = three_steps[0]
    records = _jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert set(STEP_KEYS) <= set(r)
        assert abs(r["advantage/mean"]) < 1e-6
        assert r["kl/ref"] >= 0
        assert 0 <= r["groups/degenerate"] <= 1 and 0 <= r["ratio/clipfrac"] <= 1
        assert r["policy/version_lag"] == 0  # timeslice is on-policy
    assert records[0]["kl/ref"] == 0.0  # step 1 trains from B = 0: the policy is the reference
    assert (out / "tensorboard").is_dir() and (out / "config.json").is_file()


def test_timeslice_server_idles_while_the_learner_trains(server, three_steps):
    _, _, tmp = server
    _, started, ended, _ = three_steps
    events = [e for e in _jsonl(tmp / "server" / "events.jsonl") if started <= e["t"] <= ended]
    sleeps = [e["t"] for e in events if e["event"] == "sleep"]
    wakes = [e["t"] for e in events if e["event"] == "wake"]
    assert len(sleeps) == 3 and len(wakes) == 3
    groups = [e for e in events if e["event"] == "group"]
    for s, w in zip(sleeps, wakes, strict=True):
        assert s < w
        assert not [g for g in groups if s < g["t"] < w], "a group was produced during a training phase"
    for w, next_sleep in zip(wakes[:-1], sleeps[1:], strict=True):
        assert [g for g in groups if w < g["t"] < next_sleep], "production did not resume after the wake"


def test_two_nodes_joined_by_a_rendezvous_reproduce_one_process(three_steps, tmp_path):
    """A learner across two "nodes": two torchrun launches (--nnodes 2, one process each) that find each
    other through a c10d rendezvous endpoint, as on a cluster, train the same step as one process: the
    same loss, gradient norm and adapter, ZeRO-2 keeping half of the optimizer state on each rank. (Two
    processes on one node, torchrun --nproc-per-node=2: the shared-prompt test below; a profiled step:
    tests/learner/test_loop.py.)"""
    out, two, port = three_steps[0], tmp_path / "nodes", free_port()
    args = [
        "--learner.steps=1",
        f"--learner.replay_file={out / 'groups.jsonl'}",
        "--learner.grad_accum=1",
    ]
    nodes = [
        learner(
            "http://127.0.0.1:1",
            two,
            args,
            tmp_path / f"node{n}.log",
            launcher=[
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=two-nodes",
                "--max-restarts=0",
            ],
        )  # fmt: skip
        for n in range(2)
    ]
    for node in nodes:
        assert node.wait(timeout=600) == 0, node.log()[-5000:]
    one_m, two_m = _jsonl(out / "metrics.jsonl")[0], _jsonl(two / "metrics.jsonl")[0]
    assert two_m["grad_norm"] == pytest.approx(one_m["grad_norm"], rel=1e-4)
    assert two_m["loss"] == pytest.approx(one_m["loss"], rel=1e-4, abs=1e-7)
    a, b = _lora(out / "adapters" / "v1"), _lora(two / "adapters" / "v1")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < ADAPTER_TOLERANCE
    one_s = json.loads((out / "run_summary.json").read_text())["optimizer_state_numel_per_rank"]
    two_s = json.loads((two / "run_summary.json").read_text())["optimizer_state_numel_per_rank"]
    assert len(one_s) == 1 and len(two_s) == 2  # two ranks, one per node
    for part in two_s:  # ZeRO-2: each rank keeps about half of the optimizer state
        assert abs(part - one_s[0] / 2) <= 0.01 * one_s[0], (part, one_s)


def test_shared_prompt_gives_the_plain_gradients_at_two_processes(three_steps, tmp_path):
    """learner.shared_prompt at world size 2 under ZeRO-2 against the plain path, on the same groups. Plain
    SGD (no clipping) makes the adapters show the gradients: B starts at 0, so v1's B = -lr·g1(B); A has
    no gradient at step 1 (B = 0), so v2's A - v1's A = -lr·g2(A). lr 0.3 keeps that difference far above
    fp32's rounding of A (~0.04: ulp 4e-9; at lr 0.01 it was 1e-8 and rounding alone differed 10 %) and step
    2 near the reference (KL ~1e-3): at lr 3 step 1 moved the policy to KL ~1, where step 2 turned fp32's
    order differences into 9e-4 of grad_norm."""
    out = three_steps[0]
    # B needs step 1's signal, A's difference step 2's: where every recorded group of a step has equal
    # rewards (the sampled run decides), its first group is given rewards 0, 1, 0, 1, ... instead.
    replay = tmp_path / "groups.jsonl"
    with replay.open("w") as f:
        for rec in _jsonl(out / "groups.jsonl")[:2]:
            if all(is_degenerate([c["reward"] for c in g["completions"]]) for g in rec["groups"]):
                for i, c in enumerate(rec["groups"][0]["completions"]):
                    c["reward"], c["rewards"] = float(i % 2), {"given": float(i % 2)}
            f.write(json.dumps(rec) + "\n")
    sgd = [
        "--deepspeed.overrides.optimizer.type=SGD",
        "--deepspeed.overrides.zero_allow_untested_optimizer=true",
        "--deepspeed.gradient_clipping=0",
        "--learner.lr=0.3",
    ]
    runs = {}
    for shared in ("false", "true"):
        run = tmp_path / f"shared-{shared}"
        p = learner(
            "http://127.0.0.1:1",
            run,
            [
                *sgd,
                "--learner.steps=2",
                f"--learner.replay_file={replay}",
                "--learner.grad_accum=1",
                f"--learner.shared_prompt={shared}",
            ],  # fmt: skip
            tmp_path / f"shared-{shared}.log",
            launcher=["-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"],
        )
        assert p.wait(timeout=600) == 0, p.log()[-5000:]
        runs[shared] = run
    plain, packed = (_jsonl(runs[s] / "metrics.jsonl") for s in ("false", "true"))
    for a, b in zip(plain, packed, strict=True):
        # The loss sums terms of size ~|A| = 1 that cancel (advantages have mean 0; at step 1 the ratio is 1):
        # 1e-6 absolute is 1e-6 of its terms. sampler/logp_diff is itself fp32 noise (~5e-6) when the
        # sampler serves the learner's exact weights (vLLM merge mode): 1e-6 absolute there too.
        for k in ("loss", "grad_norm", "kl/ref", "policy/entropy", "ratio/mean", "sampler/logp_diff"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    grads, floor = {}, {}
    for s in ("false", "true"):
        v1, v2 = _lora(runs[s] / "adapters" / "v1"), _lora(runs[s] / "adapters" / "v2")
        grads[s] = {k: v1[k] if "lora_B" in k else v2[k] - v1[k] for k in v1}
        # A difference of two stored fp32 weights is exact only to their rounding: 2 ulp of A's magnitude.
        floor |= {
            k: 0.0 if "lora_B" in k else 2 * torch.finfo(torch.float32).eps * v1[k].abs().max().item()
            for k in v1
        }
    assert grads["false"].keys() == grads["true"].keys()
    for k, g in grads["false"].items():
        scale = g.abs().max().item()
        assert scale > 10 * floor[k], f"{k}: no gradient above fp32 rounding, nothing compared"
        # The two paths sum in different orders: where a step's gradient is small next to its terms
        # (advantages cancel), fp32 order differences reached 1.5e-4 of it (seen once, k_proj A at step 2).
        # A wrong mask or position gives O(1) differences.
        assert (g - grads["true"][k]).abs().max().item() <= 1e-3 * scale + floor[k], k


def test_lag_steps_trains_groups_exactly_k_versions_old_and_gives_back_the_held_ones(server, tmp_path):
    """learner.lag_steps = 1 over 3 steps: step 1 pulls two batches from its first version f, step s trains
    version f + max(0, s - 2)'s groups (lags 0, 1, 1), and the batch still held at the end goes back."""
    _, client, tmp = server
    out, started = tmp_path / "run", time.time()
    p = learner(client.url, out, ["--learner.steps=3", "--learner.lag_steps=1"], tmp_path / "learner.log")
    assert p.wait(timeout=900) == 0, p.log()[-5000:]
    trained = _jsonl(out / "groups.jsonl")
    versions = [sorted({g["policy_version"] for g in t["groups"]}) for t in trained]
    f = versions[0][0]
    assert versions == [[f], [f], [f + 1]]
    assert [r["policy/version_lag"] for r in _jsonl(out / "metrics.jsonl")] == [0.0, 1.0, 1.0]
    events = [e for e in _jsonl(tmp / "server" / "events.jsonl") if e["t"] >= started]
    leased = {e["lease_id"]: e["group_ids"] for e in events if e["event"] == "lease"}
    acked = {e["lease_id"] for e in events if e["event"] == "ack"}
    released = [e["lease_id"] for e in events if e["event"] == "release"]
    trained_ids = {g["group_id"] for t in trained for g in t["groups"]}
    assert set(leased) == acked | set(released) and not acked & set(released), "a lease left open"
    assert [gid for lease in released for gid in leased[lease]], "the held batch was not given back"
    assert not trained_ids & {gid for lease in released for gid in leased[lease]}


def test_trackers_get_every_step_once_across_a_resume_with_samples_and_config(server, tmp_path):
    """W&B (offline), Trackio (local store) and MLflow (file store) for real: 2 steps, an evaluation, a
    resume for a third; read back from each tracker's own files."""
    from tests import tracker_files

    for lib in ("wandb", "trackio", "mlflow"):
        pytest.importorskip(lib)
    _, client, _ = server
    out, store, mlruns = tmp_path / "run", tmp_path / "trackio", f"file://{tmp_path / 'mlruns'}"
    extra = [
        "--learner.report_to=wandb,trackio,mlflow", "--learner.trackers.samples_every=1",
        "--learner.trackers.samples_rows=64", f"--learner.trackers.trackio_dir={store}",
        f"--learner.trackers.mlflow_tracking_uri={mlruns}", "--learner.trackers.run_name=e2e",
    ]  # fmt: skip
    env = {"WANDB_MODE": "offline", "MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_SILENT": "true"}
    first = start_learner(
        client.url, out, tmp_path / "1.log", [*SERVER, *LEARNER, *extra, "--learner.steps=2"], **env
    )
    assert first.wait(timeout=900) == 0, first.log()[-5000:]
    (out / "evaluations.jsonl").write_text(json.dumps({"version": 2, "pass@1_greedy": 0.25}) + "\n")
    resumed = [*SERVER, *LEARNER, *extra, "--learner.steps=3", "--resume"]
    second = start_learner(client.url, out, tmp_path / "2.log", resumed, **env)
    assert second.wait(timeout=900) == 0, second.log()[-5000:]

    records = _jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    # the module's server may serve a later version than a new run's v0: the run continues from it
    final = json.loads((out / "run_summary.json").read_text())["policy_version"]
    assert final == records[-1]["policy/version"]
    trained = {t["step"]: t["groups"] for t in _jsonl(out / "groups.jsonl")}
    book = json.loads((out / "trackers.json").read_text())
    assert {n: (b["step"], b["evals"]) for n, b in book.items()} == dict.fromkeys(
        ("wandb", "trackio", "mlflow"), (3, 1)
    )
    runs = {
        "wandb": tracker_files.wandb_run(out / "wandb", book["wandb"]["id"]),
        "trackio": tracker_files.trackio_run(store, "tandem", book["trackio"]["id"]),
        "mlflow": tracker_files.mlflow_run(mlruns, book["mlflow"]["id"]),
    }
    for name, run in runs.items():
        logged = tracker_files.per_step(run["history"])
        values = {(s, k): v for s, m in run["history"] for k, v in m.items()}
        for r in records:  # every number of every step, exactly once, with its value
            for k, v in r.items():
                if k in ("step", "time") or not isinstance(v, int | float):
                    continue
                key = mlflow_name(k) if name == "mlflow" else k
                assert logged[key].count(r["step"]) == 1, (name, k, logged[key])
                assert values[(r["step"], key)] == pytest.approx(v, rel=1e-12), (name, k)
        eval_key = "eval/pass_1_greedy" if name == "mlflow" else "eval/pass@1_greedy"
        assert logged[eval_key] == [3] and values[(3, eval_key)] == 0.25, name
        assert run["config"]["learner"]["report_to"] == ["wandb", "trackio", "mlflow"], name
        assert sorted(run["tables"]) == [1, 2, 3], name
        for step, rows in run["tables"].items():  # the step's trajectories, in group order
            completions = [
                (g["policy_version"], c["text"], c["reward"]) for g in trained[step] for c in g["completions"]
            ]
            assert [(r["version"], r["completion"], r["reward"]) for r in rows] == completions, (name, step)
            assert all(r["prompt"] and r["turns"] == 1 and r["step"] == step for r in rows)
        assert run["summary"]["policy_version"] == final, name  # the run's summary (run_summary.json's)
    assert runs["mlflow"]["status"] == "FINISHED"
