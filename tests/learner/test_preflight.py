"""Memory preflight for the production config, against the published ladder for a 1.5B model:
full fine-tuning 24 GB, LoRA + ZeRO-2 12 GB, LoRA + offload 8 GB (GB = 1e9 bytes)."""

import subprocess
import sys

import pytest

from learner.preflight import GIB, R1_DISTILL_1_5B, Dims, estimate, report
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


def test_production_config_fits_8gb_time_sliced_and_not_both_resident():
    _, fits = report(_cfg(), Dims.from_config(R1_DISTILL_1_5B), 8.0)
    assert fits["time-sliced (one GPU)"] and not fits["both resident (one GPU)"]


def test_totals_within_20_percent_of_the_ladder_where_comparable():
    d = Dims.from_config(R1_DISTILL_1_5B)
    # Full fine-tuning: the ladder is 16 B/param for 1.5B = 24 GB. R1-Distill unties its embeddings,
    # which makes it 1.78B: 16 x 1.78B = 28.4 GB. Its tied sibling Qwen2.5-1.5B (1.54B) is comparable.
    tied = Dims.from_config(R1_DISTILL_1_5B | {"tie_word_embeddings": True})
    full_states = estimate(_cfg(), tied)["full_finetune"][
        "weights + Adam, every parameter trainable (16 B/param)"
    ]
    assert abs(full_states / 1e9 - 24) / 24 < 0.2
    # The LoRA rows describe runs without activation recomputation.
    e = estimate(_cfg("learner.gradient_checkpointing=false", "deepspeed.offload_optimizer=false"), d)
    both = (sum(e["server"].values()) + sum(e["learner"].values())) / 1e9
    assert abs(both - 12) / 12 < 0.2, both  # LoRA + ZeRO-2, server and learner resident
    e = estimate(_cfg("learner.gradient_checkpointing=false"), d)
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
    assert "DOES NOT FIT" in out.stdout and "--learner.gradient_checkpointing=true" in out.stdout
    learner_block = out.stdout.split("learner (")[1].split("\n\n")[0].splitlines()[1:]
    sizes = [float(line.split()[0]) for line in learner_block]
    assert sizes == sorted(sizes, reverse=True)
