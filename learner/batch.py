"""From scored groups to tensors: staleness and degenerate-group filters, advantages, and the split of a
step's completions into this rank's micro-batches. Token ids are used exactly as sent (no re-tokenising)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner.grpo import degenerate_groups, group_advantages
from shared.config import GRPOConfig
from shared.protocol import ScoredGroup


def is_stale(group: ScoredGroup, version: int, max_staleness: int, floor_version: int = 0) -> bool:
    """Produced by a policy more than max_staleness versions older than the learner's, by a version the
    learner has not reached (another run's), or below `floor_version` (before a resume that had to
    re-publish its weights under a new version: see checkpoint.sync_server)."""
    lag = version - group.policy_version
    return lag > max_staleness or lag < 0 or group.policy_version < floor_version


def is_degenerate(group: ScoredGroup) -> bool:
    return bool(degenerate_groups(torch.tensor([group.rewards]))[0])


@dataclass
class Sequence:
    """One completion, ready to train on."""

    prompt: list[int]
    completion: list[int]
    sampler_logprobs: list[float]
    advantage: float


def sequences(groups: list[ScoredGroup], grpo: GRPOConfig) -> tuple[list[Sequence], torch.Tensor]:
    """All completions of the step, in group order, with their group-relative advantages [B, G]."""
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [B, G]
    adv = group_advantages(
        rewards, scale=grpo.scale_rewards, std=grpo.std, baseline=grpo.baseline, eps=grpo.eps
    )
    seqs = [
        Sequence(g.prompt_token_ids, c.token_ids, c.logprobs, float(adv[b, i]))
        for b, g in enumerate(groups)
        for i, c in enumerate(g.completions)
    ]
    return seqs, adv


def shard(seqs: list[Sequence], rank: int, world: int, micro: int) -> list[list[Sequence]]:
    """This rank's contiguous slice of the step's completions, cut into micro-batches of `micro`."""
    per_rank = len(seqs) // world
    mine = seqs[rank * per_rank : (rank + 1) * per_rank]
    return [mine[i : i + micro] for i in range(0, len(mine), micro)]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [n, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [n, L]
    positions: torch.Tensor  # [n, T] index into the shifted logprobs [n, L-1] of each completion token
    mask: torch.Tensor  # [n, T] 1 on real completion tokens
    sampler_logprobs: torch.Tensor  # [n, T]
    advantages: torch.Tensor  # [n]


def collate(batch: list[Sequence], pad_id: int) -> MicroBatch:
    L = max(len(s.prompt) + len(s.completion) for s in batch)
    T = max(len(s.completion) for s in batch)
    n = len(batch)
    input_ids = torch.full((n, L), pad_id, dtype=torch.long)
    attention = torch.zeros((n, L), dtype=torch.long)
    positions = torch.zeros((n, T), dtype=torch.long)
    mask = torch.zeros((n, T), dtype=torch.float32)
    sampler = torch.zeros((n, T), dtype=torch.float32)
    for i, s in enumerate(batch):
        ids = s.prompt + s.completion
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        c = len(s.completion)
        # Token t of the completion sits at input position len(prompt) + t and is predicted by the
        # logits at position len(prompt) + t - 1, i.e. entry len(prompt) + t - 1 of the shifted logprobs.
        positions[i, :c] = torch.arange(len(s.prompt) - 1, len(s.prompt) - 1 + c)
        mask[i, :c] = 1.0
        sampler[i, :c] = torch.tensor(s.sampler_logprobs)
    advantages = torch.tensor([s.advantage for s in batch], dtype=torch.float32)
    return MicroBatch(input_ids, attention, positions, mask, sampler, advantages)
