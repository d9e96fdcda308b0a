"""The task's sections of the config: `data` (which problems), `reward` (how a completion is scored) and
`env` (what an episode is: one completion, or turns of the model and an environment). Read by the server;
shared/config.py assembles them with the others into TandemConfig."""

from __future__ import annotations

import math
from string import Formatter
from typing import Any, Literal

from pydantic import Field, model_validator

from shared.config_base import Section


class ArithConfig(Section):
    difficulty: int = Field(default=2, ge=1, le=6, description="operands and their size")
    size: int = Field(default=5000, ge=10, description="problems in the train split")


def template_fields(template: str, field: str) -> list[str]:
    """The {fields} a format string fills; ValueError naming the config `field` when it does not parse."""
    try:
        return [f for _, f, _, _ in Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"{field}: {e} (write {{{{ and }}}} for literal braces)") from None


class ReasoningGymConfig(Section):
    task: str | None = Field(
        default=None, description="the task's name, e.g. 'basic_arithmetic', 'leg_counting'"
    )
    mix: dict[str, float] | None = Field(
        default=None,
        description="a weighted mix instead of one task, {task name: weight}, e.g. "
        "{leg_counting = 1, basic_arithmetic = 2}",
    )
    config: dict[str, Any] = Field(
        default={},
        description="the task's config fields (reasoning-gym's <Task>Config), e.g. "
        "{min_terms = 2, max_terms = 3}; with a mix, {task name: {fields}}",
    )
    size: int = Field(default=5000, ge=1, description="problems in the train split")
    eval_size: int = Field(default=200, ge=1, description="problems in the test split")
    answer_prefill: bool = Field(
        default=False,
        description="start every answer with '<answer>' (the assistant turn opens with it, the model "
        "continues it; a missing '</answer>' closes at the end): for small models that never write the tag "
        "reasoning-gym's extraction reads (SmolLM2-135M: 0 of 256 completions did)",
    )
    shots: int = Field(
        default=0,
        ge=0,
        le=16,
        description="solved problems of the train split shown before each question, as earlier user and "
        "assistant turns answering '<answer>ANSWER</answer>' (few-shot): shows a small model the answer's "
        "form, a bare answer rather than a worked equation",
    )

    @model_validator(mode="after")
    def _check(self) -> ReasoningGymConfig:
        if self.task is not None and self.mix is not None:
            raise ValueError("data.reasoning_gym: give task or mix, not both")
        if self.mix is not None:
            if not self.mix or any(w <= 0 for w in self.mix.values()):
                raise ValueError(
                    "data.reasoning_gym.mix: give each task a weight > 0, e.g. {leg_counting = 1}"
                )
            if unknown := set(self.config) - set(self.mix):
                raise ValueError(
                    f"data.reasoning_gym.config: {sorted(unknown)} not in data.reasoning_gym.mix "
                    "({task: {fields}})"
                )
        return self


class CustomDataConfig(Section):
    prompt_column: str = Field(default="prompt", description="the column holding the prompt text")
    messages_column: str | None = Field(
        default=None,
        description="a column holding a chat [{role, content}, ...] list to use instead of "
        "prompt_column (data.prompt_template is then not applied)",
    )
    answer_column: str | None = Field(
        default="answer", description="the reference answer handed to the reward; None = no answer"
    )
    id_column: str | None = Field(
        default=None,
        description="a column of unique ids; None = '<split>-<row index>'. Ids "
        "must stay stable: resume and the server's cursor rely on them",
    )


class DataConfig(Section):
    task: Literal["gsm8k", "arith", "custom", "reasoning_gym"] = Field(
        default="gsm8k",
        description="'gsm8k', 'arith' (generated word problems, data.arith), 'custom': your own dataset, "
        "read from data.path or the hub (data.hub_id) with the column mapping data.custom, or "
        "'reasoning_gym': a reasoning-gym task or mix (data.reasoning_gym), generated offline from data.seed "
        "and scored by the task's own score_answer (reward 'reasoning_gym')",
    )
    path: str | None = Field(
        default=None,
        description="gsm8k: a folder holding {train,test}.jsonl. custom: a .jsonl/.json/.csv/.parquet file "
        "(it is the data.split split) or a folder holding <split>.<ext> files. None = load data.hub_id",
    )
    hub_id: str = Field(default="openai/gsm8k", description="the hub dataset read when data.path is None")
    hub_config: str | None = Field(default=None, description="the hub dataset's config; gsm8k: 'main'")
    split: str = Field(default="train", description="the split the server samples training prompts from")
    eval_split: str = Field(default="test", description="the split learner.evaluate scores")
    seed: int = Field(
        default=0,
        description="the order prompts are served in (a fresh permutation each epoch); 'arith' and "
        "'reasoning_gym': the problems generated",
    )
    system_prompt: str | None = Field(default=None, description="a system message put before each prompt")
    prompt_template: str | None = Field(
        default=None,
        description="the user message, a Python format string over {prompt} (and, for data.task = 'custom', "
        "the row's columns), e.g. "
        "'{prompt}\\n\\nAnswer after ####.' (write {{ }} for literal braces). None: gsm8k/arith add their "
        "instruction to end with '#### <answer>'; custom uses the prompt as it is",
    )
    curriculum: Literal["off", "skip_settled"] = Field(
        default="off",
        description="how prompts are drawn: 'off': every problem once an epoch, in data.seed's order; "
        "'skip_settled': a problem whose last group's rewards were all equal (solved by every sample, or by "
        "none: no learning signal) is skipped for data.curriculum_skip_epochs epochs, then tried again",
    )
    curriculum_skip_epochs: int = Field(
        default=2, ge=1, le=1000, description="'skip_settled': epochs a settled problem sits out"
    )
    arith: ArithConfig = ArithConfig()
    reasoning_gym: ReasoningGymConfig = ReasoningGymConfig()
    custom: CustomDataConfig = CustomDataConfig()

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        rg = self.reasoning_gym
        if self.task == "reasoning_gym" and rg.task is None and rg.mix is None:
            raise ValueError(
                "data.task = 'reasoning_gym' needs data.reasoning_gym.task (a task's name) or "
                "data.reasoning_gym.mix"
            )
        # (data.arith is left alone under another task: cpu.toml and configs layered on it carry it)
        for name, section in (("reasoning_gym", ReasoningGymConfig), ("custom", CustomDataConfig)):
            if self.task != name and getattr(self, name) != section():
                raise ValueError(f"data.{name} applies to data.task = '{name}' only")
        if self.prompt_template is not None:
            fields = template_fields(self.prompt_template, "data.prompt_template")
            if any(not f or not f.isidentifier() for f in fields):
                raise ValueError("data.prompt_template: every {field} must name a column, e.g. {prompt}")
            if self.task != "custom" and (other := sorted(set(fields) - {"prompt"})):
                raise ValueError(
                    f"data.prompt_template: {{{other[0]}}}: data.task = '{self.task}' fills {{prompt}} only "
                    "(other fields name a column of data.task = 'custom')"
                )
        return self


# The built-in reward functions' names (shared/rewards.py's BUILTINS holds them, in this order)
BUILTIN_REWARDS = ("gsm8k", "math", "r1_format", "reasoning_gym")


class JudgeConfig(Section):
    """reward.judge: the LLM judge that the reward function named "judge" asks (shared/judge.py)."""

    url: str = Field(
        default="",
        description="the judge's OpenAI-compatible base URL (e.g. 'http://host:8000/v1'; its "
        "/chat/completions is called), or 'self': this rollout server's own OpenAI API (its `base` model "
        "or a policy version, by judge.model; the server's token is sent)",
    )
    model: str = Field(
        default="",
        description="the model name the endpoint serves. self: 'latest' (the version served: free), or "
        "'base' / 'policy-vN' (in merge mode each such batch switches the engine's weights, at most once "
        "per server.vllm.eval_switch_every_s: production waits meanwhile)",
    )
    rubric: str = Field(
        default="",
        description="the judge's prompt: a format string over {prompt} (the task's last user message), "
        "{completion} and {answer} (the reference answer)",
    )
    score: Literal["yes_no", "number"] = Field(
        default="yes_no",
        description="how the answer is read: 'yes_no' (the first yes or no: 1 or 0), or 'number' (the first "
        "number, mapped from judge.range to 0..1 and clipped)",
    )
    range: tuple[float, float] = Field(
        default=(0.0, 10.0), description="score = 'number': its lowest, highest"
    )
    max_tokens: int = Field(default=16, ge=1, le=65536, description="the judge's answer, at most")
    max_concurrency: int = Field(default=8, ge=1, le=1024, description="judge requests in flight at once")
    timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="per completion, retries included: past it the completion gets failure_score (counted)",
    )
    retries: int = Field(default=2, ge=0, le=20, description="a failed request is tried again this often")
    backoff_s: float = Field(default=1.0, ge=0, le=600, description="before the first retry; doubling")
    cache_size: int = Field(
        default=10000,
        ge=0,
        le=10_000_000,
        description="judgements kept, by (rubric, prompt, completion, answer)",
    )
    failure_score: float = Field(
        default=0.0, ge=-1e6, le=1e6, description="what a completion the judge failed to score gets"
    )
    api_key_env: str = Field(
        default="",
        description="the environment variable that holds the endpoint's API key (sent as a bearer token); "
        "the key itself never goes in the config",
    )

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        if self.range[0] >= self.range[1]:
            raise ValueError(f"reward.judge.range: {list(self.range)}: the lowest must be below the highest")
        fields = set(template_fields(self.rubric, "reward.judge.rubric"))
        if other := sorted(fields - {"prompt", "completion", "answer"}):
            raise ValueError(
                f"reward.judge.rubric: {{{other[0]}}}: it fills {{prompt}}, {{completion}} and {{answer}}"
            )
        return self


class RewardConfig(Section):
    functions: list[str] = Field(
        default=["gsm8k"],
        min_length=1,
        description="reward functions: built-in names ('gsm8k': the GSM8K verifier; 'math': math-verify for "
        "LaTeX/\\boxed{} answers; 'r1_format': <think>...</think> then an answer), 'module:function' / "
        "'path/to/file.py:function' for your own, called as f(completion, answer, prompt, metadata) -> float "
        "(plain or async), 'rm:path/to/folder' for a reward model (a transformers sequence classifier "
        "with one output, whose logit is the reward; named after its folder), or 'judge' for the LLM judge "
        "of [reward.judge]",
    )
    weights: list[float] | None = Field(
        default=None, description="one weight per function; the reward is the weighted sum. None = all 1"
    )
    timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="per call: a function still running is killed and gives 0 (counted in /metrics)",
    )
    truncated: Literal["score", "zero"] = Field(
        default="score",
        description="a completion stopped by sampling.max_new_tokens: 'score' it like any other, or give it "
        "'zero' from every function (its answer was never finished, and a verifier that falls back to the "
        "last number would credit a half-written line). Training only: learner.evaluate scores as usual",
    )
    overlong_buffer: int = Field(
        default=0,
        ge=0,
        description="DAPO's soft overlong punishment: over the last N tokens before sampling.max_new_tokens "
        "a completion's reward falls linearly, by overlong_penalty at the cap (a part named "
        "'overlong_penalty' in its rewards and metrics). 0: off. Training only, single-turn tasks only",
    )
    overlong_penalty: float = Field(
        default=1.0, ge=0, le=1e6, description="the overlong punishment at the cap (DAPO: 1)"
    )
    length_penalty: float = Field(
        default=0.0,
        ge=0,
        le=1e6,
        description="a linear length penalty: each completion's reward less this x its tokens / "
        "sampling.max_new_tokens (a part named 'length_penalty'). 0: off. Training only, single-turn only",
    )
    model_device: str = Field(
        default="cpu",
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="where the reward models ('rm:' functions) run: 'cpu' (float32), or 'cuda' / 'cuda:N' "
        "(bfloat16; leave room beside the engine: server.vllm.gpu_memory_utilization)",
    )
    model_batch_size: int = Field(
        default=16, ge=1, le=4096, description="completions a reward model scores per forward pass"
    )
    model_max_tokens: int = Field(
        default=2048,
        ge=8,
        le=1_000_000,
        description="a reward model reads at most this many tokens of prompt and completion (cut after)",
    )
    judge: JudgeConfig = JudgeConfig()
    workers: int = Field(
        default=2,
        ge=1,
        le=64,
        description="processes that run the functions other than the linear-time built-ins (gsm8k, "
        "r1_format), so a hanging or crashing one can be killed without touching the server",
    )

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        if "judge" in self.functions:
            for field in ("url", "model", "rubric"):
                if not getattr(self.judge, field):
                    raise ValueError(f"reward.functions names 'judge': set reward.judge.{field}")
        if self.weights is not None:
            if len(self.weights) != len(self.functions):
                raise ValueError(
                    f"reward.weights has {len(self.weights)} values for {len(self.functions)} "
                    "reward.functions; give one weight per function"
                )
            if not all(math.isfinite(w) for w in self.weights):
                raise ValueError("reward.weights must be finite numbers")
        return self


class EnvConfig(Section):
    """What an episode is: one completion (single_turn), or turns of the model and an environment."""

    kind: Literal["single_turn", "multi_turn", "tools", "verifiers"] = Field(
        default="single_turn",
        description="'single_turn': G completions of each prompt (no environment); 'multi_turn': after each "
        "model turn env.step answers, until it says the episode is done; 'tools': the model may call "
        "env.tools, each call's result comes back as a tool message, and a turn without a call ends it; "
        "'verifiers': an environment of the verifiers library (env.verifiers), run unchanged: its tasks are "
        "the prompts (data.* is not read), its harness plays the episodes, its rewards score them",
    )
    verifiers: dict[str, Any] = Field(
        default={},
        description="verifiers: the environment's config as the library takes it (its EnvConfig), e.g. "
        "{taskset = {id = 'my_taskset'}}; each seat without a harness or runtime gets the null harness on "
        "the subprocess runtime (the library's local path; its defaults need a sandbox or a hosted login)",
    )
    renderer: str = Field(
        default="bridge",
        description="verifiers: how the library's training client renders each turn to tokens. 'bridge': "
        "tandem's, which keeps every earlier turn's tokens as sampled and appends what the model's chat "
        "template adds (re-renders where the template does not extend its own renders); 'auto': the "
        "library's choice by model name (a local folder gets its DefaultRenderer, which re-renders the "
        "conversation each turn, so a reply that tokenizes differently from how it was sampled splits the "
        "episode and drops its group); a renderer of the `renderers` library by name ('qwen3', 'llama-3', "
        "...); or a renderer class of your own as 'module.Class' / 'path/to/file.py:Class'",
    )
    verifiers_limit: int = Field(
        default=10000, ge=1, description="verifiers: at most this many of the taskset's tasks (in its order)"
    )
    verifiers_eval: int = Field(
        default=0,
        ge=0,
        description="verifiers: the last this many of those tasks are held out (never trained on) for "
        "learner.evaluate; 0: none",
    )
    step: str | None = Field(
        default=None,
        description="multi_turn: 'module:function' or 'path/to/file.py:function', called as "
        "step(messages, answer, metadata) -> (reply, done) (plain or async) after each model turn; "
        "messages is the conversation so far, reply a string (a user message), a message dict, a list of "
        "them or None; runs where reward functions run, with reward.timeout_s",
    )
    tools: list[str] = Field(
        default=[],
        description="tools: 'module:function' / 'path/to/file.py:function' entries; a function's signature "
        "and Google-style docstring become its schema. The model calls one with "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>',
    )
    max_turns: int = Field(default=4, ge=1, le=64, description="model turns per episode at most")
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="tokens after the prompt per episode, the model's and the environment's together; "
        "None: up to model.max_model_len. An episode that reaches it ends (finish_reason 'length')",
    )

    @property
    def fields(self) -> list[tuple[str, str]]:
        """(config field, 'module:function') of each of the environment's functions: env.step, or each of
        env.tools; none for single_turn and verifiers (the library runs its own)."""
        if self.kind == "multi_turn":
            return [("env.step", self.step)]
        return [(f"env.tools[{i}]", spec) for i, spec in enumerate(self.tools)]

    @property
    def turns(self) -> bool:
        """Whether tandem's own environment plays episodes of several turns (multi_turn, tools)."""
        return self.kind in ("multi_turn", "tools")

    @model_validator(mode="after")
    def _check(self) -> EnvConfig:
        if self.kind == "multi_turn" and not self.step:
            raise ValueError("env.kind = 'multi_turn' needs env.step = 'module:function'")
        if self.kind == "tools" and not self.tools:
            raise ValueError("env.kind = 'tools' needs env.tools = ['module:function', ...]")
        if self.kind != "multi_turn" and self.step:
            raise ValueError(f"env.step is for env.kind = 'multi_turn', not '{self.kind}'")
        if self.kind != "tools" and self.tools:
            raise ValueError(f"env.tools is for env.kind = 'tools', not '{self.kind}'")
        taskset = self.verifiers.get("taskset")
        if self.kind == "verifiers" and not (isinstance(taskset, dict) and taskset.get("id")):
            raise ValueError("env.kind = 'verifiers' needs env.verifiers = {taskset = {id = '<id>'}, ...}")
        if self.kind == "verifiers" and self.verifiers_eval >= self.verifiers_limit:
            raise ValueError("env.verifiers_eval must leave tasks to train on: below env.verifiers_limit")
        if self.kind != "verifiers" and self.verifiers:
            raise ValueError(f"env.verifiers is for env.kind = 'verifiers', not '{self.kind}'")
        return self
