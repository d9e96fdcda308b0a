"""One GRPO step's math on a batch: the completions' log-probs under the policy (and the reference), each
micro-batch's share of the loss with its metrics, and the optimizer step over all ranks' shards."""

from __future__ import annotations

import torch

from learner.attention import with_layout
from learner.batch import MicroBatch, PackedBatch, collate, is_degenerate, pack, sequences, shard
from learner.engine import gather_objects, reference_policy
from learner.grpo import LossInputs, loss_of, picked_logprobs, token_logprobs
from shared.config import TandemConfig
from shared.protocol import ScoredGroup


def completion_logprobs(model, b: MicroBatch | PackedBatch, dtype, temperature: float, chunk_size: int):
    """Log-probs [n, T] (with grad) and entropies [n, T] of the batch's completion tokens under
    softmax(logits / temperature): the sampler drew from that distribution, so it is the policy whose
    ratio and KL we take. A PackedBatch gives the same values as the MicroBatch of the same completions
    (tests/learner/test_shared_prompt.py), from fewer tokens and only the logits that are scored."""
    if isinstance(b, PackedBatch):
        logits = model(
            input_ids=b.input_ids,
            position_ids=b.position_ids,
            # with the rows' segments for the "tandem_packed" attention (learner/attention.py)
            attention_mask=with_layout(b.additive_mask(dtype), b.layout),
            logits_to_keep=b.keep,
            use_cache=False,
        ).logits  # [R, K, V]
        lp, entropy = picked_logprobs(
            logits.reshape(-1, logits.shape[-1]),
            b.rows,
            b.targets,
            chunk_size=chunk_size,
            temperature=temperature,
        )  # [Q]: every real completion token, row-major over [n, T]
        real = b.tokens.bool()  # [n, T], the same row-major order as the picks

        def spread(x):
            return x.new_zeros(real.shape).masked_scatter(real, x)

        return spread(lp), spread(entropy)
    logits = model(
        input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False
    ).logits  # [n, L, V]
    lp, entropy = token_logprobs(
        logits[:, :-1], b.input_ids[:, 1:], chunk_size=chunk_size, temperature=temperature
    )  # [n, L-1]
    return lp.gather(1, b.positions), entropy.gather(1, b.positions)


def micro_loss(
    engine,
    b: MicroBatch | PackedBatch,
    cfg: TandemConfig,
    total_sequences: int,
    total_tokens: int,
    version: int | None = None,
):
    """One micro-batch's share of the step's GRPO loss (global normalisers), with its metrics: token
    means over its completion tokens (policy entropy among them) and their count under "tokens".
    `version`: the policy version of the weights this step starts from; the tokens that version sampled
    give "served/gap_sum" and "served/tokens", |log π - log π_sampler| summed over their tokens
    (the served-policy check: both are the same weights' log-probs, so they differ by the kernels only)."""
    g, lc, temperature = cfg.grpo, cfg.learner, cfg.sampling.temperature
    module = getattr(engine, "module", engine)
    dtype = module.get_input_embeddings().weight.dtype
    logprobs, entropy = completion_logprobs(engine, b, dtype, temperature, lc.logprob_chunk_size)
    ref_logprobs = None
    if g.beta > 0:
        with reference_policy(engine) as ref_model:
            ref_logprobs, _ = completion_logprobs(ref_model, b, dtype, temperature, lc.logprob_chunk_size)
    # "recompute": π_old is the policy at this step's weights, which every micro-batch of the step sees
    # (the optimizer steps once, after the last), so its log-probs are these, detached: no extra forward.
    old = logprobs.detach() if g.old_logprobs == "recompute" else b.sampler_logprobs
    x = LossInputs(
        logprobs, old, b.advantages, b.mask, ref_logprobs, b.sampler_logprobs, total_sequences, total_tokens
    )
    loss, m = loss_of(x, g, max_tokens=cfg.sampling.max_new_tokens)
    m["policy/entropy"] = float((entropy * b.mask).sum() / max(m["tokens"], 1.0))
    if version is not None:
        on = b.mask * (b.versions == version).to(b.mask.dtype)  # the tokens this version sampled
        m["served/gap_sum"] = float(((logprobs.detach() - b.sampler_logprobs).abs() * on).sum())
        m["served/tokens"] = float(on.sum())
    return loss, m


def train_step(
    engine,
    groups: list[ScoredGroup],
    cfg: TandemConfig,
    rank: int,
    world: int,
    pad_id: int,
    version: int | None = None,
) -> dict:
    """One optimizer step over all ranks' shards of the step's B x G completions. `version`: the policy
    version of the weights the step starts from, for the served-policy check ("served/logp_gap": the mean
    |log π - log π_sampler| over the tokens that version sampled, None when there are none)."""
    lc = cfg.learner
    seqs, advantages = sequences(groups, cfg.grpo)
    total_tokens = sum(s.model_tokens for s in seqs)  # environment tokens are context, scored nowhere
    device = next(p.device for p in engine.module.parameters() if p.requires_grad)
    sums: dict[str, float] = {}
    for micro in shard(seqs, rank, world, lc.micro_batch_size):
        b = (pack if lc.shared_prompt else collate)(micro, pad_id).to(device)
        loss, m = micro_loss(engine, b, cfg, len(seqs), total_tokens, version)
        # Each shard's loss is its share of the whole step's loss (global normalisers). DeepSpeed divides
        # by the accumulation steps and averages over ranks; undo both so gradients are those of the sum.
        engine.backward(loss * lc.grad_accum * world)
        engine.step()
        n = m.pop("tokens")
        m["loss"] = loss.item()
        for k, v in m.items():
            sums[k] = _combine(k, sums.get(k), v if _summed(k) else v * n)
        sums["tokens"] = sums.get("tokens", 0.0) + n
    merged: dict[str, float] = {}
    for part in gather_objects(sums):
        for k, v in part.items():
            merged[k] = _combine(k, merged.get(k), v)
    tokens = max(merged.pop("tokens"), 1.0)
    metrics = {k: (v if _summed(k) else v / tokens) for k, v in merged.items()}
    if version is not None:
        gap, on = metrics.pop("served/gap_sum"), metrics["served/tokens"]
        metrics["served/logp_gap"] = gap / on if on else None
    metrics.setdefault("kl/ref", None)  # beta = 0: the reference pass is skipped, so no KL to report
    live = advantages[~torch.tensor([is_degenerate(gr) for gr in groups])]
    metrics["advantage/mean"] = float(live.mean()) if live.numel() else 0.0
    metrics["advantage/std"] = float(live.std(correction=0)) if live.numel() else 0.0
    metrics["grad_norm"] = float(engine.get_global_grad_norm() or 0.0)  # before clipping, all ranks
    return metrics


def _summed(key: str) -> bool:
    """Metrics kept as sums over micro-batches and ranks (the loss, the served-policy sums) or maxima,
    rather than token-weighted means."""
    return key == "loss" or key.startswith("served/") or key.endswith("_max")


def _combine(key: str, total: float | None, value: float) -> float:
    """Metrics summed over micro-batches and ranks (token-weighted, or the loss), or maxed ("*_max")."""
    if total is None:
        return value
    return max(total, value) if key.endswith("_max") else total + value
