"""The learner says when its steps carry nothing to learn from (learner/metrics.py SignalWatch), from the
step metrics batch_metrics computes (learner/pulled.py)."""

from __future__ import annotations

import pytest

from learner.metrics import NO_SIGNAL_STEPS, SignalWatch
from learner.pulled import Pulled, batch_metrics
from shared import protocol as P


def _step(mean=0.0, std=0.0, degenerate=1.0, identical=0.0):
    return {
        "reward/mean": mean,
        "reward/std": std,
        "groups/degenerate": degenerate,
        "groups/identical": identical,
    }


def _watch():
    lines = []
    return SignalWatch(lines.append), lines


def test_three_steps_that_all_scored_zero_are_told_once_with_the_likely_causes():
    watch, lines = _watch()
    for _ in range(NO_SIGNAL_STEPS - 1):
        watch.observe(_step())
    assert lines == []  # two steps are not yet a spell
    watch.observe(_step())
    watch.observe(_step())  # the same spell goes on: told once
    assert len(lines) == 1 and lines[0].startswith("no learning signal in the last 3 steps: every completion")
    assert "scored 0" in lines[0] and "answer_prefill" in lines[0] and "reward.functions" in lines[0]
    watch.observe(_step(mean=0.4, std=0.5, degenerate=0.5))  # a signal: the next spell is told again
    for _ in range(NO_SIGNAL_STEPS):
        watch.observe(_step())
    assert len(lines) == 2


def test_a_step_with_a_signal_breaks_the_spell():
    watch, lines = _watch()
    for m in (_step(), _step(), _step(mean=0.5, std=0.5, degenerate=0.5), _step(), _step()):
        watch.observe(m)
    assert lines == []


def test_all_full_marks_and_groups_that_each_answer_one_way_get_their_own_line():
    watch, lines = _watch()
    for _ in range(NO_SIGNAL_STEPS):
        watch.observe(_step(mean=1.0))
    assert "every completion scored 1." in lines[-1] and "harder task" in lines[-1]
    watch, lines = _watch()  # groups all right or all wrong, nearly all of one completion: collapse
    for _ in range(NO_SIGNAL_STEPS):
        watch.observe(_step(mean=0.5, std=0.5, identical=0.9))
    assert "90 % of groups one and the same completion" in lines[-1] and "temperature" in lines[-1]
    watch, lines = _watch()  # identical completions count even where a group or two still differ
    for _ in range(NO_SIGNAL_STEPS):
        watch.observe(_step(mean=0.5, std=0.5, degenerate=0.95, identical=0.95))
    assert len(lines) == 1


def _group(token_ids: list[list[int]], rewards: list[float]) -> P.ScoredGroup:
    comps = [
        P.Completion(token_ids=ids, logprobs=[-0.1] * len(ids), text="x", reward=r, finish_reason="stop")
        for ids, r in zip(token_ids, rewards, strict=True)
    ]
    return P.ScoredGroup(
        group_id="g", prompt_id="p", prompt_token_ids=[1, 2], answer="1", policy_version=0, completions=comps
    )


def test_batch_metrics_count_the_groups_of_one_and_the_same_completion():
    same = _group([[5, 6], [5, 6]], [1.0, 1.0])
    apart = _group([[5, 6], [5, 7]], [1.0, 0.0])
    half_way = _group([[5], [5, 6]], [0.0, 0.0])  # alike in reward, not in tokens
    m = batch_metrics(Pulled([same, apart, half_way], [], seen=3, degenerate=2), version=0)
    assert m["groups/identical"] == 1 / 3 and m["groups/degenerate"] == 2 / 3


def test_staleness_is_reported_per_group_by_its_oldest_token_and_per_token():
    # The learner at v5. Group A, v5 throughout (2 + 2 tokens); group B started by v2, its second
    # completion taken over by v4 at its token 1 (tokens: v2 v2 | v2 v4 v4).
    a = _group([[5, 6], [5, 7]], [1.0, 0.0])
    b = _group([[5, 6], [5, 7, 8]], [1.0, 0.0])
    a = a.model_copy(update={"policy_version": 5})
    late = b.completions[1].model_copy(update={"versions": [(0, 2), (1, 4)]})
    b = b.model_copy(update={"policy_version": 2, "completions": [b.completions[0], late]})
    m = batch_metrics(Pulled([a, b], [], seen=2), version=5)
    assert m["policy/version_lag"] == (0 + 3) / 2  # by oldest token: what max_staleness bounds
    # per token: 0, 0, 0, 0 | 3, 3 | 3, 1, 1 -> mean 11 / 9; the 95th percentile is 3
    assert m["policy/token_lag"] == pytest.approx(11 / 9) and m["policy/token_lag_p95"] == 3.0
