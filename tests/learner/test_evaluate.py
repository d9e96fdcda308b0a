import math

import pytest

from learner.evaluate import pass_at_k


def test_pass_at_k_hand_values():
    # n=4 samples, c=1 correct: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; pass@4 = 1.
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    # n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))


def test_an_episode_is_scored_as_in_training_its_last_turn_with_the_conversation():
    from learner.evaluate import _call
    from shared.datasets import Problem
    from shared.protocol import ChatMessage, GeneratedText

    p = Problem("t-0", "Guess.", "7", metadata={"level": 2})
    said = [ChatMessage(role="assistant", content="5"), ChatMessage(role="user", content="Higher.")]
    out = GeneratedText(text="7", token_ids=[1, 2, 3], finish_reason="stop", turns=2, messages=said)
    call = _call(out, p)
    assert (call.completion, call.answer) == ("7", "7")
    assert call.metadata == {"level": 2, "episode": {"messages": [m.model_dump() for m in said], "turns": 2}}
    single = _call(GeneratedText(text="#### 7", token_ids=[1], finish_reason="stop"), p)
    assert single.metadata == {"level": 2}  # no episode: the row's metadata alone
