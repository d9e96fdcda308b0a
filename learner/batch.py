"""From scored groups to tensors: staleness and degenerate-group filters, advantages, and the split of a
step's completions into this rank's micro-batches. Token ids are used exactly as sent (no re-tokenising)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from learner.grpo import group_advantages
from shared import protocol
from shared.config import GRPOConfig
from shared.protocol import ScoredGroup


def is_stale(group: ScoredGroup, version: int, max_staleness: int, floor_version: int = 0) -> bool:
    """Started by a policy more than max_staleness versions older than the learner's (a group is as
    stale as its oldest token: newer versions that took over mid-completion do not make it fresher), by a
    version the learner has not reached (another run's), or below `floor_version` (before a resume that
    had to re-publish its weights under a new version: see servers.sync_server)."""
    lag = version - group.policy_version
    return lag > max_staleness or lag < 0 or group.policy_version < floor_version


def is_degenerate(group: ScoredGroup) -> bool:
    return protocol.is_degenerate(group.rewards)


@dataclass
class Sequence:
    """One completion, ready to train on. In an episode of several turns `completion` holds the
    environment's tokens too, as context: `model_mask` is 1 on the model's tokens, the only ones scored,
    and `sampler_logprobs` has one value per model token."""

    prompt: list[int]
    completion: list[int]
    sampler_logprobs: list[float]
    advantage: float
    model_mask: list[int] | None = None  # None: every completion token is the model's
    version: int = 0  # the policy version that sampled its first token (its group's)
    # the version that sampled each model token (shared.protocol.Completion.versions); None: all `version`
    token_versions: list[int] | None = None

    @property
    def model_tokens(self) -> int:
        return len(self.completion) if self.model_mask is None else sum(self.model_mask)


def sequences(groups: list[ScoredGroup], grpo: GRPOConfig) -> tuple[list[Sequence], torch.Tensor]:
    """All completions of the step, in group order, with their group-relative advantages [B, G]."""
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [B, G]
    adv = group_advantages(
        rewards, scale=grpo.scale_rewards, std=grpo.std, baseline=grpo.baseline, eps=grpo.eps
    )
    seqs = [
        Sequence(
            g.prompt_token_ids, c.token_ids, c.logprobs, float(adv[b, i]), c.mask, g.policy_version,
            None if c.versions is None else c.token_versions(g.policy_version),
        )
        for b, g in enumerate(groups)
        for i, c in enumerate(g.completions)
    ]  # fmt: skip
    return seqs, adv


def shard(seqs: list[Sequence], rank: int, world: int, micro: int) -> list[list[Sequence]]:
    """This rank's contiguous slice of the step's completions, cut into micro-batches of `micro`."""
    per_rank = len(seqs) // world
    mine = seqs[rank * per_rank : (rank + 1) * per_rank]
    return [mine[i : i + micro] for i in range(0, len(mine), micro)]


class _Tensors:
    def to(self, device):
        """The same batch with every tensor on `device` (the model's: the batch is built on the host)."""
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v.to(device) for k, v in tensors.items() if isinstance(v, torch.Tensor)})


@dataclass
class MicroBatch(_Tensors):
    input_ids: torch.Tensor  # [n, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [n, L]
    positions: torch.Tensor  # [n, T] index into the shifted logprobs [n, L-1] of each completion token
    mask: torch.Tensor  # [n, T] 1 on the model's completion tokens: the loss's; 0 on padding, environment
    sampler_logprobs: torch.Tensor  # [n, T] at the model's tokens, 0 elsewhere
    advantages: torch.Tensor  # [n]
    # [n, T] the policy version that sampled each model token, -1 on environment tokens and padding
    versions: torch.Tensor | None = None


def _per_completion(batch: list[Sequence]) -> tuple[torch.Tensor, ...]:
    """(tokens [n, T]: 1 on every completion token; mask [n, T]: 1 on the model's; sampler log-probs
    [n, T] at the model's tokens; advantages [n]; versions [n, T] at the model's tokens, -1 elsewhere),
    right-padded to the longest completion."""
    T = max(len(s.completion) for s in batch)
    tokens = torch.zeros((len(batch), T), dtype=torch.float32)
    mask = torch.zeros((len(batch), T), dtype=torch.float32)
    sampler = torch.zeros((len(batch), T), dtype=torch.float32)
    versions = torch.full((len(batch), T), -1, dtype=torch.long)
    for i, s in enumerate(batch):
        C = len(s.completion)
        tokens[i, :C] = 1.0
        mask[i, :C] = 1.0 if s.model_mask is None else torch.tensor(s.model_mask, dtype=torch.float32)
        model = mask[i, :C].bool()
        sampler[i, :C][model] = torch.tensor(s.sampler_logprobs)
        versions[i, :C][model] = torch.tensor(s.token_versions or [s.version] * s.model_tokens)
    advantages = torch.tensor([s.advantage for s in batch], dtype=torch.float32)
    return tokens, mask, sampler, advantages, versions


def collate(batch: list[Sequence], pad_id: int) -> MicroBatch:
    L = max(len(s.prompt) + len(s.completion) for s in batch)
    _, mask, sampler, advantages, versions = _per_completion(batch)
    n, T = mask.shape
    input_ids = torch.full((n, L), pad_id, dtype=torch.long)
    attention = torch.zeros((n, L), dtype=torch.long)
    positions = torch.zeros((n, T), dtype=torch.long)
    for i, s in enumerate(batch):
        ids = s.prompt + s.completion
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        # Token t of the completion sits at input position len(prompt) + t and is predicted by the
        # logits at position len(prompt) + t - 1, i.e. entry len(prompt) + t - 1 of the shifted logprobs.
        positions[i, : len(s.completion)] = torch.arange(
            len(s.prompt) - 1, len(s.prompt) - 1 + len(s.completion)
        )
    return MicroBatch(input_ids, attention, positions, mask, sampler, advantages, versions)


@dataclass
class PackedBatch(_Tensors):
    """A micro-batch with each prompt encoded once (learner.shared_prompt): consecutive completions that
    share a prompt sit back to back behind one copy of it in one row, each attending to the prompt and to
    its own earlier tokens only, with positions that continue after the prompt as if it were alone. The
    forward computes logits only at `keep`, the positions that predict a completion token."""

    input_ids: torch.Tensor  # [R, L] prompt, completion 1, completion 2, ...; right-padded
    position_ids: torch.Tensor  # [R, L] 0..P-1 on the prompt, P..P+C_i-1 on completion i
    allowed: torch.Tensor  # [R, L, L] bool: query i may attend to key j
    keep: torch.Tensor  # [K] positions whose logits are computed, the union over rows
    rows: torch.Tensor  # [Q] per real completion token (row-major over [n, T]): its row in [R*K] logits
    targets: torch.Tensor  # [Q] the completion tokens themselves
    tokens: torch.Tensor  # [n, T] 1 on the Q real completion tokens, the model's and the environment's
    mask: torch.Tensor  # [n, T] as MicroBatch
    sampler_logprobs: torch.Tensor  # [n, T]
    advantages: torch.Tensor  # [n]
    # per row: (start, end) of the prompt, then of each completion, back to back (learner/attention.py)
    layout: list[list[tuple[int, int]]] = field(default_factory=list)
    versions: torch.Tensor | None = None  # [n, T] as MicroBatch

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[R, 1, L, L]: 0 where attended, the dtype's minimum elsewhere (eager and SDPA both add it)."""
        zeros = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
        return zeros.masked_fill(~self.allowed, torch.finfo(dtype).min)[:, None]


def pack(batch: list[Sequence], pad_id: int) -> PackedBatch:
    """The same completions as collate(batch), in the same order, packed by prompt (see PackedBatch)."""
    runs: list[list[Sequence]] = []
    for s in batch:  # consecutive completions with the same prompt share a row
        if runs and runs[-1][0].prompt == s.prompt:
            runs[-1].append(s)
        else:
            runs.append([s])
    L = max(len(r[0].prompt) + sum(len(s.completion) for s in r) for r in runs)
    R = len(runs)
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    segment = torch.full((R, L), -1, dtype=torch.long)  # 0 prompt, i+1 completion i, -1 padding
    predictors: list[tuple[int, int]] = []  # (row, position) of the logits predicting each token
    layout: list[list[tuple[int, int]]] = []
    for r, run in enumerate(runs):
        P = len(run[0].prompt)
        layout.append([(0, P)])
        input_ids[r, :P] = torch.tensor(run[0].prompt)
        position_ids[r, :P] = torch.arange(P)
        segment[r, :P] = 0
        start = P
        for i, s in enumerate(run):
            C = len(s.completion)
            input_ids[r, start : start + C] = torch.tensor(s.completion)
            position_ids[r, start : start + C] = torch.arange(P, P + C)
            segment[r, start : start + C] = i + 1
            layout[r].append((start, start + C))
            # Token 0 is predicted by the prompt's last position, token t > 0 by the one before it.
            predictors += [(r, P - 1)] + [(r, start + t - 1) for t in range(1, C)]
            start += C
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    same = segment[:, :, None] == segment[:, None, :]  # [R, L, L]
    allowed = causal & (same | (segment[:, None, :] == 0))  # own segment, or the prompt
    keep = torch.tensor(sorted({p for _, p in predictors}), dtype=torch.long)
    where = torch.searchsorted(keep, torch.tensor([p for _, p in predictors], dtype=torch.long))
    rows = torch.tensor([r for r, _ in predictors], dtype=torch.long) * len(keep) + where
    targets = torch.tensor([t for s in batch for t in s.completion], dtype=torch.long)
    tokens, mask, sampler, advantages, versions = _per_completion(batch)
    return PackedBatch(
        input_ids, position_ids, allowed, keep, rows, targets,
        tokens, mask, sampler, advantages, layout, versions,
    )  # fmt: skip
