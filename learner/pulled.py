"""A step's pulled batch: the groups and the leases they came under, with what collecting them dropped, and
the batch's metrics (rewards, lengths, staleness, rollout speed). No HTTP and no engine: the step's math
and the conversation with the servers both use it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.protocol import ScoredGroup


@dataclass
class Pulled:
    groups: list[ScoredGroup]
    lease_ids: list[str]
    seen: int = 0  # non-stale groups pulled
    stale: int = 0
    degenerate: int = 0
    dropped_degenerate: int = 0
    seconds: float = 0.0
    error: str | None = None  # out_dir could not record the leases (they were given back): the step stops


def batch_metrics(pulled: Pulled, version: int) -> dict[str, float]:
    rewards = torch.tensor([r for g in pulled.groups for r in g.rewards])
    lengths = torch.tensor(  # the model's tokens: an episode's environment turns are not its length
        [c.num_model_tokens for g in pulled.groups for c in g.completions], dtype=torch.float32
    )
    truncated = [c.finish_reason == "length" for g in pulled.groups for c in g.completions]
    # staleness per model token (an in-flight update makes a completion's later tokens newer than its first)
    lags = torch.tensor([lag for g in pulled.groups for lag in g.token_lags(version)], dtype=torch.float32)
    tokens = float(lengths.sum())
    by_function: dict[str, list[float]] = {}
    for c in (c for g in pulled.groups for c in g.completions):
        for name, value in c.rewards.items():
            by_function.setdefault(name, []).append(value)
    return {
        **{f"reward/{name}/mean": sum(v) / len(v) for name, v in by_function.items()},
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(correction=0)),
        "accuracy": float((rewards >= 1.0).float().mean()),
        "groups/degenerate": pulled.degenerate / max(pulled.seen, 1),
        # groups whose G completions are one and the same token sequence: a policy that answers one way
        "groups/identical": sum(len({tuple(c.token_ids) for c in g.completions}) == 1 for g in pulled.groups)
        / len(pulled.groups),
        "groups/stale_dropped": float(pulled.stale),
        "groups/degenerate_dropped": float(pulled.dropped_degenerate),
        "completion/length": float(lengths.mean()),
        "completion/truncated": sum(truncated) / len(truncated),
        # the groups' oldest tokens' lag (what learner.max_staleness bounds), and every token's
        "policy/version_lag": sum(version - g.policy_version for g in pulled.groups) / len(pulled.groups),
        "policy/token_lag": float(lags.mean()),
        "policy/token_lag_p95": float(lags.quantile(0.95)),
        "perf/rollout_tok_s": tokens / max(pulled.seconds, 1e-9),
        "perf/pull_s": pulled.seconds,
    }
