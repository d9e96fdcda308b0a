"""The served-policy check (learner/train.py): a step whose groups of the learner's own version carry
sampler log-probs far from the learner's stops the run; the batch carries each model token's version."""

from __future__ import annotations

import torch

from learner.batch import Sequence, collate, pack
from learner.train import MIN_SERVED_TOKENS, SERVED_GAP, served_policy_error


def test_only_a_gap_past_the_bound_on_enough_tokens_of_the_version_stops_the_run():
    bound = SERVED_GAP[torch.float32]
    assert bound == 1e-2 and SERVED_GAP[torch.bfloat16] == 0.25  # 10x and more what was measured
    ok = {"served/logp_gap": 1e-5, "served/tokens": 500.0}  # fp32 kernels: 3e-6 to 1e-5
    assert served_policy_error(ok, bound, 4, ["http://s:8000"]) is None
    wrong = {"served/logp_gap": 0.3, "served/tokens": 500.0}
    line = served_policy_error(wrong, bound, 4, ["http://s:8000"])
    assert line.startswith("the rollout server (http://s:8000) does not serve the weights published as v4")
    assert "by 0.3 nats a token on 500 tokens" in line
    few = {"served/logp_gap": 0.3, "served/tokens": float(MIN_SERVED_TOKENS - 1)}
    assert served_policy_error(few, bound, 4, ["s"]) is None  # too few to tell
    none = {"served/logp_gap": None, "served/tokens": 0.0}  # no group of this version in the step
    assert served_policy_error(none, bound, 4, ["s"]) is None
    assert served_policy_error(wrong, 0.0, 4, ["s"]) is None  # learner.served_policy_max_gap = 0: off


def test_both_batch_layouts_carry_each_model_token_s_version():
    seqs = [
        Sequence([1, 2], [3, 4], [-0.1, -0.2], 1.0, version=3),
        Sequence([1, 2], [5], [-0.3], -1.0, version=3),
        # an episode: model [8], environment [9], model [10, 11]; v2 sampled [8], v3 took over at [10]
        Sequence([7], [8, 9, 10, 11], [-0.1, -0.1, -0.2], 0.5, [1, 0, 1, 1], 2, token_versions=[2, 3, 3]),
    ]
    expected = [[3, 3, -1, -1], [3, -1, -1, -1], [2, -1, 3, 3]]  # -1: padding and the environment's tokens
    assert collate(seqs, 0).versions.tolist() == expected
    assert pack(seqs, 0).versions.tolist() == expected
