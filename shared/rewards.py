"""Reward functions: the signature, the built-ins, loading the user's own by import path, and running them
so that none can stop the server.

A reward function is called as `f(completion, answer, prompt, metadata) -> float` (plain or `async`):
the completion's text, the row's reference answer (text; "" without `data.answer_column`), the prompt's
last user message as the model saw it, and the row's other columns (a dict of JSON values). Configured as

    [reward]
    functions = ["gsm8k", "my_rewards:format_bonus"]   # a built-in name, "module:function", or
    weights = [1.0, 0.2]                                # "path/to/file.py:function"

The reward of a completion is the weighted sum; each function's own value travels with the group
(`Completion.rewards`) and the learner logs `reward/<name>/mean`. A reward model is an entry too,
`"rm:path/to/folder"` (shared/reward_models.py), and so is an LLM judge, `"judge"` (shared/judge.py).

Where they run: the linear-time built-ins (`gsm8k`, `r1_format`) in a thread of the server, and reward
models in another, batched; everything else (`math` and all user code) in `reward.workers` child
processes (`python -m shared.reward_worker`), one call at a time each. A call that runs past
`reward.timeout_s` has its process killed and replaced, so a function that hangs, spins or crashes its
interpreter costs that call and never the server; `math` also uses math-verify's own signal-based time
limits, which work there because each call runs on the worker's main thread. A call that raises, times
out, returns a non-number or a non-finite number gives 0 for that function, is counted (`on_failure`, the
server's `/metrics`) and logged once per function and kind, with the traceback.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import math
import numbers
import os
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from shared import judge, reward_models
from shared.config import ConfigError, EnvConfig, RewardConfig
from shared.reward import verify

log = logging.getLogger("tandem.reward")

FAILURE_KINDS = ("raised", "timeout", "non_finite", "bad_type", "crashed")


# -- the built-ins -----------------------------------------------------------------------------------
def gsm8k(completion: str, answer: str, prompt: str = "", metadata: dict | None = None) -> float:
    """1 if the completion's final number equals the reference's (shared/reward.py), else 0."""
    return verify(completion, answer)


def math_answer(completion: str, answer: str, prompt: str = "", metadata: dict | None = None) -> float:
    """1 if math-verify finds the completion's answer (LaTeX, `\\boxed{}`, or a plain expression)
    mathematically equal to the reference (`\\frac{1}{2}` = `0.5` = `\\boxed{\\frac{2}{4}}`), else 0.
    math-verify's own time limits use SIGALRM, so they work only on a main thread (the reward workers'):
    elsewhere they are off and the caller's limit is the only one."""
    from math_verify import parse
    from math_verify import verify as math_verify

    limit = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=limit)
        pred = parse(completion, parsing_timeout=limit)
        return 1.0 if gold and pred and math_verify(gold, pred, timeout_seconds=limit) else 0.0
    except Exception:  # pathological input (deep nesting, sympy's own errors): no answer, no reward
        return 0.0


def r1_format(completion: str, answer: str = "", prompt: str = "", metadata: dict | None = None) -> float:
    """1 for the R1 shape: reasoning closed by one `</think>` (the opening `<think>` may be in the prompt,
    as R1-Distill's chat template puts it there), then a non-empty answer; else 0. Linear time."""
    text = completion.lstrip()
    if text.startswith("<think>"):
        text = text[len("<think>") :]
    if "<think>" in text or text.count("</think>") != 1:
        return 0.0
    reasoning, _, after = text.partition("</think>")
    return 1.0 if reasoning.strip() and after.strip() else 0.0


def reasoning_gym(completion: str, answer: str = "", prompt: str = "", metadata: dict | None = None) -> float:
    """data.task = 'reasoning_gym': the task's own score_answer on the completion's last <answer>...</answer>
    (reasoning-gym's extraction), with the problem's entry from its metadata. With an answer prefill the
    completion is the answer's continuation: the opening tag is put back, and the end closes it if the
    model did not."""
    metadata = metadata or {}
    if "rg_entry" not in metadata:
        raise ValueError("the reasoning_gym reward scores data.task = 'reasoning_gym' problems only")
    from reasoning_gym.utils import extract_answer as rg_extract

    score = _rg_scorer(metadata["rg_task"], json.dumps(metadata.get("rg_config", {}), sort_keys=True))
    prefill = metadata.get("rg_prefill")
    if prefill:  # the answer began in the prompt (data.reasoning_gym.answer_prefill); it ends at the end
        completion = prefill + completion + ("" if "</answer>" in completion else "</answer>")
    return float(score(rg_extract(completion), metadata["rg_entry"]))


@functools.lru_cache(maxsize=64)
def _rg_scorer(task: str, config_json: str):
    from shared.datasets import rg_dataset

    return rg_dataset(task, json.loads(config_json), seed=0, size=1).score_answer


# name -> (function, runs in the server's thread: trusted and linear-time)
BUILTINS: dict[str, tuple[Callable[..., float], bool]] = {
    "gsm8k": (gsm8k, True),
    "math": (math_answer, False),
    "r1_format": (r1_format, True),
    "reasoning_gym": (reasoning_gym, False),
}


# -- loading -----------------------------------------------------------------------------------------
REWARD_ARGS = (("", "", "", {}), "(completion, answer, prompt, metadata)")


def load_function(spec: str, args: tuple[tuple, str] | None = REWARD_ARGS) -> Callable[..., Any]:
    """The function a spec names: a built-in name, 'module:function' or 'path/to/file.py:function',
    checked to take `args` (example arguments, and how to say them) unless None. Raises ValueError with
    the reason."""
    if spec in BUILTINS:
        return BUILTINS[spec][0]
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"'{spec}' is neither a built-in ({', '.join(BUILTINS)}) nor 'module:function' or "
            "'file.py:function'"
        )
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ValueError(f"'{spec}': file {path} does not exist")
            mod_spec = importlib.util.spec_from_file_location(f"tandem_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ValueError:
        raise
    except ModuleNotFoundError as e:
        raise ValueError(
            f"'{spec}': cannot import {module_name!r} ({e}); put its folder on PYTHONPATH, or name the file: "
            "'path/to/module.py:function'"
        ) from None
    except BaseException as e:  # the module's own code failed on import
        raise ValueError(f"'{spec}': importing {module_name} raised {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"'{spec}': {module_name} has no function {attr!r}")
    if args is None:
        return fn
    try:
        inspect.signature(fn).bind(*args[0])
    except TypeError:
        raise ValueError(f"'{spec}': must accept {args[1]}") from None
    except ValueError:  # no signature to inspect (a builtin): trust it
        pass
    return fn


@dataclass(frozen=True)
class RewardFunction:
    name: str  # in metrics and logs: the built-in's name, else the function's (a reward model's folder's)
    spec: str
    weight: float
    inline: bool
    fn: Callable[..., Any]
    model: reward_models.RewardModel | None = None  # "rm:folder": scored in batches, in this process

    @property
    def in_worker(self) -> bool:
        """Called in a reward worker process: not inline, not a reward model, not the judge."""
        return not self.inline and self.model is None and self.spec != judge.NAME


def _model_function(spec: str, weight: float, cfg: RewardConfig) -> RewardFunction:
    """A reward model's entry (shared/reward_models.py), checked without loading its weights."""
    folder = reward_models.check(spec)
    model = reward_models.RewardModel(folder, cfg.model_device, cfg.model_batch_size, cfg.model_max_tokens)

    def one(completion: str, answer: str, prompt: str, metadata: dict) -> float:
        return model.score([(prompt, completion)])[0]

    return RewardFunction(folder.name, spec, weight, False, one, model)


def _judge_function(weight: float, cfg: RewardConfig) -> RewardFunction:
    """The "judge" entry: checked here (its key's variable set); RewardRunner asks the judge in batches,
    and `fn` (one completion at a time: lm-eval's path) asks a judge of its own."""
    if cfg.judge.api_key_env and not os.environ.get(cfg.judge.api_key_env):
        raise ValueError(
            f"reward.judge.api_key_env: the environment variable {cfg.judge.api_key_env} is not set"
        )

    async def one(completion: str, answer: str, prompt: str, metadata: dict) -> float:
        if cfg.judge.url == "self":
            raise ValueError("reward.judge.url = 'self' is this server's: score through the server")
        asked = judge.Judge(cfg.judge, cfg.judge.url)
        try:
            return (await asked.score([(prompt, completion, answer)], lambda kind, detail: None))[0]
        finally:
            await asked.close()

    return RewardFunction(judge.NAME, judge.NAME, weight, False, one)


def resolve(cfg: RewardConfig) -> list[RewardFunction]:
    """The configured functions, imported and checked; a ConfigError names the entry at fault."""
    weights = cfg.weights or [1.0] * len(cfg.functions)
    out: list[RewardFunction] = []
    for i, (spec, weight) in enumerate(zip(cfg.functions, weights, strict=True)):
        try:
            if reward_models.is_reward_model(spec):
                f = _model_function(spec, weight, cfg)
            elif spec == judge.NAME:
                f = _judge_function(weight, cfg)
            else:
                fn = load_function(spec)
                name = spec if spec in BUILTINS else spec.rpartition(":")[2]
                f = RewardFunction(name, spec, weight, spec in BUILTINS and BUILTINS[spec][1], fn)
        except ValueError as e:
            raise ConfigError(f"reward.functions[{i}]: {e}") from None
        name = f.name
        if any(g.name == name for g in out):
            raise ConfigError(f"reward.functions[{i}]: a second function named '{name}' (names must differ)")
        if name in SHAPING_PARTS:
            raise ConfigError(f"reward.functions[{i}]: '{name}' names a length-shaping part; rename it")
        out.append(f)
    return out


def _judge_url(cfg: RewardConfig, self_url: str | None) -> str:
    """reward.judge.url, with 'self' the URL of the rollout server that scores (`self_url`)."""
    if cfg.judge.url != "self":
        return cfg.judge.url
    if self_url is None:
        raise ConfigError("reward.judge.url = 'self' names the rollout server: score through one")
    return self_url.rstrip("/") + "/v1"


SHAPING_PARTS = ("overlong_penalty", "length_penalty")


def length_shaping(tokens: int, max_tokens: int, cfg: RewardConfig) -> dict[str, float]:
    """The length-shaping parts of a completion of `tokens` tokens sampled under a cap of `max_tokens`,
    added to its reward (none when both are off):
    - overlong_penalty, DAPO's soft overlong punishment with L_cache = reward.overlong_buffer: 0 up to
      max_tokens - L_cache tokens, then falling linearly to -reward.overlong_penalty at the cap (and past
      it): -overlong_penalty * (tokens - (max_tokens - L_cache)) / L_cache;
    - length_penalty: -reward.length_penalty * tokens / max_tokens.
    Worked numbers in tests/shared/test_rewards.py."""
    parts = {}
    if cfg.overlong_buffer:
        over = min(max(tokens - (max_tokens - cfg.overlong_buffer), 0), cfg.overlong_buffer)
        parts["overlong_penalty"] = -cfg.overlong_penalty * over / cfg.overlong_buffer
    if cfg.length_penalty:
        parts["length_penalty"] = -cfg.length_penalty * tokens / max_tokens
    return parts


def load_env(cfg: EnvConfig) -> dict[str, Callable[..., Any]]:
    """The environment's functions by spec (env.step, or each of env.tools), imported; a step checked to
    take (messages, answer, metadata). A ConfigError names the field at fault."""
    args = (([], "", {}), "(messages, answer, metadata)") if cfg.kind == "multi_turn" else None
    functions = {}
    for field, spec in cfg.fields:
        try:
            functions[spec] = load_function(spec, args)
        except ValueError as e:
            raise ConfigError(f"{field}: {e}") from None
    return functions


# -- running -----------------------------------------------------------------------------------------
class RewardCall(NamedTuple):
    completion: str
    answer: str
    prompt: str
    metadata: dict[str, Any]


def checked(value: Any) -> tuple[float, str | None]:
    """(the reward, None) or (0.0, the failure kind) for what a function returned."""
    if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        value = float(value)
        return (value, None) if math.isfinite(value) else (0.0, "non_finite")
    return 0.0, "bad_type"


def call_function(fn: Callable[..., Any], call: RewardCall | list | dict) -> Any:
    """One call (a dict: keyword arguments), awaited when the function is async (on this thread's own
    event loop)."""
    result = fn(**call) if isinstance(call, dict) else fn(*call)
    if inspect.isawaitable(result):

        async def wait():
            return await result

        result = asyncio.run(wait())
    return result


class _Worker:
    """A child process running `shared.reward_worker` over JSON lines on its stdin/stdout."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self._next = 0

    @classmethod
    async def start(cls, specs: list[str]) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shared.reward_worker", json.dumps(specs),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=2**26,
        )  # fmt: skip
        worker = cls(proc)
        line = await asyncio.wait_for(proc.stdout.readline(), 300)
        hello = json.loads(line) if line else {"fatal": "the reward worker exited at start"}
        if "fatal" in hello:
            await worker.kill()
            raise RuntimeError(f"reward worker could not load the functions: {hello['fatal']}")
        return worker

    async def call(self, index: int, args: list | dict, any_value: bool = False) -> dict[str, Any]:
        self._next += 1
        msg = {"id": self._next, "fn": index, "args": args}
        if any_value:  # any JSON value back (a dict of args is keyword arguments)
            msg["any"] = True
        self.proc.stdin.write(json.dumps(msg, default=str).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise EOFError("the reward worker exited")
        reply = json.loads(line)
        assert reply["id"] == self._next, "reward worker answered out of turn"
        return reply

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


class RewardRunner:
    """Scores completions with the configured functions, and runs the environment's user code (`env`:
    its step function or tools, by spec) in the same workers under the same limits. `on_failure(name,
    kind)` is told of each call that failed (FAILURE_KINDS). `self_url` and `self_token`: the rollout
    server a judge of url = 'self' is, and its token."""

    def __init__(
        self,
        cfg: RewardConfig,
        on_failure: Callable[[str, str], None] = lambda name, kind: None,
        env: list[str] = (),
        self_url: str | None = None,
        self_token: str = "",
    ):
        self.functions = resolve(cfg)
        self.timeout_s = cfg.timeout_s
        self.on_failure = on_failure
        self.failures: Counter[tuple[str, str]] = Counter()
        self._remote = [f for f in self.functions if f.in_worker]
        self._models = [f for f in self.functions if f.model is not None]
        self._judge: judge.Judge | None = None
        if any(f.spec == judge.NAME for f in self.functions):
            url = _judge_url(cfg, self_url)
            self._judge = judge.Judge(cfg.judge, url, token=self_token if cfg.judge.url == "self" else "")
        self._specs = [f.spec for f in self._remote] + list(env)  # what each worker loads, in this order
        self._size = cfg.workers
        self._idle: asyncio.Queue[_Worker | None] | None = None  # None in it: a worker to start on use
        self._logged: set[tuple[str, str]] = set()

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    def total(self, rewards: dict[str, float]) -> float:
        return sum(f.weight * rewards[f.name] for f in self.functions)

    def _failed(self, name: str, kind: str, detail: str) -> float:
        self.failures[name, kind] += 1
        self.on_failure(name, kind)
        if (name, kind) not in self._logged:  # once per function and kind; /metrics counts the rest
            self._logged.add((name, kind))
            log.warning("reward function '%s' failed (%s): that completion gets 0 from it; logged once, "
                        "counted in /metrics:\n%s", name, kind, detail)  # fmt: skip
        return 0.0

    def _result(self, name: str, value: Any) -> float:
        reward, kind = checked(value)
        if kind is None:
            return reward
        return self._failed(name, kind, f"it returned {type(value).__name__} {value!r:.200}")

    def _inline(self, calls: list[RewardCall]) -> list[dict[str, float]]:
        out: list[dict[str, float]] = [{} for _ in calls]
        for f in self.functions:
            if not f.inline:
                continue
            for row, call in zip(out, calls, strict=True):
                try:
                    row[f.name] = self._result(f.name, call_function(f.fn, call))
                except Exception:
                    row[f.name] = self._failed(f.name, "raised", traceback.format_exc())
        return out

    async def _in_worker(
        self, index: int, name: str, args: list | dict, any_value: bool
    ) -> tuple[Any, str | None]:
        """Spec `index` of the workers' list called with `args`: (the reply's value, None), or (None, the
        failure kind) once counted and logged. A worker that overran or died is killed and replaced."""
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self._size):
                self._idle.put_nowait(None)
        worker = await self._idle.get()
        keep = False
        try:
            if worker is None:
                worker = await _Worker.start(self._specs)
            reply = await asyncio.wait_for(worker.call(index, args, any_value), self.timeout_s)
            keep = True
        except TimeoutError:
            self._failed(name, "timeout", f"a call ran past reward.timeout_s = {self.timeout_s} s")
            return None, "timeout"
        except (EOFError, ConnectionError, json.JSONDecodeError) as e:
            self._failed(name, "crashed", f"its worker process died during the call ({e!r})")
            return None, "crashed"
        finally:
            if not keep and worker is not None:  # timed out, died, or cancelled mid-call: never reuse
                await worker.kill()
            self._idle.put_nowait(worker if keep else None)
        if "error" in reply:
            self._failed(name, reply["error"], reply.get("detail", ""))
            return None, reply["error"]
        return reply["value"], None

    async def _remote_call(self, index: int, f: RewardFunction, call: RewardCall) -> float:
        value, failed = await self._in_worker(index, f.name, list(call), any_value=False)
        return 0.0 if failed else self._result(f.name, value)

    async def call_env(self, spec: str, args: list | dict) -> tuple[Any, str | None]:
        """The environment's `spec` (given at construction) called with `args` (a dict: keyword
        arguments) in a worker: (its value as JSON, None), or (None, the failure kind), counted under the
        function's name."""
        index = self._specs.index(spec, len(self._remote))
        return await self._in_worker(index, spec.rpartition(":")[2], args, any_value=True)

    async def _model_scores(self, f: RewardFunction, calls: list[RewardCall]) -> list[float]:
        """A reward model's rewards for the calls, batched in a thread; a forward pass that raised gives
        every call 0, each counted."""
        try:
            values = await asyncio.to_thread(f.model.score, [(c.prompt, c.completion) for c in calls])
        except Exception:
            detail = traceback.format_exc()
            return [self._failed(f.name, "raised", detail) for _ in calls]
        return [self._result(f.name, v) for v in values]

    async def _judged(self, calls: list[RewardCall]) -> list[float]:
        if self._judge is None:
            return []
        return await self._judge.score(
            [(c.prompt, c.completion, c.answer) for c in calls],
            lambda kind, detail: self._failed(judge.NAME, kind, detail),
        )

    async def score(self, calls: list[RewardCall]) -> list[dict[str, float]]:
        """Every function's reward for each call: [{name: reward}], in the calls' order."""
        inline = any(f.inline for f in self.functions)
        out = await asyncio.to_thread(self._inline, calls) if inline else [{} for _ in calls]
        jobs = [
            (i, f, row, call)
            for i, f in enumerate(self._remote)
            for row, call in zip(out, calls, strict=True)
        ]
        values, scored, judged = await asyncio.gather(
            asyncio.gather(*(self._remote_call(i, f, c) for i, f, _, c in jobs)),
            asyncio.gather(*(self._model_scores(f, calls) for f in self._models)),
            self._judged(calls),
        )
        for (_, f, row, _), value in zip(jobs, values, strict=True):
            row[f.name] = value
        for f, column in zip(self._models, scored, strict=True):
            for row, value in zip(out, column, strict=True):
                row[f.name] = value
        for row, value in zip(out, judged, strict=False):  # (none without a judge)
            row[judge.NAME] = value
        return [{f.name: row[f.name] for f in self.functions} for row in out]

    async def close(self) -> None:
        if self._judge is not None:
            await self._judge.close()
        if self._idle is None:
            return
        while not self._idle.empty():
            worker = self._idle.get_nowait()
            if worker is not None:
                await worker.kill()
