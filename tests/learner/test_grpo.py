"""The GRPO math against hand-worked numbers (docs/design.md §4). Each expected value is derived in a
comment."""

import math

import pytest
import torch
from torch.testing import assert_close

from learner.grpo import (
    aggregate,
    clipped_surrogate,
    degenerate_groups,
    group_advantages,
    grpo_loss,
    kl_penalty,
    p_degenerate,
    token_logprobs,
)

# ---------------------------------------------------------------- advantages


def test_janets_ducks_population_std():
    # r = (1,0,1,0): mean 0.5; population std = sqrt(mean((±0.5)^2)) = 0.5 -> A = ±0.5/0.5 = ±1
    A = group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), eps=0.0)
    assert_close(A, torch.tensor([[1.0, -1.0, 1.0, -1.0]]))


def test_janets_ducks_bessel_std_is_13_percent_smaller():
    # Bessel std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735 -> A = 0.5 / 0.57735 = ±0.866025
    A = group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), std="bessel", eps=0.0)
    assert_close(A, torch.tensor([[0.866025, -0.866025, 0.866025, -0.866025]]), atol=1e-6, rtol=0)


def test_default_eps_is_tiny_next_to_the_std():
    # eps = 1e-6: A = 0.5 / (0.5 + 1e-6) = 0.999998
    A = group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    assert_close(A, torch.full((1, 4), 0.999998) * torch.tensor([1.0, -1, 1, -1]), atol=1e-7, rtol=0)


@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("value", [1.0, 0.0, 0.1, 0.7])
def test_all_equal_group_is_exactly_zero(eps, value):
    # r = (v,v,v,v): r - mean = 0, std = 0; with eps = 0 that is 0/0 = NaN unless guarded.
    rewards = torch.full((1, 4), value)
    for scale in ("group", "none"):
        for baseline in ("mean", "rloo"):
            A = group_advantages(rewards, eps=eps, scale=scale, baseline=baseline)
            assert torch.equal(A, torch.zeros(1, 4)), (scale, baseline, A)
    assert degenerate_groups(rewards).tolist() == [True]


def test_degenerate_fraction_of_a_batch():
    rewards = torch.tensor([[1.0, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]])
    assert degenerate_groups(rewards).tolist() == [True, False, True]  # fraction 2/3


def test_dr_grpo_scale_none_is_centered_reward():
    # r = (1,0,0,0): mean 0.25 -> A = (0.75, -0.25, -0.25, -0.25), no division.
    A = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), scale="none")
    assert_close(A, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_rloo_is_g_over_g_minus_1_times_mean_baseline():
    # r = (1,0,0,0), G=4: RLOO A_0 = 1 - mean(0,0,0) = 1 = 4/3 * 0.75; A_1 = 0 - 1/3 = 4/3 * -0.25.
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert_close(
        group_advantages(r, scale="none", baseline="rloo"), torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]])
    )
    g = torch.Generator().manual_seed(0)
    for G in (2, 4, 8, 16):
        r = torch.rand(32, G, generator=g)
        rloo = group_advantages(r, scale="none", baseline="rloo")
        mean = group_advantages(r, scale="none", baseline="mean")
        assert_close(rloo, G / (G - 1) * mean)


def test_group_size_one_is_rejected():
    with pytest.raises(ValueError, match="group size 1"):
        group_advantages(torch.tensor([[1.0]]))


# ---------------------------------------------------------------- degenerate probability

# p^G + (1-p)^G, computed by hand: e.g. p=0.9, G=4: 0.6561 + 0.0001 = 0.6562 (65.6 %);
# p=0.5, G=8: 2 * 0.5^8 = 0.0078 (0.78 %); p=0.3, G=4: 0.0081 + 0.2401 = 0.2482.
DEGENERATE_TABLE = {
    (0.1, 4): 65.62, (0.1, 8): 43.05, (0.1, 16): 18.53,
    (0.3, 4): 24.82, (0.3, 8): 5.77, (0.3, 16): 0.33,
    (0.5, 4): 12.50, (0.5, 8): 0.78, (0.5, 16): 0.00,
    (0.7, 4): 24.82, (0.7, 8): 5.77, (0.7, 16): 0.33,
    (0.9, 4): 65.62, (0.9, 8): 43.05, (0.9, 16): 18.53,
}  # fmt: skip


@pytest.mark.parametrize(("p", "G"), sorted(DEGENERATE_TABLE))
def test_p_degenerate_table(p, G):
    assert abs(100 * p_degenerate(p, G) - DEGENERATE_TABLE[p, G]) < 0.1


@pytest.mark.parametrize(("p", "G"), [(0.9, 4), (0.5, 8), (0.3, 4), (0.1, 16)])
def test_p_degenerate_matches_monte_carlo(p, G):
    # 200k Bernoulli groups: the std of the estimate is sqrt(q(1-q)/2e5) <= 0.0012, so 0.005 is > 4 sigma.
    g = torch.Generator().manual_seed(1234)
    rewards = (torch.rand(200_000, G, generator=g) < p).float()
    observed = degenerate_groups(rewards).float().mean().item()
    assert abs(observed - p_degenerate(p, G)) < 0.005


# ---------------------------------------------------------------- surrogate and clipping


def _four_clip_cases():
    # ρ = (1.5, 1.5, 0.5, 0.5), A = (+1, -1, +1, -1), as one token per sequence.
    ratio = torch.tensor([[1.5], [1.5], [0.5], [0.5]])
    return torch.log(ratio), torch.zeros(4, 1), torch.tensor([1.0, -1.0, 1.0, -1.0])


def test_four_clip_cases_and_clip_fraction():
    logp, old, adv = _four_clip_cases()
    surrogate, clipped = clipped_surrogate(logp, old, adv, epsilon_low=0.2, epsilon_high=0.2)
    # ρ=1.5,A=+1: min(1.5, 1.2) = 1.2 clipped;  ρ=1.5,A=-1: min(-1.5, -1.2) = -1.5
    # ρ=0.5,A=+1: min(0.5, 0.8) = 0.5;          ρ=0.5,A=-1: min(-0.5, -0.8) = -0.8 clipped
    assert_close(surrogate, torch.tensor([[1.2], [-1.5], [0.5], [-0.8]]))
    assert clipped.squeeze(1).tolist() == [True, False, False, True]
    assert clipped.float().mean().item() == 0.5


def test_clip_higher_widens_only_the_upper_bound():
    logp, old, adv = _four_clip_cases()
    # ε_high = 0.28: ρ=1.5,A=+1 -> min(1.5, 1.28) = 1.28; the lower cases are unchanged.
    surrogate, _ = clipped_surrogate(logp, old, adv, epsilon_low=0.2, epsilon_high=0.28)
    assert_close(surrogate, torch.tensor([[1.28], [-1.5], [0.5], [-0.8]]))


def test_clip_fraction_reported_by_loss():
    logp, old, adv = _four_clip_cases()
    _, metrics = grpo_loss(logp, old, None, adv, torch.ones(4, 1), beta=0.0)
    assert metrics["ratio/clipfrac"] == 0.5
    # ratio mean = (1.5 + 1.5 + 0.5 + 0.5) / 4 = 1.0
    assert metrics["ratio/mean"] == pytest.approx(1.0)


def test_dual_clip_bounds_negative_advantage_tokens():
    # ρ = 3, A = -1: PPO alone gives min(-3, -1.2) = -3; with dual_clip = 2 the surrogate is 2 * -1 = -2
    # and its gradient is zero. ρ = 3, A = +1 is already clipped at 1.2 and untouched by the cap.
    logp = torch.log(torch.tensor([[3.0], [3.0]])).requires_grad_()
    adv = torch.tensor([-1.0, 1.0])
    loss, metrics = grpo_loss(logp, torch.zeros(2, 1), None, adv, torch.ones(2, 1), beta=0.0, dual_clip=2.0)
    # loss = -mean(-2, 1.2) = 0.4
    assert loss.item() == pytest.approx(0.4)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 1))
    assert metrics["ratio/capfrac"] == 0.5


# ---------------------------------------------------------------- KL


def test_k3_hand_values():
    # u = ref - logp. u = ln2: 2 - ln2 - 1 = 0.306853; u = 0: 0; u = -ln2: 0.5 + ln2 - 1 = 0.193147
    ref = torch.tensor([[math.log(2.0), 0.0, -math.log(2.0)]])
    k3 = kl_penalty(torch.zeros(1, 3), ref, "k3")
    assert_close(k3, torch.tensor([[0.306853, 0.0, 0.193147]]), atol=1e-6, rtol=0)


def test_k1_k2_hand_values():
    ref = torch.tensor([[math.log(2.0), -1.0]])
    # k1 = -u = (-ln2, 1); k2 = u^2/2 = (ln2^2/2, 0.5)
    assert_close(kl_penalty(torch.zeros(1, 2), ref, "k1"), torch.tensor([[-math.log(2.0), 1.0]]))
    assert_close(kl_penalty(torch.zeros(1, 2), ref, "k2"), torch.tensor([[math.log(2.0) ** 2 / 2, 0.5]]))


def test_k3_is_nonnegative_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    logp, ref = -5 * torch.rand(64, 128, generator=g), -5 * torch.rand(64, 128, generator=g)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    # ...including extreme disagreement, where the unclamped e^u would overflow to inf.
    extreme = kl_penalty(torch.tensor([[-200.0, 0.0]]), torch.tensor([[0.0, -200.0]]), "k3")
    assert torch.isfinite(extreme).all() and (extreme >= 0).all()


def test_k1_and_k3_estimate_the_exact_kl_and_k3_has_lower_variance():
    # π = (0.5, 0.3, 0.2), π_ref = (0.4, 0.4, 0.2): KL(π||ref) = 0.5 ln(5/4) + 0.3 ln(3/4) = 0.025268
    pi, ref = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.4, 0.4, 0.2])
    exact = float((pi * (pi / ref).log()).sum())
    assert exact == pytest.approx(0.5 * math.log(1.25) + 0.3 * math.log(0.75))
    g = torch.Generator().manual_seed(0)
    x = torch.multinomial(pi, 400_000, replacement=True, generator=g)[None]  # [1, S] samples from π
    k1 = kl_penalty(pi.log()[x], ref.log()[x], "k1")
    k3 = kl_penalty(pi.log()[x], ref.log()[x], "k3")
    # Per-sample std of k1 is ~0.22, so the mean's std is ~0.00035: 0.002 is > 5 sigma.
    assert abs(k1.mean().item() - exact) < 0.002
    assert abs(k3.mean().item() - exact) < 0.002
    assert k3.var().item() < k1.var().item()


# ---------------------------------------------------------------- aggregation


def _two_sequences():
    # Per-token losses [1, 1] and [0, 0, 0, 0], right-padded to T = 4.
    per_token = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    return per_token, mask


def test_aggregations_hand_values():
    x, m = _two_sequences()
    assert aggregate(x, m, "token_mean").item() == pytest.approx(2 / 6)  # 2 / 6 tokens
    assert aggregate(x, m, "seq_mean_token_mean").item() == pytest.approx(0.5)  # (1 + 0) / 2
    assert aggregate(x, m, "constant_norm", max_tokens=4).item() == pytest.approx(0.25)  # 2 / (2 * 4)


def test_padding_never_counts():
    x, m = _two_sequences()
    x = x.clone()
    x[0, 2:] = 99.0  # garbage on padding positions
    assert aggregate(x, m, "token_mean").item() == pytest.approx(2 / 6)
    assert aggregate(x, m, "seq_mean_token_mean").item() == pytest.approx(0.5)


# ---------------------------------------------------------------- gradients


def test_gradient_zero_on_clipped_tokens_and_signed_by_advantage_elsewhere():
    # Tokens: (ρ=1.5, A=+1) clipped; (ρ=0.5, A=-1) clipped; (ρ=1.0, A=+1); (ρ=1.0, A=-1).
    logp = torch.log(torch.tensor([[1.5], [0.5], [1.0], [1.0]])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, _ = grpo_loss(logp, torch.zeros(4, 1), None, adv, torch.ones(4, 1), beta=0.0)
    loss.backward()
    g = logp.grad.squeeze(1)
    assert g[0] == 0 and g[1] == 0
    # loss = -mean(ρA): d loss / d logp = -ρA/4 -> descent raises log π where A > 0, lowers it where A < 0.
    assert_close(g[2:], torch.tensor([-0.25, 0.25]))


def test_kl_term_pulls_toward_reference():
    # A = 0, so only β·k3 acts: d k3/d logp = 1 - e^u; descent moves logp toward ref from both sides.
    logp = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -2.0]])
    loss, metrics = grpo_loss(logp, logp.detach(), ref, torch.zeros(1), torch.ones(1, 2), beta=0.1)
    loss.backward()
    step = -logp.grad  # gradient-descent direction
    assert step[0, 0] < 0 < step[0, 1]  # -1 moves down toward -2, -3 moves up toward -2
    assert metrics["kl/ref"] > 0


def _random_batch(seed, N=8, T=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, T, generator=g) * 3
    old = logp + 0.3 * torch.randn(N, T, generator=g)
    ref = logp + 0.3 * torch.randn(N, T, generator=g)
    adv = torch.randn(N, generator=g)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return logp, old.clamp(max=0), ref.clamp(max=0), adv, mask


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean", "constant_norm"])
def test_shards_sum_to_the_whole_batch(aggregation):
    # Two data-parallel shards or two accumulation micro-batches: each normalised by the *global*
    # counts, their losses and gradients add up to the whole batch's (docs/design.md §4, last point).
    logp, old, ref, adv, mask = _random_batch(0)
    kw = dict(beta=0.04, aggregation=aggregation, max_tokens=6, dual_clip=2.0)
    whole_in = logp.clone().requires_grad_()
    whole, _ = grpo_loss(whole_in, old, ref, adv, mask, **kw)
    whole.backward()

    totals = dict(total_sequences=8, total_tokens=int(mask.sum()))
    shard_in = logp.clone().requires_grad_()
    parts = [
        grpo_loss(shard_in[s], old[s], ref[s], adv[s], mask[s], **kw, **totals)[0]
        for s in (slice(0, 3), slice(3, 8))  # uneven on purpose
    ]
    sum(parts).backward()
    assert_close(sum(parts), whole)
    assert_close(shard_in.grad, whole_in.grad)


# ---------------------------------------------------------------- off-policy corrections


def _loss(logp, old, adv, mask=None, **kw):
    mask = torch.ones_like(logp) if mask is None else mask
    return grpo_loss(logp, old, None, adv, mask, beta=0.0, **kw)


def test_tis_weights_each_token_by_the_truncated_old_over_sampler_ratio():
    # Recomputed π_old = π_θ detached: ρ = 1 in value. Token 1: π_old 0.5, π_sampler 0.25 -> w = 2, cut
    # to the cap 1.5; token 2: 0.2 / 0.4 = 0.5, kept. A = +1. Objective (1.5·1 + 0.5·1) / 2 tokens = 1.0,
    # loss -1.0; d loss / d log π_t = -w_t·ρ_t·A / 2 = (-0.75, -0.25).
    logp = torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_()
    sampler = torch.log(torch.tensor([[0.25, 0.4]]))
    loss, m = _loss(logp, logp.detach(), torch.tensor([1.0]), sampler_logprobs=sampler, tis_cap=1.5)
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    assert_close(logp.grad, torch.tensor([[-0.75, -0.25]]))
    # weights 1.5 and 0.5: mean 1.0, max 1.5, one of two truncated; |log π_old - log π_sampler| = ln 2
    assert m["is/weight_mean"] == pytest.approx(1.0) and m["is/weight_max"] == pytest.approx(1.5)
    assert m["is/truncated"] == 0.5 and m["old/logp_diff"] == pytest.approx(math.log(2))
    assert m["ratio/mean"] == 1.0 and m["ratio/clipfrac"] == 0.0


def test_sequence_tis_weights_a_sequence_by_the_product_of_its_ratios():
    # The same tokens as one sequence: 2 · 0.5 = 1 -> w = 1 on both (< 1.5, none truncated): loss -1.0,
    # gradient -1·1·1/2 = -0.5 each. With a cap of 0.8: w = 0.8 on both, both truncated, loss -0.8.
    logp = torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_()
    sampler = torch.log(torch.tensor([[0.25, 0.4]]))
    kw = {"sampler_logprobs": sampler, "tis_level": "sequence"}
    loss, m = _loss(logp, logp.detach(), torch.tensor([1.0]), tis_cap=1.5, **kw)
    assert loss.item() == pytest.approx(-1.0) and m["is/truncated"] == 0.0
    loss.backward()
    assert_close(logp.grad, torch.tensor([[-0.5, -0.5]]))
    loss, m = _loss(logp, logp.detach(), torch.tensor([1.0]), tis_cap=0.8, **kw)
    assert loss.item() == pytest.approx(-0.8) and m["is/truncated"] == 1.0


def test_tis_reduces_to_plain_grpo_on_policy_and_to_plain_importance_sampling_uncapped():
    logp, old, adv = _four_clip_cases()
    plain, _ = _loss(logp, old, adv)
    # π_old = π_sampler (on-policy, or old_logprobs = "sampler"): every weight is 1, whatever the cap
    same, m = _loss(logp, old, adv, sampler_logprobs=old, tis_cap=1.01)
    assert same.item() == pytest.approx(plain.item()) and m["is/weight_mean"] == 1.0
    # C = ∞: the weight is the whole ratio π_old/π_sampler (here e^0.3 on every token) and scales the loss
    uncapped, m = _loss(logp, old, adv, sampler_logprobs=old - 0.3, tis_cap=1e9)
    assert uncapped.item() == pytest.approx(math.exp(0.3) * plain.item()) and m["is/truncated"] == 0.0


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weights_by_the_behaviour_one():
    # π_θ = 1.1·π_prox (log-ratio ln 1.1), π_prox = 2·π_behaviour. ρ = 1.1 is inside [0.8, 1.2]: the
    # surrogate is 1.1·A with A = +1; w = min(2, 3) = 2 -> objective 2.2, loss -2.2, gradient -w·ρ·A = -2.2.
    # With the cap at 1.5: w = 1.5 (truncated), objective 1.65.
    prox = torch.tensor([[math.log(0.4)]])
    logp = (prox + math.log(1.1)).requires_grad_()
    behaviour = prox - math.log(2.0)
    loss, m = _loss(logp, prox, torch.tensor([1.0]), sampler_logprobs=behaviour, tis_cap=3.0)
    assert loss.item() == pytest.approx(-2.2)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-2.2)
    assert m["ratio/mean"] == pytest.approx(1.1) and m["ratio/clipfrac"] == 0.0
    loss, m = _loss(logp, prox, torch.tensor([1.0]), sampler_logprobs=behaviour, tis_cap=1.5)
    assert loss.item() == pytest.approx(-1.65) and m["is/truncated"] == 1.0


def test_gspo_takes_one_length_normalised_ratio_per_sequence_and_clips_it():
    # Token log-ratios (0.3, -0.3), A = +1, ε = 0.2 both sides. Per token: ρ = (1.3499, 0.7408) ->
    # min(1.3499, 1.2) = 1.2 and min(0.7408, 0.8) = 0.7408: objective (1.2 + 0.7408)/2 = 0.9704.
    # Per sequence: s = exp(mean(0.3, -0.3)) = 1 on both tokens -> objective mean(s·A, s·A) = s·A = 1,
    # unclipped; d s / d log π_t = s/|y| = 0.5 -> d loss / d log π_t = -0.5. Per token: 0 for the clipped
    # one, -ρ·A/2 = -0.7408/2 = -0.3704 for the other.
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.3, -0.3]], requires_grad=True)
    token, _ = _loss(logp, old, torch.tensor([1.0]))
    assert token.item() == pytest.approx(-(1.2 + math.exp(-0.3)) / 2, abs=1e-6)
    token.backward()
    assert_close(logp.grad, torch.tensor([[0.0, -math.exp(-0.3) / 2]]))
    logp.grad = None
    seq, m = _loss(logp, old, torch.tensor([1.0]), ratio_level="sequence")
    assert seq.item() == pytest.approx(-1.0) and m["ratio/clipfrac"] == 0.0
    seq.backward()
    assert_close(logp.grad, torch.tensor([[-0.5, -0.5]]))
    # GSPO's own clip range (3e-4, 4e-4): log-ratios (0.2, 0.2, 0.2) -> s = e^0.2 = 1.2214 -> clipped at
    # 1.0004 for A = +1: objective 1.0004 and no gradient, every token counted as clipped.
    logp = torch.full((1, 3), 0.2, requires_grad=True)
    seq, m = _loss(
        logp,
        torch.zeros(1, 3),
        torch.tensor([1.0]),
        ratio_level="sequence",
        epsilon_low=3e-4,
        epsilon_high=4e-4,
    )
    assert seq.item() == pytest.approx(-1.0004) and m["ratio/clipfrac"] == 1.0
    seq.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 3))


def test_cispo_clips_the_weight_and_keeps_the_gradient_ppo_would_zero():
    # ρ = (1.5, 0.5), A = +1, ε = 0.2: weights sg(clip(ρ)) = (1.2, 0.8). Objective per token w·A·log π:
    # (1.2·ln 1.5 + 0.8·ln 0.5)/2 = (0.486558 - 0.554518)/2 = -0.033980 -> loss +0.033980.
    # d loss / d log π = -w·A/2 = (-0.6, -0.4); PPO gives (0, -0.25): its clip zeroes the first token.
    logp = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()
    loss, m = _loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), loss_type="cispo")
    assert loss.item() == pytest.approx(0.033980, abs=1e-6) and m["ratio/clipfrac"] == 1.0
    loss.backward()
    assert_close(logp.grad, torch.tensor([[-0.6, -0.4]]))
    ppo = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()
    _loss(ppo, torch.zeros(1, 2), torch.tensor([1.0]))[0].backward()
    assert_close(ppo.grad, torch.tensor([[0.0, -0.25]]))


# ---------------------------------------------------------------- chunked logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 5, 7, 1000])
def test_chunked_logprobs_match_plain_log_softmax(chunk_size, temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g, dtype=torch.float64).float()
    ids = torch.randint(0, 50, (3, 7), generator=g)
    upstream = torch.randn(3, 7, generator=g)

    a = logits.clone().requires_grad_()
    plain = torch.log_softmax(a / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)
    (plain * upstream).sum().backward()
    z = logits / temperature
    plain_entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)

    b = logits.clone().requires_grad_()
    chunked, entropy = token_logprobs(b, ids, chunk_size=chunk_size, temperature=temperature)
    (chunked * upstream).sum().backward()

    assert_close(chunked, plain)
    assert_close(b.grad, a.grad)
    assert_close(entropy, plain_entropy)
    assert not entropy.requires_grad


def test_chunked_logprobs_upcast_bf16_logits():
    # bf16 logits in, fp32 logprobs out, equal to the fp32 computation on the same (rounded) logits.
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 300, generator=g).bfloat16()
    ids = torch.randint(0, 300, (2, 4), generator=g)
    lp, _ = token_logprobs(logits, ids, chunk_size=3)
    assert lp.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    assert_close(lp, ref)


def test_bf16_logprobs_upcast_before_the_temperature_like_the_sampler():
    # The model's bf16 logits, at the sampler's temperature: vLLM upcasts, then divides. Dividing in
    # bf16 first rounds every logit again (to 8 bits of mantissa), which moved the learner's log-probs
    # of fixed tokens away from the fp32 reference. Upcasting first leaves only the model's own rounding.
    g = torch.Generator().manual_seed(2)
    exact = torch.randn(4, 16, 2000, generator=g, dtype=torch.float64) * 4  # [N, T, V]
    ids = torch.randint(0, 2000, (4, 16), generator=g)
    model_logits = exact.bfloat16()
    t = 0.7
    reference = torch.log_softmax(model_logits.double() / t, -1).gather(-1, ids[..., None]).squeeze(-1)
    now, _ = token_logprobs(model_logits, ids, chunk_size=16, temperature=t)
    before, _ = token_logprobs(model_logits / t, ids, chunk_size=16)  # the old order: divide in bf16
    err_now = (now.double() - reference).abs().mean().item()
    err_before = (before.double() - reference).abs().mean().item()
    assert err_now < 1e-5  # fp32 arithmetic on the same bf16 inputs
    assert err_before > 100 * err_now, (err_before, err_now)


def test_a_step_sums_token_weighted_metrics_and_maxes_the_maxima():
    from learner.step import _combine

    # two micro-batches (or ranks): token-weighted sums add, "*_max" takes the larger, the first is kept
    assert _combine("is/weight_mean", 3.0, 1.5) == 4.5
    assert _combine("is/weight_max", 1.2, 0.7) == 1.2 and _combine("is/weight_max", 0.7, 1.2) == 1.2
    assert _combine("is/weight_max", None, 0.7) == 0.7


@pytest.mark.parametrize("loss", ["ppo_clip", "cispo"])
def test_the_loss_from_the_grpo_section_is_grpo_loss_with_those_settings(loss):
    """loss_of(LossInputs, [grpo] section): every setting reaches grpo_loss under its own name (asymmetric
    clips, the dual clip, TIS and the KL all bind on these numbers, so a crossed wire changes the loss)."""
    from learner.grpo import LossInputs, loss_of
    from shared.config import TandemConfig

    torch.manual_seed(0)
    n, t = 4, 6
    lp, old, ref, sampler = (torch.randn(n, t) * 0.5 - 1 for _ in range(4))
    adv, mask = torch.tensor([1.0, -1.0, 0.5, -0.5]), (torch.rand(n, t) > 0.2).float()
    settings = {"epsilon_low": 0.1, "epsilon_high": 0.3, "beta": 0.05, "kl_estimator": "k2",
                "aggregation": "constant_norm", "dual_clip": 1.5, "tis_cap": 1.2, "tis_level": "sequence",
                "ratio_level": "token", "loss": loss}  # fmt: skip
    if loss == "cispo":  # (the dual clip is PPO's; the config refuses it with CISPO)
        settings["dual_clip"] = None
    g = TandemConfig.model_validate({"grpo": {**settings, "old_logprobs": "recompute"}}).grpo
    got, got_m = loss_of(LossInputs(lp, old, adv, mask, ref, sampler, 8, 40), g, max_tokens=10)
    kw = {k: v for k, v in settings.items() if k != "loss"}
    want, want_m = grpo_loss(
        lp, old, ref, adv, mask, **kw, max_tokens=10, sampler_logprobs=sampler, loss_type=loss,
        total_sequences=8, total_tokens=40,
    )  # fmt: skip
    assert got.item() == want.item() and got_m == want_m
