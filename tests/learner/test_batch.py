"""Collation: token ids as sent, and the logit positions that predict each completion token."""

import torch

from learner.batch import collate, is_stale, sequences, shard
from shared.config import GRPOConfig
from shared.protocol import Completion, ScoredGroup


def _group(rewards, version=0, prompt=(5, 6, 7)):
    comps = [
        Completion(
            token_ids=[10 + i, 20 + i], logprobs=[-0.1, -0.2], text="t", reward=r, finish_reason="stop"
        )
        for i, r in enumerate(rewards)
    ]
    return ScoredGroup(
        group_id="g",
        prompt_id="p",
        prompt_token_ids=list(prompt),
        answer="1",
        policy_version=version,
        completions=comps,
    )


def test_positions_index_the_logits_that_predict_each_completion_token():
    seqs, adv = sequences([_group([1.0, 0.0]), _group([0.0, 0.0], prompt=(5,))], GRPOConfig(eps=0.0))
    assert [s.advantage for s in seqs] == [1.0, -1.0, 0.0, 0.0]  # (1,0): ±1; (0,0): degenerate, 0
    b = collate(seqs, pad_id=0)
    assert b.input_ids[0].tolist() == [5, 6, 7, 10, 20]
    assert b.input_ids[2].tolist() == [5, 10, 20, 0, 0]  # right-padded
    # Shifted targets are input_ids[:, 1:]; the completion's tokens sit at entries len(prompt)-1+t.
    targets = b.input_ids[:, 1:]
    assert targets.gather(1, b.positions)[0].tolist() == [10, 20]
    assert targets.gather(1, b.positions)[2].tolist() == [10, 20]
    assert b.mask.tolist() == [[1, 1]] * 4
    assert torch.equal(b.sampler_logprobs[0], torch.tensor([-0.1, -0.2]))


def test_shard_splits_ranks_then_micro_batches():
    seqs, _ = sequences([_group([1.0, 0.0, 1.0, 0.0])] * 2, GRPOConfig())
    assert [len(m) for m in shard(seqs, 0, 2, 2)] == [2, 2]
    assert shard(seqs, 1, 2, 2)[0][0] is seqs[4]


def test_staleness():
    assert not is_stale(_group([1, 0], version=3), version=3, max_staleness=0)
    assert is_stale(_group([1, 0], version=2), version=3, max_staleness=0)
    assert not is_stale(_group([1, 0], version=1), version=3, max_staleness=2)


def test_groups_from_outside_this_runs_lineage_are_stale():
    # A version the learner has not reached (another run's server): never trained on.
    assert is_stale(_group([1, 0], version=5), version=3, max_staleness=2)
    # After a resume re-published its weights as v8 (floor 8), v7's groups came from other weights.
    assert is_stale(_group([1, 0], version=7), version=8, max_staleness=2, floor_version=8)
    assert not is_stale(_group([1, 0], version=8), version=8, max_staleness=0, floor_version=8)
