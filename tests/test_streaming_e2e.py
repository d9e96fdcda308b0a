"""In-flight weight updates on the real engines (server.inflight_updates = "continue"): the vLLM engine in
LoRA mode produces continuously while the DeepSpeed learner trains beside it (split placement); each
publish interrupts the samples in flight, which go on under the new version from the tokens they have.
Every trained token, and every token of the completions that versions shared, re-scores on the version
stamped on it; the learner's served-policy check reads the tokens of its own version among them."""

from __future__ import annotations

import re

import httpx
import pytest

from shared import protocol as P
from tests.helpers import (
    SMALL_LEARNER,
    SMALL_RUN,
    TOKEN,
    jsonl,
    rescore,
    start_learner,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.slow

RUN = [
    *SMALL_RUN,
    "--sampling.temperature=1.0",  # sampler log-probs are then the policy's own, comparable with /v1/score
    "--sampling.max_new_tokens=64",
    # A reward that depends on the length as well: a group is degenerate only if its G samples are all
    # wrong (or all right) and all of one length, so every step (dynamic sampling) has a learning signal.
    "--reward.length_penalty=1.0",
]
SERVER = [
    *RUN,
    "--server.adapter_mode=lora",
    "--server.production=continuous",
    "--server.inflight_updates=continue",
    "--server.max_inflight_groups=2",
    # Never full in this run: groups are always in flight (each with samples still decoding) when the
    # learner publishes, so every publish has samples to move to the new version.
    "--server.queue_size=64",
    "--server.lease_s=600",
]
TOLERANCE = 2e-3  # mean |sampler - /v1/score| per token on one engine in float32 (as the other e2e tests)
LEARNER = [
    *SMALL_LEARNER,
    "--learner.placement=split",
    "--learner.max_staleness=4",
    "--learner.steps=2",
    # Every step moves the weights (so each version's log-probs differ from the last one's by far more than
    # the noise): groups without a learning signal are skipped, not trained on with zero gradients.
    "--learner.dynamic_sampling=true",
    "--learner.lr=1e-3",
]


def _one_version(group: dict, completion: dict) -> dict:
    """`group` holding only `completion`, stamped as its group's version throughout."""
    return group | {"completions": [completion | {"versions": None}]}


def test_a_publish_moves_the_samples_in_flight_and_every_token_rescores_on_its_version(tmp_path, procs):
    server, client = start_server(tmp_path, SERVER)
    procs.append(server)
    out = tmp_path / "run"
    learner = start_learner(client.url, out, tmp_path / "learner.log", [*RUN, *LEARNER])
    procs.append(learner)
    try:
        wait_for("the learner ends", lambda: not learner.alive(), [server], timeout=900)
        assert learner.returncode == 0, learner.log()[-4000:]
        client.pause_production()  # what was in flight is queued; nothing new starts
        text = httpx.get(f"{client.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
        continued = float(re.search(r"^tandem_samples_continued_total (\S+)$", text, re.M).group(1))
        trained = jsonl(out / "groups.jsonl")
        queued = client.pull(64, wait_s=0).groups
        shared = [  # the queued completions that several versions sampled
            g.model_dump() | {"completions": [c.model_dump() for c in g.completions if c.versions]}
            for g in queued
        ]
        groups = [g for record in [*trained, {"groups": shared}] for g in record["groups"]]
        rescored = rescore(client, [{"groups": groups}])
        # the completions that newer versions took over, read as their group's version alone
        moved = [(g, c) for g in groups for c in g["completions"] if c["versions"]]
        alone = rescore(client, [{"groups": [_one_version(g, c) for g, c in moved]}])
    finally:
        client.close()
    assert continued > 0, "no sample was in flight at a publish"
    for c, lps in rescored:  # the sampler's log-prob of each token is its stamped version's
        assert len(lps) == len(c["logprobs"])
        mean = sum(abs(a - b) for a, b in zip(lps, c["logprobs"], strict=True)) / len(lps)
        assert mean < TOLERANCE, (mean, c["versions"])
    # The tokens a newer version sampled, read as their group's version, re-score far off: the stamping
    # matters (every pair of versions differs: each step trained on groups with a learning signal).
    assert any(len(c["versions"]) > 1 for _, c in moved), "no completion was sampled by two versions"
    stamped = {id(c): lps for c, lps in rescored}
    right, wrong = [], []
    for (g, c), (_, misread) in zip(moved, alone, strict=True):
        versions = P.Completion.model_validate(c).token_versions(g["policy_version"])
        newer = [t for t, v in enumerate(versions) if v != g["policy_version"]]
        right += [abs(stamped[id(c)][t] - c["logprobs"][t]) for t in newer]
        wrong += [abs(misread[t] - c["logprobs"][t]) for t in newer]
    right, wrong = sum(right) / len(right), sum(wrong) / len(wrong)
    assert right < TOLERANCE and wrong > max(100 * right, 1e-4), (right, wrong)
    metrics = jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    print(
        f"samples continued: {continued:.0f}; completions rescored: {len(rescored)}, "
        f"{len(moved)} of them partly or wholly by a newer version than their group's (those tokens off by "
        f"{right:.1e} on their stamped version, {wrong:.1e} on the group's); step 2's token lag "
        f"{metrics[1]['policy/token_lag']:.2f} (p95 {metrics[1]['policy/token_lag_p95']:.0f})"
    )
