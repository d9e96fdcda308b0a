"""Reward functions: the built-ins, loading by import path, and the runner that keeps a bad function from
hurting the server (raises, hangs, NaN, a string, a dead process: 0 for that call, counted, never lost)."""

import asyncio
import time

import pytest

from shared.config import ConfigError, RewardConfig
from shared.rewards import RewardCall, RewardRunner, gsm8k, math_answer, r1_format, resolve

MODULE = """
import asyncio, math, os, time

def exact(completion, answer, prompt, metadata):
    return 1.0 if completion.strip().endswith(answer) else 0.0

async def level(completion, answer, prompt, metadata):
    await asyncio.sleep(0)
    return metadata["level"] / 10 + (0.5 if prompt.startswith("Q:") else 0.0)

def raises(completion, answer, prompt, metadata):
    raise ValueError("bad reward " + completion)

def hangs(completion, answer, prompt, metadata):
    time.sleep(3600)

def nan(completion, answer, prompt, metadata):
    return math.nan

def text(completion, answer, prompt, metadata):
    return "1.0"

def dies(completion, answer, prompt, metadata):
    os._exit(3)

def chatty(completion, answer, prompt, metadata):
    print("a print must not break the worker's protocol")
    return 0.25

def slow_len(completion, answer, prompt, metadata):
    time.sleep(3)
    return len(completion)

def two_args(completion, answer):
    return 1.0
"""


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the worker processes import it by name too
    return tmp_path / "user_rewards.py"


def run(runner: RewardRunner, calls: list[RewardCall]) -> list[dict[str, float]]:
    async def go():
        try:
            return await runner.score(calls)
        finally:
            await runner.close()

    return asyncio.run(go())


CALLS = [
    RewardCall("so #### 3", "3", "Q: 1+2?", {"level": 2}),
    RewardCall("#### 4", "3", "1+2?", {"level": 5}),
]


def test_gsm8k_and_r1_format_builtins():
    assert gsm8k("... #### 1,000", "1000") == 1.0 and gsm8k("#### 999", "1000") == 0.0
    assert r1_format("<think>add them</think> #### 3", "") == 1.0
    assert r1_format("add them</think>\n#### 3", "") == 1.0  # <think> pre-filled by the chat template
    assert r1_format("<think>add them</think>", "") == 0.0  # no answer after the reasoning
    assert r1_format("#### 3", "") == 0.0
    assert r1_format("<think>a</think> b </think> c", "") == 0.0
    assert r1_format("<think><think>a</think> b", "") == 0.0


@pytest.mark.parametrize(
    "completion, answer, want",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("$0.5$", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{2}{4}}", "\\frac12", 1.0),  # equivalent fractions
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("\\boxed{3}", "\\frac{1}{2}", 0.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("no answer at all", "7", 0.0),
        ("", "7", 0.0),
    ],
)
def test_math_verifier_hand_written_cases(completion, answer, want):
    assert math_answer(completion, answer) == want


@pytest.mark.parametrize(
    "completion, answer, want",
    [
        ("\\boxed{" * 10_000 + "1" + "}" * 10_000, "1", None),  # nesting: any score, in time
        ("\\boxed{" * 10_000, "1", 0.0),  # 10k unclosed braces
        ("{" * 10_000 + "}" * 10_000, "1", 0.0),
        ("9" * 100_000, "1", 0.0),
        ("\\frac{" * 2_000 + "1", "1", 0.0),
    ],
)
def test_math_verifier_pathological_inputs_score_within_the_limit(completion, answer, want):
    t0 = time.perf_counter()
    score = math_answer(completion, answer)
    assert time.perf_counter() - t0 < 10  # math-verify's own limit is 5 s per parse/verify (main thread)
    assert score in (0.0, 1.0) and (want is None or score == want)


def test_resolve_names_the_entry_at_fault(module):
    fns = resolve(
        RewardConfig(functions=["gsm8k", "user_rewards:exact", f"{module}:level"], weights=[1, 2, 3])
    )
    assert [(f.name, f.weight, f.inline) for f in fns] == [
        ("gsm8k", 1, True),
        ("exact", 2, False),
        ("level", 3, False),
    ]
    for spec, message in [
        ("no_such_module:f", r"reward.functions\[1\]: 'no_such_module:f': cannot import 'no_such_module'"),
        ("user_rewards:missing", r"reward.functions\[1\]: .* has no function 'missing'"),
        (
            "user_rewards:two_args",
            r"reward.functions\[1\]: .* must accept \(completion, answer, prompt, metadata\)",
        ),
        ("/nowhere/r.py:f", r"reward.functions\[1\]: .* file /nowhere/r.py does not exist"),
        ("nonsense", r"reward.functions\[1\]: 'nonsense' is neither a built-in"),
        ("gsm8k", r"reward.functions\[1\]: a second function named 'gsm8k'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            resolve(RewardConfig(functions=["gsm8k", spec]))


def test_runner_weighted_sum_inline_worker_and_async(module):
    cfg = RewardConfig(functions=["gsm8k", "user_rewards:exact", f"{module}:level"], weights=[1.0, 0.5, 2.0])
    runner = RewardRunner(cfg)
    out = run(runner, CALLS)
    assert out == [
        {"gsm8k": 1.0, "exact": 1.0, "level": 0.2 + 0.5},
        {"gsm8k": 0.0, "exact": 0.0, "level": 0.5},
    ]
    assert runner.total(out[0]) == pytest.approx(1.0 + 0.5 + 2 * 0.7)
    assert runner.total(out[1]) == pytest.approx(2 * 0.5)
    assert not runner.failures


def test_bad_functions_give_zero_are_counted_and_the_rest_still_score(module):
    names = ["raises", "hangs", "nan", "text", "dies"]
    seen = []
    cfg = RewardConfig(
        functions=["gsm8k", "user_rewards:chatty", *(f"user_rewards:{n}" for n in names)],
        timeout_s=1.0,
        workers=2,
    )
    runner = RewardRunner(cfg, on_failure=lambda name, kind: seen.append((name, kind)))
    t0 = time.perf_counter()
    out = run(runner, CALLS)
    # Two hanging calls on two workers, killed at 1 s each, with a restart (~0.5 s): far from an hour.
    assert time.perf_counter() - t0 < 30
    assert [row["gsm8k"] for row in out] == [1.0, 0.0] and [row["chatty"] for row in out] == [0.25, 0.25]
    assert all(row[n] == 0.0 for row in out for n in names)
    kinds = {
        "raises": "raised",
        "hangs": "timeout",
        "nan": "non_finite",
        "text": "bad_type",
        "dies": "crashed",
    }
    assert dict(runner.failures) == {(n, k): 2 for n, k in kinds.items()}
    assert sorted(seen) == sorted((n, k) for n, k in kinds.items() for _ in CALLS)


def test_a_call_cancelled_mid_flight_leaves_no_stale_answer(module):
    """A batch cancelled (the server put to sleep) while its worker computes: the worker is replaced, so
    the next call cannot read the cancelled call's answer."""
    runner = RewardRunner(RewardConfig(functions=["user_rewards:slow_len"], timeout_s=60, workers=1))

    async def go():
        task = asyncio.create_task(runner.score([RewardCall("x" * 7, "", "", {})]))
        await asyncio.sleep(2)  # the worker has started and is inside slow_len
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        try:
            return await asyncio.wait_for(runner.score([RewardCall("y" * 3, "", "", {})]), 30)
        finally:
            await runner.close()

    assert asyncio.run(go()) == [{"slow_len": 3.0}]


@pytest.mark.parametrize(
    "tokens, want",
    # DAPO, L_max = 256, L_cache = 64: nothing up to 192 tokens, then (192 - L) / 64, -1 at the cap
    [(100, 0.0), (192, 0.0), (200, -0.125), (224, -0.5), (256, -1.0), (300, -1.0)],
)
def test_overlong_punishment_by_hand(tokens, want):
    from shared.rewards import length_shaping

    assert length_shaping(tokens, 256, RewardConfig(overlong_buffer=64)) == {"overlong_penalty": want}
    half = RewardConfig(overlong_buffer=64, overlong_penalty=0.5)
    assert length_shaping(tokens, 256, half) == {"overlong_penalty": want / 2}


def test_linear_length_penalty_by_hand_and_both_off_by_default():
    from shared.rewards import length_shaping

    assert length_shaping(128, 256, RewardConfig(length_penalty=0.1)) == {"length_penalty": -0.05}
    assert length_shaping(256, 256, RewardConfig()) == {}


def test_length_shaping_is_refused_where_it_cannot_apply(tmp_path):
    from shared.config import TandemConfig

    with pytest.raises(ValueError, match=r"reward.overlong_buffer shapes single-turn .* env.kind = 'tools'"):
        TandemConfig.model_validate(
            {"reward": {"overlong_buffer": 8}, "env": {"kind": "tools", "tools": ["m:f"]}}
        )
    with pytest.raises(
        ValueError, match=r"reward.overlong_buffer=300 is longer than sampling.max_new_tokens"
    ):
        TandemConfig.model_validate({"reward": {"overlong_buffer": 300}, "sampling": {"max_new_tokens": 256}})
    with pytest.raises(ConfigError, match=r"reward.functions\[0\]: 'length_penalty' names a length-shaping"):
        fn = tmp_path / "mine.py"
        fn.write_text("def length_penalty(completion, answer, prompt, metadata):\n    return 0.0\n")
        resolve(RewardConfig(functions=[f"{fn}:length_penalty"]))
