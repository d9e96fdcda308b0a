"""GRPO's math as pure torch functions (docs/design.md §4). No config objects, no I/O, no distributed calls.

Shapes: rewards are [B, G] (B prompts, G completions each). Per-token tensors are [N, T], one row per
completion, right-padded, with `mask` 1 on real completion tokens. Per-sequence advantages are [N].

References: GRPO = DeepSeekMath (Shao et al. 2024) Eq. 3-5; Dr. GRPO (Liu et al. 2025) for
`scale="none"` and `constant_norm`; DAPO (Yu et al. 2025) for clip-higher and `token_mean`; k1/k2/k3
are Schulman's KL estimators ("Approximating KL divergence", 2020); dual-clip PPO (Ye et al. 2020) is
how `dual_clip` bounds the ratio against the sampler's logprobs for negative advantages. Off-policy
corrections: truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"), GSPO's sequence-level ratio (Zheng et al. 2025) and CISPO's clipped,
stop-gradient IS weight (MiniMax-M1, 2025).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from shared.protocol import DEGENERATE_TOL

Aggregation = Literal["seq_mean_token_mean", "token_mean", "constant_norm"]
Level = Literal["token", "sequence"]

# k3 = e^u - u - 1 overflows fp32 past u ~ 88; |u| > 20 means the two policies disagree by a factor of
# e^20 on a token, where the estimate is meaningless anyway. Clamping keeps one bad token from
# turning the whole loss into inf.
_KL_LOG_RATIO_BOUND = 20.0


def degenerate_groups(rewards: Tensor, tol: float = DEGENERATE_TOL) -> Tensor:
    """[B, G] -> bool [B]: groups whose rewards are all equal (zero std), which carry no signal; the
    tensor form of shared.protocol.is_degenerate."""
    return (rewards.amax(dim=-1) - rewards.amin(dim=-1)) <= tol


def p_degenerate(p: float, G: int) -> float:
    """Probability that G Bernoulli(p) rewards are all equal: p^G + (1-p)^G."""
    return p**G + (1.0 - p) ** G


def group_advantages(
    rewards: Tensor,
    *,
    scale: Literal["group", "none"] = "group",
    std: Literal["population", "bessel"] = "population",
    baseline: Literal["mean", "rloo"] = "mean",
    eps: float = 1e-6,
) -> Tensor:
    """[B, G] rewards -> [B, G] advantages, one per completion (every token of it shares it).

    baseline='mean': r_i - mean(r) (GRPO).  baseline='rloo': r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean).
    scale='group': divide by std(r) + eps, population (correction=0, the paper's) or Bessel (TRL's).
    Degenerate groups get exactly 0, also with eps = 0.
    """
    G = rewards.shape[-1]
    if G < 2:
        raise ValueError(f"group size {G}: GRPO needs at least 2 completions per prompt")
    rewards = rewards.float()
    mean = rewards.mean(dim=-1, keepdim=True)  # [B, 1]
    if baseline == "mean":
        centered = rewards - mean
    elif baseline == "rloo":
        centered = rewards - (rewards.sum(dim=-1, keepdim=True) - rewards) / (G - 1)
    else:
        raise ValueError(f"unknown baseline {baseline!r}")
    if scale == "group":
        correction = {"population": 0, "bessel": 1}[std]
        centered = centered / (rewards.std(dim=-1, keepdim=True, correction=correction) + eps)
    elif scale != "none":
        raise ValueError(f"unknown scale {scale!r}")
    # Float means of equal values can be off by an ulp; never let that become a huge advantage or NaN.
    return torch.where(degenerate_groups(rewards)[:, None], torch.zeros_like(centered), centered)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: Literal["k3", "k2", "k1"] = "k3") -> Tensor:
    """Per-token estimate of KL(π || π_ref) from tokens sampled from π; u = log π_ref - log π.

    k1 = -u (unbiased, high variance, can be negative); k2 = u²/2 (biased); k3 = e^u - u - 1 (unbiased,
    >= 0, low variance; the GRPO paper's).
    """
    u = (ref_logprobs - logprobs).clamp(-_KL_LOG_RATIO_BOUND, _KL_LOG_RATIO_BOUND)
    if estimator == "k3":
        return torch.expm1(u) - u
    if estimator == "k2":
        return 0.5 * u * u
    if estimator == "k1":
        return -u
    raise ValueError(f"unknown KL estimator {estimator!r}")


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> tuple[Tensor, Tensor]:
    """PPO's surrogate min(ρA, clip(ρ, 1-ε_low, 1+ε_high) A), ρ = exp(log π - log π_old).

    Returns (surrogate [N, T], clipped bool [N, T]); `clipped` marks tokens where the clipped branch is
    the smaller one, i.e. where the surrogate's gradient is zero.
    """
    return _ppo_clip(torch.exp(logprobs - old_logprobs), advantages[:, None], epsilon_low, epsilon_high)


def _ppo_clip(ratio: Tensor, adv: Tensor, epsilon_low: float, epsilon_high: float) -> tuple[Tensor, Tensor]:
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    return torch.minimum(unclipped, clipped), clipped < unclipped


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: Aggregation = "seq_mean_token_mean",
    max_tokens: int | None = None,
    *,
    total_sequences: int | None = None,
    total_tokens: int | float | None = None,
) -> Tensor:
    """Reduce [N, T] per-token values to a scalar.

    seq_mean_token_mean: mean over sequences of each one's token mean (GRPO Eq. 3's 1/|o_i|).
    token_mean: sum over all tokens / number of tokens (DAPO).
    constant_norm: sum / (num_sequences * max_tokens) (Dr. GRPO; max_tokens defaults to T).

    For a shard of a larger batch (data-parallel ranks, accumulation micro-batches) pass the whole
    batch's `total_sequences` / `total_tokens`: the shards' results then *sum* to the whole batch's.
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    n_seq = total_sequences if total_sequences is not None else per_token.shape[0]
    if mode == "token_mean":
        n_tok = total_tokens if total_tokens is not None else mask.sum()
        return masked.sum() / n_tok
    if mode == "seq_mean_token_mean":
        seq_means = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)  # [N]
        return seq_means.sum() / n_seq
    if mode == "constant_norm":
        return masked.sum() / (n_seq * (max_tokens if max_tokens is not None else per_token.shape[-1]))
    raise ValueError(f"unknown aggregation {mode!r}")


def sequence_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """GSPO's length-normalised sequence ratio, exp(mean of a sequence's token log-ratios), spread over
    its tokens: [N, T] -> [N, T] (with the gradient of every token's log-ratio / |y|)."""
    mask_f = mask.to(log_ratio.dtype)
    mean = (log_ratio * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0)  # [N]
    return torch.exp(mean)[:, None].expand_as(log_ratio)


def tis_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float, level: Level):
    """Truncated importance sampling: min(π_old / π_sampler, cap) per token ('token') or for the whole
    sequence ('sequence': the product of its tokens' ratios), no gradient. Returns (weights [N, T],
    truncated bool [N, T])."""
    log_w = (old_logprobs - sampler_logprobs).detach()
    if level == "sequence":
        log_w = (log_w * mask.to(log_w.dtype)).sum(-1, keepdim=True).expand_as(log_w)
    w = torch.exp(log_w.clamp(max=_KL_LOG_RATIO_BOUND))
    return w.clamp(max=cap), w > cap


def ppo_clip_objective(
    ratio: Tensor,
    adv: Tensor,
    logprobs: Tensor,
    epsilon_low: float,
    epsilon_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped surrogate min(ρA, clip(ρ)A), with `dual_clip` bounding it at dual_clip·A where A < 0.
    Returns (term [N, T], clipped: where the clip binds, capped: where the dual clip does)."""
    surrogate, clipped = _ppo_clip(ratio, adv, epsilon_low, epsilon_high)
    capped = torch.zeros_like(clipped)
    if dual_clip is not None:
        floor = dual_clip * adv  # [N, 1]; only binds where A < 0
        capped = (adv < 0) & (surrogate < floor)
        surrogate = torch.where(capped, floor.expand_as(surrogate), surrogate)
    return surrogate, clipped, capped


def cispo_objective(
    ratio: Tensor,
    adv: Tensor,
    logprobs: Tensor,
    epsilon_low: float,
    epsilon_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO: sg(clip(ρ, 1-ε_low, 1+ε_high))·A·log π, the weight clipped, never the gradient (`dual_clip`
    does not apply). Returns (term, clipped, capped: none)."""
    bounded = ratio.detach().clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    clipped = bounded != ratio.detach()
    return bounded * adv * logprobs, clipped, torch.zeros_like(clipped)


OBJECTIVES = {"ppo_clip": ppo_clip_objective, "cispo": cispo_objective}


@dataclass
class LossInputs:
    """One micro-batch's tensors for the loss: per-token [N, T] (`mask` 1 on completion tokens), advantages
    [N]. `old_logprobs`: π_old, the ratio's denominator; `sampler_logprobs`: the behaviour policy (TIS);
    `ref_logprobs`: the reference (None when β = 0); totals: the whole step's normalisers."""

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    ref_logprobs: Tensor | None = None
    sampler_logprobs: Tensor | None = None
    total_sequences: int | None = None
    total_tokens: int | float | None = None


class LossSettings(Protocol):
    """The loss's settings by name, as the [grpo] section holds them (any object with these fields)."""

    epsilon_low: float
    epsilon_high: float
    beta: float
    kl_estimator: Literal["k3", "k2", "k1"]
    aggregation: Aggregation
    dual_clip: float | None
    tis_cap: float | None
    tis_level: Level
    ratio_level: Level
    loss: Literal["ppo_clip", "cispo"]


def loss_of(x: LossInputs, s: LossSettings, max_tokens: int | None = None) -> tuple[Tensor, dict[str, float]]:
    """grpo_loss on `x` with the settings `s` (`max_tokens`: constant_norm's per-sequence length)."""
    return grpo_loss(
        x.logprobs, x.old_logprobs, x.ref_logprobs, x.advantages, x.mask,
        epsilon_low=s.epsilon_low, epsilon_high=s.epsilon_high, beta=s.beta, kl_estimator=s.kl_estimator,
        aggregation=s.aggregation, max_tokens=max_tokens, dual_clip=s.dual_clip,
        sampler_logprobs=x.sampler_logprobs, tis_cap=s.tis_cap, tis_level=s.tis_level,
        ratio_level=s.ratio_level, loss_type=s.loss,
        total_sequences=x.total_sequences, total_tokens=x.total_tokens,
    )  # fmt: skip


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.04,
    kl_estimator: Literal["k3", "k2", "k1"] = "k3",
    aggregation: Aggregation = "seq_mean_token_mean",
    max_tokens: int | None = None,
    dual_clip: float | None = None,
    sampler_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    tis_level: Level = "token",
    ratio_level: Level = "token",
    loss_type: Literal["ppo_clip", "cispo"] = "ppo_clip",
    total_sequences: int | None = None,
    total_tokens: int | float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """loss = -aggregate(w · surrogate - β·KL). Per-token tensors [N, T], advantages [N].

    `old_logprobs` is π_old, the policy the ratio ρ = π/π_old is taken against: the sampler's
    (one optimizer step per batch, docs/design.md §4), or the learner's own
    (`grpo.old_logprobs = "recompute"`).
    With the sampler's, vLLM and the trainer differ in kernels and ρ can be large where they disagree;
    `dual_clip` bounds the surrogate at dual_clip·A for negative advantages, so one such token cannot
    dominate the step (the clip at 1+ε_high already bounds positive ones).

    `sampler_logprobs` (the behaviour policy) with `tis_cap`: each token's term is weighted by
    w = min(π_old / π_sampler, tis_cap), no gradient (TIS; with π_old the sampler's, w = 1). When π_old is
    a proximal policy of the learner's, this is AReaL's decoupled PPO: ρ = π/π_prox clipped, times the
    capped π_prox/π_behaviour. `ratio_level = "sequence"`: ρ is GSPO's sequence ratio, clipped per
    sequence. `loss_type = "cispo"`: the term is sg(clip(ρ, 1-ε_low, 1+ε_high))·A·log π (the weight is
    clipped, never the gradient; `dual_clip` does not apply). `ref_logprobs` may be None when β = 0.
    Returns (loss, metrics); metrics are token means over `mask` (floats, detached), except "*_max".
    """
    mask_f = mask.to(logprobs.dtype)
    adv = advantages[:, None]  # [N, 1]
    log_ratio = logprobs - old_logprobs
    ratio = sequence_ratio(log_ratio, mask) if ratio_level == "sequence" else torch.exp(log_ratio)
    if loss_type not in OBJECTIVES:
        raise ValueError(f"unknown loss type {loss_type!r}")
    surrogate, clipped, capped = OBJECTIVES[loss_type](
        ratio, adv, logprobs, epsilon_low, epsilon_high, dual_clip
    )
    truncated = torch.zeros_like(capped)
    weights = None
    if tis_cap is not None:
        if sampler_logprobs is None:
            raise ValueError("tis_cap needs sampler_logprobs")
        weights, truncated = tis_weights(old_logprobs, sampler_logprobs, mask, tis_cap, tis_level)
        surrogate = weights * surrogate
    objective = surrogate
    kl = None
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, kl_estimator)
        if beta != 0.0:
            objective = objective - beta * kl
    elif beta != 0.0:
        raise ValueError("beta > 0 needs ref_logprobs")
    loss = -aggregate(
        objective, mask, aggregation, max_tokens, total_sequences=total_sequences, total_tokens=total_tokens
    )

    with torch.no_grad():
        n = mask_f.sum().clamp(min=1.0)
        tmean = lambda x: float((x.to(mask_f.dtype) * mask_f).sum() / n)
        behaviour = sampler_logprobs if sampler_logprobs is not None else old_logprobs
        metrics = {
            "ratio/mean": tmean(ratio),
            "ratio/clipfrac": tmean(clipped),
            "ratio/capfrac": tmean(capped),
            "sampler/logp_diff": tmean((logprobs - behaviour).abs()),
            "sampler/kl": tmean(kl_penalty(behaviour, logprobs, "k3")),
            "tokens": float(mask_f.sum()),
        }
        if weights is not None:
            metrics["is/weight_mean"] = tmean(weights)
            metrics["is/weight_max"] = float((weights * mask_f).max()) if mask_f.any() else 0.0
            metrics["is/truncated"] = tmean(truncated)
        if sampler_logprobs is not None and sampler_logprobs is not old_logprobs:
            metrics["old/logp_diff"] = tmean((old_logprobs - sampler_logprobs).abs())
        if kl is not None:
            metrics["kl/ref"] = tmean(kl)
    return loss, metrics


class _ChunkedTokenLogprob(torch.autograd.Function):
    """log softmax(logits[row])[token] in fp32, one chunk of picks at a time, saving only the logits.

    Autograd through a plain chunked loop would keep every chunk's fp32 [rows, V] intermediates alive
    for backward, which is exactly the memory chunking is meant to save; the backward here recomputes
    softmax per chunk: with z = logits / τ, d logp / d logits = (onehot(token) - softmax(z)) / τ.
    `rows` None: pick i reads logits row i; else row rows[i], and a row read by several picks (the last
    prompt position of a packed group predicts every completion's first token) sums their gradients.
    """

    @staticmethod
    def forward(
        ctx, logits: Tensor, rows: Tensor | None, token_ids: Tensor, chunk_size: int, temperature: float
    ):
        out = torch.empty(token_ids.shape[0], dtype=torch.float32, device=logits.device)  # [Q]
        for s in range(0, token_ids.shape[0], chunk_size):
            picked_rows = logits[s : s + chunk_size] if rows is None else logits[rows[s : s + chunk_size]]
            chunk = picked_rows.float() / temperature  # [c, V]: upcast, then divide
            picked = chunk.gather(-1, token_ids[s : s + chunk_size, None]).squeeze(-1)
            out[s : s + chunk_size] = picked - torch.logsumexp(chunk, dim=-1)
        ctx.save_for_backward(logits, rows, token_ids)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # [Q] -> [M, V]
        logits, rows, token_ids = ctx.saved_tensors
        c, t = ctx.chunk_size, ctx.temperature
        grad = torch.empty_like(logits) if rows is None else torch.zeros_like(logits)
        for s in range(0, token_ids.shape[0], c):
            picked_rows = logits[s : s + c] if rows is None else logits[rows[s : s + c]]
            g = grad_out[s : s + c, None].float() / t  # [c, 1]
            chunk_grad = -torch.softmax(picked_rows.float() / t, dim=-1) * g
            chunk_grad.scatter_add_(-1, token_ids[s : s + c, None], g)
            if rows is None:
                grad[s : s + c] = chunk_grad.to(grad.dtype)
            else:
                grad.index_add_(0, rows[s : s + c], chunk_grad.to(grad.dtype))
        return grad, None, None, None, None


def _entropy(logits: Tensor, rows: Tensor | None, n: int, chunk_size: int, temperature: float) -> Tensor:
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for s in range(0, n, chunk_size):
            picked_rows = logits[s : s + chunk_size] if rows is None else logits[rows[s : s + chunk_size]]
            lp = torch.log_softmax(picked_rows.float() / temperature, dim=-1)  # [c, V]
            out[s : s + chunk_size] = -(lp.exp() * lp).sum(-1)
    return out


def token_logprobs(
    logits: Tensor, token_ids: Tensor, *, chunk_size: int = 256, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """[N, T, V] logits, [N, T] ids -> (logprobs [N, T] fp32 with grad, entropy [N, T] fp32 detached)
    of softmax(logits / temperature).

    Never materialises fp32 log-softmax over all of [N, T, V] (a 151,936 vocabulary costs 0.6 MB per
    token in fp32): `chunk_size` rows of the flattened [N*T, V] are upcast at a time, forward and backward.
    The temperature divides the upcast rows, as vLLM's sampler does: dividing bf16 logits first would
    round them again (bf16 keeps 8 bits of mantissa) and move the log-probs away from the sampler's.
    """
    N, T, V = logits.shape
    flat = logits.reshape(N * T, V)  # [N*T, V]
    ids = token_ids.reshape(N * T).long()
    logprobs = _ChunkedTokenLogprob.apply(flat, None, ids, chunk_size, temperature).view(N, T)
    return logprobs, _entropy(flat, None, N * T, chunk_size, temperature).view(N, T)


def picked_logprobs(
    logits: Tensor, rows: Tensor, token_ids: Tensor, *, chunk_size: int = 256, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """[M, V] logits, [Q] row of each pick, [Q] ids -> (logprobs [Q] with grad, entropy [Q] detached):
    token_ids[i]'s log-prob under softmax(logits[rows[i]] / temperature), chunked as token_logprobs."""
    ids = token_ids.long()
    logprobs = _ChunkedTokenLogprob.apply(logits, rows, ids, chunk_size, temperature)
    return logprobs, _entropy(logits, rows, ids.shape[0], chunk_size, temperature)
