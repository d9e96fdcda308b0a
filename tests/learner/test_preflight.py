"""Memory preflight for the production config, against the published ladder for a 1.5B model:
full fine-tuning 24 GB, LoRA + ZeRO-2 12 GB, LoRA + offload 8 GB (GB = 1e9 bytes)."""

import subprocess
import sys

import pytest

from learner.preflight import GIB, KNOWN, QWEN2_5_7B, R1_DISTILL_1_5B, Dims, checks, estimate, report
from shared.config import load_config
from tests.helpers import REPO

PROD = "deploy/configs/gpu-8gb-timeslice.toml"


def _cfg(*overrides):
    return load_config(REPO / PROD, list(overrides))


def test_parameter_counts_from_dimensions():
    d = Dims.from_config(R1_DISTILL_1_5B)
    # 28 layers x (q,o: 1536^2 each; k,v: 1536x256 each; mlp: 3 x 1536 x 8960) + untied 151936 x 1536 x 2
    assert d.params() == pytest.approx(1.777e9, rel=1e-3)
    # LoRA r16 on q,k,v,o: 28 x 16 x ((1536+1536) x 2 + (1536+256) x 2) = 4,358,144
    assert d.lora_params(16, ["q_proj", "k_proj", "v_proj", "o_proj"]) == 4_358_144


GPU_GIB = {"gpu-8x-node.toml": 80.0}  # the GPUs each shipped config is for (others: 8 GiB)


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "deploy/configs").glob("gpu-*.toml")))
def test_every_shipped_gpu_config_passes_preflight_on_its_gpus(config):
    cfg = load_config(REPO / "deploy/configs" / config)
    dims, gib = Dims.from_config(KNOWN[cfg.model.name]), GPU_GIB.get(config, 8.0)
    text, ok = report(cfg, dims, gib)
    assert ok, text
    assert [c.ok for c in checks(cfg, dims, gib)] == [True] * (
        3 if cfg.learner.placement == "timeslice" else 2
    )
    assert f"--gpu-gib {gib:g}" in (REPO / "deploy/configs" / config).read_text() or gib == 8.0


def test_tensor_and_data_parallelism_divide_what_each_server_gpu_holds():
    d = Dims.from_config(QWEN2_5_7B)
    node_toml = REPO / "deploy/configs/gpu-8x-node.toml"
    one = load_config(node_toml, ["server.vllm.tensor_parallel_size=1", "server.vllm.data_parallel_size=1"])
    node = load_config(node_toml)  # 2 x 2
    a, b = estimate(one, d)["server"], estimate(node, d)["server"]
    assert b["base weights (bf16 / 2 ranks)"] == a["base weights (bf16)"] / 2 == d.params()
    kv = lambda e: next(v for k, v in e.items() if k.startswith("KV cache"))  # noqa: E731
    # 4 KV heads over 2 ranks: half the heads per GPU; 2 replicas: half the sequences each
    assert kv(b) == pytest.approx(kv(a) / 4, rel=0.01)


@pytest.mark.parametrize(
    ("overrides", "failing", "fix"),
    [
        # The shipped value before this check existed: 2.8 GiB, less than the bf16 weights and the cache.
        (["server.vllm.gpu_memory_utilization=0.35"], "vLLM's share: 0.35 x 8 GiB",
         "raise server.vllm.gpu_memory_utilization to >= 0.58"),
        # So large a share that vLLM cannot start beside what the learner keeps while it generates.
        (["server.vllm.gpu_memory_utilization=0.95"], "rollout phase",
         "lower server.vllm.gpu_memory_utilization to <= 0.93"),
        (["learner.offload_weights_while_generating=false"], "rollout phase",
         "or set learner.offload_weights_while_generating = true"),
        (["server.vllm.enable_sleep_mode=false"], "training phase",
         "set server.vllm.enable_sleep_mode = true"),
        (["learner.gradient_checkpointing=false", "learner.micro_batch_size=8", "learner.grad_accum=1"],
         "training phase", "learner.gradient_checkpointing = true"),
    ],
)  # fmt: skip
def test_a_broken_config_fails_preflight_with_the_reason_and_the_fix(overrides, failing, fix):
    text, ok = report(_cfg(*overrides), Dims.from_config(R1_DISTILL_1_5B), 8.0)
    assert not ok
    bad = [c for c in checks(_cfg(*overrides), Dims.from_config(R1_DISTILL_1_5B), 8.0) if not c.ok]
    assert [c.what.split(":")[0] for c in bad] == [failing.split(":")[0]]
    assert fix in bad[0].fix and f"-> {bad[0].fix}" in text


def test_the_rollout_phase_adds_vllms_share_and_what_the_learner_keeps():
    d = Dims.from_config(R1_DISTILL_1_5B)
    lean, kept = (
        checks(_cfg(f"learner.offload_weights_while_generating={v}"), d, 8.0)[1] for v in ("true", "false")
    )
    # Keeping the frozen weights on the GPU adds them: 1.777e9 params x 2 B = 3.31 GiB.
    assert (kept.need - lean.need) / GIB == pytest.approx(1.777e9 * 2 / GIB, rel=1e-3)
    assert lean.need / GIB == pytest.approx(0.6 * 8 + 0.5 + 4_358_144 * 4 / GIB, rel=1e-3)


def test_totals_within_20_percent_of_the_ladder_where_comparable():
    d = Dims.from_config(R1_DISTILL_1_5B)
    # Full fine-tuning: the ladder is 16 B/param for 1.5B = 24 GB. R1-Distill unties its embeddings,
    # which makes it 1.78B: 16 x 1.78B = 28.4 GB. Its tied sibling Qwen2.5-1.5B (1.54B) is comparable.
    tied = Dims.from_config(R1_DISTILL_1_5B | {"tie_word_embeddings": True})
    full_states = estimate(_cfg(), tied)["full_finetune"][
        "weights + Adam, every parameter trainable (16 B/param)"
    ]
    assert abs(full_states / 1e9 - 24) / 24 < 0.2
    # The LoRA rows describe runs without activation recomputation, logits at every position.
    standard = ("learner.gradient_checkpointing=false", "learner.shared_prompt=false")
    e = estimate(_cfg(*standard, "deepspeed.offload_optimizer=false"), d)
    both = (sum(e["server"].values()) + sum(e["learner"].values())) / 1e9
    assert abs(both - 12) / 12 < 0.2, both  # LoRA + ZeRO-2, server and learner resident
    e = estimate(_cfg(*standard), d)
    timesliced = (sum(e["learner"].values()) + 0.5 * GIB) / 1e9
    assert abs(timesliced - 8) / 8 < 0.2, timesliced  # LoRA + offload, the learner's phase


def test_gradient_checkpointing_and_offload_shrink_the_learner():
    d = Dims.from_config(R1_DISTILL_1_5B)
    plain = sum(
        estimate(_cfg("learner.gradient_checkpointing=false", "deepspeed.offload_optimizer=false"), d)[
            "learner"
        ].values()
    )
    lean = sum(estimate(_cfg(), d)["learner"].values())
    assert lean < plain


def test_cli_lists_largest_items_first_and_says_what_to_change():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "learner.preflight",
            "--config",
            PROD,
            "--gpu-gib",
            "4",
            "--sampling.max_new_tokens=4096",
            "--learner.gradient_checkpointing=false",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 1
    assert "DOES NOT FIT" in out.stdout and "learner.gradient_checkpointing = true" in out.stdout
    learner_block = out.stdout.split("learner (")[1].split("\n\n")[0].splitlines()[1:]
    sizes = [float(line.split()[0]) for line in learner_block]
    assert sizes == sorted(sizes, reverse=True)


def test_shared_prompt_counts_each_prompt_once_and_logits_only_where_scored():
    d = Dims.from_config(R1_DISTILL_1_5B)
    # micro 8 = 2 groups of G = 4; prompt 256 (the estimate's), 512 new tokens: packed rows hold
    # 2 x 256 + 8 x 512 = 4608 tokens against 8 x 768 = 6144 padded ones.
    over = ["learner.micro_batch_size=8", "learner.grad_accum=1", "learner.gradient_checkpointing=false"]
    packed = estimate(_cfg(*over, "learner.shared_prompt=true"), d)["learner"]
    plain = estimate(_cfg(*over, "learner.shared_prompt=false"), d)["learner"]
    assert packed["activations"] / plain["activations"] == pytest.approx(4608 / 6144)
    logits = "logits (policy + its grad + reference, bf16; fp32 chunk)"
    chunk = 4 * 256 * d.vocab
    assert (packed[logits] - chunk) / (plain[logits] - chunk) == pytest.approx((8 * 512 + 2) / 6144)
    # Two rows of 256 + 4 x 512 tokens, bool + bf16 masks
    assert packed["attention masks (packed rows: bool + bf16)"] == 3 * 2 * (256 + 4 * 512) ** 2


def test_episodes_count_their_whole_length_environment_tokens_included():
    d = Dims.from_config(R1_DISTILL_1_5B)
    over = [
        "learner.shared_prompt=false",
        "learner.gradient_checkpointing=false",
        "sampling.max_new_tokens=512",
    ]
    one_turn = estimate(_cfg(*over), d)["learner"]["activations"]
    # Several turns: up to env.max_tokens after the prompt (1536 = three turns of 512), so a sequence
    # is 256 + 1536 tokens, not 256 + 512: the plain path's activations scale with it.
    env = ["env.kind=multi_turn", "env.step=m:f", "env.max_tokens=1536", "model.max_model_len=4096"]
    episodes = estimate(_cfg(*over, *env), d)["learner"]["activations"]
    assert episodes / one_turn == pytest.approx((256 + 1536) / (256 + 512))
    # Unbounded by env.max_tokens: what model.max_model_len leaves after the prompt.
    room = estimate(_cfg(*over, *env[:2], "model.max_model_len=2048"), d)["learner"]["activations"]
    assert room / one_turn == pytest.approx(2048 / (256 + 512))
