"""data.task = 'reasoning_gym': problems generated offline from a seed, scored by the task's own
score_answer on the <answer> tag, and the config errors a user meets first."""

import pytest

from shared.cli import check_task
from shared.config import ConfigError, TandemConfig, load_config
from shared.datasets import DatasetError, load_problems
from shared.rewards import RewardRunner, reasoning_gym

pytest.importorskip("reasoning_gym")

RG = {"task": "basic_arithmetic", "size": 300, "eval_size": 60}
TASK = {"task": "reasoning_gym", "reasoning_gym": RG}
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def _cfg(data_task="reasoning_gym", seed=0, **rg) -> TandemConfig:
    return TandemConfig(data={"task": data_task, "seed": seed, "reasoning_gym": {**RG, **rg}})


def test_problems_are_generated_from_the_seed_and_the_splits_are_disjoint():
    cfg = _cfg(config=SMALL)
    train, test = load_problems(cfg.data, "train"), load_problems(cfg.data, "test")
    assert len(train) == 300 and 0 < len(test) <= 60
    assert not {p.question for p in train} & {p.question for p in test}
    assert [p.question for p in load_problems(cfg.data, "train")] == [p.question for p in train]
    assert [p.question for p in load_problems(_cfg(config=SMALL, seed=1).data)] != [p.question for p in train]
    p = train[0]
    # two one-digit terms, the answer their value: "Calculate a ± b." -> eval of the expression
    expression = p.question.removeprefix("Calculate ").rstrip(".").replace("−", "-")
    assert int(p.answer) == eval(expression)  # noqa: S307 (a generated expression of two digits)
    system, user = p.conversation()
    assert "<answer>" in system["content"] and user == {"role": "user", "content": p.question}


def test_the_reward_is_the_tasks_score_answer_on_the_answer_tag():
    p = load_problems(_cfg(config=SMALL).data, "test")[0]
    meta = dict(p.metadata)
    assert reasoning_gym(f"The sum is... <answer> {p.answer} </answer>", p.answer, "", meta) == 1.0
    # the last tag counts, as reasoning-gym extracts it
    assert reasoning_gym(f"<answer>{p.answer}</answer> no, <answer>x</answer>", p.answer, "", meta) == 0.0
    assert reasoning_gym(f"the answer is {p.answer}", p.answer, "", meta) == 0.0  # no tag, no answer
    with pytest.raises(ValueError, match="reasoning_gym' problems only"):
        reasoning_gym("<answer>1</answer>", "1", "", {})


def test_an_answer_prefill_opens_the_answer_in_the_prompt_and_the_reward_reads_its_continuation(model_dir):
    from transformers import AutoTokenizer

    from shared.datasets import chat_prompt_ids

    plain = load_problems(_cfg(config=SMALL).data, "test")[0]
    p = load_problems(_cfg(config=SMALL, answer_prefill=True).data, "test")[0]
    assert p.question == plain.question and p.conversation()[:2] == plain.conversation()
    assert p.conversation()[2] == {"role": "assistant", "content": "<answer>"}
    tok = AutoTokenizer.from_pretrained(model_dir)
    # the prompt ends inside the assistant's turn, after the tag: the model continues the answer
    ids = chat_prompt_ids(tok, p.conversation())
    assert ids[: len(chat_prompt_ids(tok, plain.conversation()))] == chat_prompt_ids(
        tok, plain.conversation()
    )
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<answer>")
    # the OpenAI API keeps vLLM's default: a final assistant message gets a new turn after it
    assert tok.decode(chat_prompt_ids(tok, p.conversation(), continue_final=False)).endswith(
        "<answer><|im_end|>\n<|im_start|>assistant\n"
    )
    meta = dict(p.metadata)
    assert reasoning_gym(f"{p.answer}</answer>", p.answer, "", meta) == 1.0
    assert reasoning_gym(f" {p.answer}", p.answer, "", meta) == 1.0  # the end closes an open answer
    assert reasoning_gym(f"{p.answer} apples</answer>", p.answer, "", meta) < 1.0  # (partial credit)
    assert reasoning_gym(f"{p.answer}", p.answer, "", dict(plain.metadata)) == 0.0  # without: no tag


def test_shots_show_solved_train_problems_before_the_question_in_the_answer_s_form():
    plain = _cfg(config=SMALL, answer_prefill=True)
    cfg = _cfg(config=SMALL, answer_prefill=True, shots=2)
    train = {p.question: p.answer for p in load_problems(cfg.data, "train")}
    for split in ("train", "test"):
        shown = load_problems(cfg.data, split)
        # the same problems, in the same order, as without shots: only the conversation grows
        assert [p.question for p in shown] == [p.question for p in load_problems(plain.data, split)]
        for p in shown[:20]:
            system, *turns, question, prefill = p.conversation()
            assert system["role"] == "system" and question == {"role": "user", "content": p.question}
            assert prefill == {"role": "assistant", "content": "<answer>"}
            assert [t["role"] for t in turns] == ["user", "assistant"] * 2
            for user, answer in zip(turns[::2], turns[1::2], strict=True):
                # a solved train problem, never the problem itself: its answer in the tag the reward reads
                assert user["content"] in train and user["content"] != p.question
                assert answer["content"] == f"<answer>{train[user['content']]}</answer>"
    # drawn from the seed: the same turns on every load, different ones per problem
    again = load_problems(cfg.data, "test")
    assert [p.conversation() for p in again] == [p.conversation() for p in load_problems(cfg.data, "test")]
    assert len({str(p.conversation()[1:5]) for p in again}) > len(again) // 2


def test_a_mix_draws_each_task_by_weight_and_scores_each_with_its_own():
    cfg = _cfg(task=None, mix={"leg_counting": 1, "basic_arithmetic": 3}, config={"basic_arithmetic": SMALL})
    train = load_problems(cfg.data, "train")
    tasks = [p.metadata["rg_task"] for p in train]
    assert 0.15 < tasks.count("leg_counting") / len(tasks) < 0.35  # 1 in 4 of 300 draws
    legs = next(p for p in train if p.metadata["rg_task"] == "leg_counting")
    assert reasoning_gym(f"<answer>{legs.answer}</answer>", legs.answer, "", dict(legs.metadata)) == 1.0


def test_the_task_chooses_its_reward_and_a_verifier_that_cannot_read_it_is_an_error():
    assert _cfg().reward.functions == ["reasoning_gym"]
    cfg = load_config(
        "deploy/configs/cpu.toml", ["data.task=reasoning_gym", "data.reasoning_gym.task=leg_counting"]
    )
    assert cfg.reward.functions == ["reasoning_gym"]
    for builtins in (["gsm8k"], ["math", "r1_format"]):
        with pytest.raises(ValueError, match=r"cannot read reasoning-gym's answers"):
            TandemConfig(data=TASK, reward={"functions": builtins})
    mine = TandemConfig(data=TASK, reward={"functions": ["gsm8k", "examples/calculator.py:solved"]})
    # a function of the user's may read them
    assert mine.reward.functions[1] == "examples/calculator.py:solved"
    assert TandemConfig(data=TASK, reward={"functions": ["reasoning_gym", "r1_format"]}).reward.functions


@pytest.mark.parametrize(
    "data, message",
    [
        ({"task": None}, "needs data.reasoning_gym.task"),
        ({"mix": {"leg_counting": 1}}, "data.reasoning_gym: give task or mix, not both"),
        ({"data_task": "arith"}, "data.reasoning_gym applies to data.task = 'reasoning_gym' only"),
        ({"task": None, "mix": {"leg_counting": 0}}, "weight > 0"),
        ({"shots": 17}, "shots\\n  Input should be less than or equal to 16"),
        (
            {"task": None, "mix": {"leg_counting": 1}, "config": {"chain_sum": {}}},
            "not in data.reasoning_gym.mix",
        ),
    ],
)
def test_config_errors_name_the_field(data, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**data)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"task": "leg_count"}, "reasoning-gym has no task 'leg_count' \\(did you mean leg_counting"),
        ({"config": {"max_terms": 1}}, "data.reasoning_gym.config for 'basic_arithmetic'"),
        ({"config": {"no_such_field": 1}}, "data.reasoning_gym.config for 'basic_arithmetic'.*no_such_field"),
        ({"size": 3, "shots": 4}, "data.reasoning_gym.shots = 4: the train split has 3 problems"),
    ],
)
def test_check_config_refuses_an_unknown_task_or_config_in_one_line(data, message):
    with pytest.raises(DatasetError, match=message):
        load_problems(_cfg(**data).data)
    with pytest.raises(ConfigError, match=message):
        check_task(_cfg(**data))


@pytest.mark.parametrize("shots", [0, 2])
def test_the_prompt_template_makes_the_question_and_each_shot_s(shots):
    cfg = TandemConfig(
        data={**TASK, "prompt_template": "Q: {prompt}", "reasoning_gym": {**RG, "shots": shots}}
    )
    problem = load_problems(cfg.data)[0]
    users = [t["content"] for t in problem.messages if t["role"] == "user"]
    assert len(users) == shots + 1 and all(u.startswith("Q: ") for u in users)
    assert users[-1] == f"Q: {problem.question}"


def test_the_reward_runs_in_the_workers_as_training_calls_it():
    import asyncio

    from shared.rewards import RewardCall

    p = load_problems(_cfg(config=SMALL).data, "test")[1]

    async def score():
        runner = RewardRunner(_cfg().reward)
        try:
            calls = [
                RewardCall(f"<answer>{a}</answer>", p.answer, p.prompt_text, dict(p.metadata))
                for a in (p.answer, "0.5")
            ]
            return await runner.score(calls)
        finally:
            await runner.close()

    assert [row["reasoning_gym"] for row in asyncio.run(score())] == [1.0, 0.0]


def test_the_config_knows_the_built_in_rewards_the_server_has():
    from shared.rewards import BUILTINS
    from shared.task_config import BUILTIN_REWARDS

    assert tuple(BUILTINS) == BUILTIN_REWARDS
