"""Episodes of several turns on the learner: the environment's tokens are context, scored nowhere. Both
paths (plain and shared-prompt) are checked against a loss written out here from the model's own
log-probs, so a mask that lets environment tokens into the loss, or sampler log-probs put at the wrong
tokens, fails."""

import math

import pytest
import torch

from learner.batch import Sequence, collate, pack, sequences
from learner.step import micro_loss
from shared.config import GRPOConfig
from shared.protocol import Completion, ScoredGroup
from tests.learner.test_shared_prompt import _cfg, _peft, _tiny


def test_an_episode_collates_with_the_model_tokens_masked_in_and_its_logprobs_at_them():
    # prompt (5, 6, 7); the model says 10 11, the environment answers 30 31, the model says 12.
    c = Completion(
        token_ids=[10, 11, 30, 31, 12], mask=[1, 1, 0, 0, 1], logprobs=[-0.1, -0.2, -0.3],
        text="", reward=1.0, finish_reason="stop",
    )  # fmt: skip
    g = ScoredGroup(
        group_id="g", prompt_id="p", prompt_token_ids=[5, 6, 7], answer="", policy_version=0,
        completions=[c, c.model_copy(update={"reward": 0.0})],
    )  # fmt: skip
    seqs, _ = sequences([g], GRPOConfig())
    assert seqs[0].model_tokens == 3
    b = collate(seqs, pad_id=0)
    assert b.input_ids[0].tolist() == [5, 6, 7, 10, 11, 30, 31, 12]  # every token, as sampled and appended
    assert b.input_ids[:, 1:].gather(1, b.positions)[0].tolist() == [10, 11, 30, 31, 12]
    assert b.mask[0].tolist() == [1, 1, 0, 0, 1]
    assert torch.allclose(b.sampler_logprobs[0], torch.tensor([-0.1, -0.2, 0.0, 0.0, -0.3]))
    p = pack(seqs, pad_id=0)
    assert p.targets.tolist() == [10, 11, 30, 31, 12] * 2  # the environment's tokens are read (context)
    assert p.tokens[0].tolist() == [1, 1, 1, 1, 1] and p.mask[0].tolist() == [1, 1, 0, 0, 1]
    assert torch.equal(p.sampler_logprobs, b.sampler_logprobs)


def _episodes(vocab: int) -> list[Sequence]:
    """Two prompts, two episodes each: model and environment segments of assorted lengths."""
    g = torch.Generator().manual_seed(3)
    shapes = [(5, [[1, 1, 0, 0, 0, 1], [1, 0, 1, 1]]), (4, [[1, 1, 1, 0, 1], [1, 0, 0, 1, 1, 0, 0, 1]])]
    seqs = []
    for prompt_len, masks in shapes:
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        for i, m in enumerate(masks):
            ids = torch.randint(0, vocab, (len(m),), generator=g).tolist()
            seqs.append(Sequence(prompt, ids, [0.0] * sum(m), 1.0 if i == 0 else -0.5, m))
    return seqs


def _model_logprobs(model, s: Sequence, temperature: float) -> torch.Tensor:
    """log π(token | all before it) of the model's tokens of `s`, from one plain forward: the reference."""
    ids = torch.tensor([s.prompt + s.completion])
    logits = model(input_ids=ids).logits[0, :-1].float() / temperature  # [L-1, V]
    lp = logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)  # [L-1]
    model_positions = [len(s.prompt) - 1 + t for t, m in enumerate(s.model_mask) if m]
    return lp[model_positions]


def test_environment_tokens_are_context_scored_nowhere_on_both_paths():
    model = _peft(_tiny("llama", "sdpa"))
    cfg = _cfg(0.0, "seq_mean_token_mean")
    T = cfg.sampling.temperature
    seqs = _episodes(97)
    with torch.no_grad():  # on-policy: the sampler's log-probs are the model's own, so every ratio is 1
        for s in seqs:
            s.sampler_logprobs = _model_logprobs(model, s, T).tolist()
    # The loss written out: -(1/n) Σ_i A_i / |model tokens of i| · Σ_{model tokens} ρ_t, ρ_t = 1 in value.
    model.zero_grad(set_to_none=True)
    ref = 0.0
    for s in seqs:
        lp = _model_logprobs(model, s, T)
        ref = ref - s.advantage * torch.exp(lp - lp.detach()).sum() / s.model_tokens / len(seqs)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    total = sum(s.model_tokens for s in seqs)
    for batch in (collate, pack):
        model.zero_grad(set_to_none=True)
        loss, m = micro_loss(model, batch(seqs, pad_id=0), cfg, len(seqs), total)
        loss.backward()
        assert m["tokens"] == total == 14  # the model's tokens only: 3 + 3 + 4 + 4
        assert m["ratio/clipfrac"] == 0.0
        # value: -(1/4)(1·1 + 1·1 - 0.5·1 - 0.5·1) = -0.25
        torch.testing.assert_close(loss.item(), -0.25, atol=1e-5, rtol=0)
        for name, want in ref_grads.items():
            got = dict(model.named_parameters())[name].grad
            assert want.abs().max() > 0, f"{name}: zero gradient, the comparison would prove nothing"
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4, msg=f"{batch.__name__}: {name}")


def test_a_completion_sampled_half_by_v_and_half_by_v_plus_1_is_corrected_per_token():
    """Decoupled PPO with TIS on a completion whose first two tokens v3 sampled and the last two v4 (an
    in-flight update), trained by the learner at v4 (π_old recomputed = π_θ at v4, so ρ = 1 in value).
    The v3 tokens' sampler probabilities differ from v4's: token 0 at π_old/π_sampler = 2 (truncated to
    the cap 1.5), token 1 at 0.5; the v4 tokens are v4's own, weight 1. A = +1, one sequence, mean over
    its 4 tokens: objective (1.5 + 0.5 + 1 + 1) / 4 = 1.0, loss -1.0; the served-policy check reads only
    the two v4 tokens, whose gap is 0 (over all four it would be ln 2 / 2)."""
    model = _peft(_tiny("llama", "sdpa"))
    cfg = _cfg(0.0, "seq_mean_token_mean", ("grpo.old_logprobs=recompute", "grpo.tis_cap=1.5"))
    T = cfg.sampling.temperature
    c = Completion(
        token_ids=[11, 12, 13, 14], logprobs=[-1.0] * 4, text="", reward=1.0, finish_reason="stop",
        versions=[(0, 3), (2, 4)],
    )  # fmt: skip
    g = ScoredGroup(
        group_id="g", prompt_id="p", prompt_token_ids=[5, 6, 7], answer="", policy_version=3,
        completions=[c, c.model_copy(update={"reward": 0.0})],
    )  # fmt: skip
    s = sequences([g], cfg.grpo)[0][0]
    assert (s.version, s.token_versions) == (3, [3, 3, 4, 4]) and s.advantage == pytest.approx(1.0, abs=1e-5)
    s.advantage = 1.0  # exactly (the group's std has eps added)
    with torch.no_grad():
        own = _model_logprobs(model, Sequence(s.prompt, s.completion, [], 1.0, [1, 1, 1, 1]), T)
    s.sampler_logprobs = (own + torch.tensor([-math.log(2), math.log(2), 0.0, 0.0])).tolist()
    for batch in (collate, pack):
        loss, m = micro_loss(model, batch([s], pad_id=0), cfg, 1, 4, version=4)
        torch.testing.assert_close(loss.item(), -1.0, atol=1e-5, rtol=0)
        assert m["is/weight_max"] == pytest.approx(1.5) and m["is/truncated"] == pytest.approx(0.25)
        assert m["served/tokens"] == 2.0  # v4's two tokens, not the completion's four, not none
        assert m["served/gap_sum"] == pytest.approx(0.0, abs=1e-5)
