"""The processes' sections of the config: `server` (and `server.vllm`), and the learner's `lora`, `grpo`,
`learner` and `deepspeed`. shared/config.py assembles them with the others into TandemConfig."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from shared.config_base import TOKEN_ENV, Section


class VllmConfig(Section):
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
    worker_in_engine_process: bool = Field(
        default=True,
        description="CPU, one rank (tensor and data parallel size 1): vLLM's model worker runs inside its "
        "engine process, not in a process of its own, and the server forks that process rather than "
        "spawning it, so no fresh Python imports torch and vLLM again at start: ready in ~18 s instead of "
        "44 on 2 cores, decode unchanged (docs/benchmarks.md §17). False: vLLM's CPU default (an engine "
        "process and a worker process, each spawned). Ignored on GPUs and with several ranks",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="devices one engine shards every layer over (vLLM's tensor parallelism): GPUs, or on CPU "
        "groups of cores (cpu_threads split evenly); merge mode writes each rank's shard of a version",
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        description="engine replicas inside this server (vLLM's data parallelism), tensor_parallel_size "
        "devices each; vLLM spreads the server's batches over them. GPUs only",
    )
    eval_switch_every_s: float = Field(
        default=30.0,
        ge=0,
        description="merge mode: OpenAI-compatible requests for another version than the served one switch "
        "the engine's weights at most this often (training first); those waiting run together then",
    )


class OpenAIEngineConfig(Section):
    endpoints: list[str] = Field(
        default=[],
        description="base URLs of the vLLM OpenAI-compatible servers to sample from (server.backend = "
        "'openai'), e.g. ['http://10.0.0.5:8000']; each started with --enable-lora --enable-scale-out "
        "--logprobs-mode processed_logprobs and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (checked at start)",
    )
    adapter_dir: str | None = Field(
        default=None,
        description="the folder where the endpoints read this server's adapter store (state_dir/adapters), "
        "e.g. a shared volume mounted elsewhere on their machines; unset: the store's own absolute path",
    )
    api_key_env: str = Field(
        default="TANDEM_ENGINE_API_KEY",
        description="environment variable holding the endpoints' API key (vLLM's --api-key); unset or "
        "empty: none sent",
    )
    probe_s: float = Field(
        default=2.0, gt=0, description="how often each endpoint's health is probed (a lost one rejoins then)"
    )
    start_wait_s: float = Field(
        default=600.0, ge=0, description="at start, how long to wait for a first endpoint to answer"
    )

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"'{url}' is not an http(s) URL")
        if len({u.rstrip("/") for u in urls}) != len(urls):
            raise ValueError("an endpoint is listed twice")
        return [u.rstrip("/") for u in urls]


class ServerConfig(Section):
    backend: Literal["vllm", "hf", "openai"] = Field(
        default="vllm",
        description="'vllm' (the default; merged versions or vLLM's LoRA, server.vllm), 'hf' (transformers"
        " + peft: no vLLM needed, slower) or 'openai' (vLLM servers you already run, server.openai)",
    )
    host: str = Field(default="127.0.0.1", description="bind address; loopback unless told otherwise")
    port: int = Field(default=8000, ge=1, le=65535, description="the port the server listens on")
    api_token_env: str = Field(
        default=TOKEN_ENV,
        description="environment variable holding the bearer token for mutating endpoints (unset or empty "
        "= no auth); the learner and the scripts send the token they find there",
    )
    open_without_token: bool = Field(
        default=False,
        description="serve a non-loopback server.host with no token (anyone who reaches the port may "
        "publish adapters, lease groups, generate): only on a network you trust. False: such a server "
        "refuses to start",
    )
    queue_size: int = Field(
        default=64,
        ge=1,
        description="max scored groups queued or leased; time-sliced, ~learner.prompts_per_step (the rest "
        "goes stale while the learner trains)",
    )
    prompts_per_batch: int = Field(
        default=8, ge=1, description="lockstep production: prompts sent to the backend at once"
    )
    production: Literal["lockstep", "continuous"] | None = Field(
        default=None,
        description="'lockstep': prompts_per_batch prompts at a time, the next batch once all are queued; "
        "'continuous': each group started, scored and queued on its own, up to max_inflight_groups at "
        "once, so the engine never waits for a batch's slowest completion. None: 'continuous' in split "
        "placement (learner.placement; the engine never sleeps, and the tail cost lockstep 1.18-1.85x its "
        "tokens/s) or with inflight_updates = 'continue', else 'lockstep' (time-sliced: the engine sleeps "
        "each step, and groups in flight then would be aborted and made again)",
    )
    inflight_updates: Literal["off", "continue", "keep"] = Field(
        default="off",
        description="what a publish does to the samples in flight (continuous production): 'off': each "
        "group sampled by the version served when it started; 'continue': unfinished samples are "
        "interrupted and continued under the new version from their prompt and the tokens sampled so far "
        "(each token stamped with its version: adapter_mode 'lora' or the hf backend); 'keep' (vLLM "
        "pausing with its KV cache across a merged-weights switch) is not built yet",
    )
    max_inflight_groups: int | None = Field(
        default=None,
        ge=1,
        description="continuous production: groups in flight at most (also bounded by the queue's room); "
        "None: 2 x ceil(vllm.max_num_seqs / group_size) on vLLM (its batch kept full while groups finish "
        "their slowest samples), prompts_per_batch on other engines",
    )
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
        "API: the newest this many, and every learner.keep_every-th (those the learner keeps a "
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
    openai: OpenAIEngineConfig = OpenAIEngineConfig()

    @model_validator(mode="after")
    def _external_engine(self) -> ServerConfig:
        updates = self.inflight_updates
        if updates == "keep":
            raise ValueError(
                "server.inflight_updates = 'keep' (a vLLM engine paused with its KV cache across a "
                "merged-weights switch) is not built yet: use 'continue' with server.adapter_mode = 'lora', "
                "or 'off'"
            )
        if updates == "continue" and self.production == "lockstep":
            raise ValueError(
                "server.inflight_updates = 'continue' updates the groups in flight of continuous production: "
                "set server.production = 'continuous' (lockstep holds one version a batch), or use 'off'"
            )
        if updates == "continue" and self.backend == "vllm" and self.adapter_mode == "merge":
            raise ValueError(
                "server.inflight_updates = 'continue' runs each version's samples beside the others' as LoRA "
                "adapters; merged weights hold one version at a time: set server.adapter_mode = 'lora', or "
                "use 'off'"
            )
        if updates == "continue" and self.backend == "openai":
            raise ValueError(
                "server.inflight_updates = 'continue' is not built for an external engine "
                "(server.backend = 'openai') yet: use 'off'"
            )
        if self.backend == "openai":
            if not self.openai.endpoints:
                raise ValueError(
                    "server.backend = 'openai' needs server.openai.endpoints (the engines' URLs)"
                )
            if self.adapter_mode == "merge":
                raise ValueError(
                    "server.adapter_mode = 'merge' needs the engine in this process; an external engine "
                    "(server.backend = 'openai') serves versions through its LoRA layers: use 'lora'"
                )
        return self


class LoraConfig(Section):
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


class GRPOConfig(Section):
    """Every numerical convention of the loss, named (docs/design.md §4)."""

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
        description="how token terms make the loss (docs/design.md §4): 'seq_mean_token_mean' (GRPO Eq. 3), "
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


class DeepSpeedConfig(Section):
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


class TrackersConfig(Section):
    """learner.report_to's experiment trackers: each library's usual settings. Their own environment
    variables (WANDB_API_KEY, WANDB_MODE, WANDB_ENTITY, TRACKIO_DIR, MLFLOW_TRACKING_URI, ...) still apply
    where a field is left unset."""

    project: str = Field(default="tandem", description="W&B and Trackio project, MLflow experiment")
    run_name: str | None = Field(
        default=None, description="the tracker run's display name (default: the tracker's own choice)"
    )
    tags: list[str] = Field(default=[], description="W&B and MLflow tags of the run")
    samples_every: int = Field(
        default=10,
        ge=1,
        description="log a table of sampled trajectories every this many steps (and at step 1)",
    )
    samples_rows: int = Field(
        default=16, ge=1, le=1024, description="trajectories in each samples table (whole groups, in order)"
    )
    wandb_entity: str | None = Field(
        default=None, description="W&B entity (team or user); default WANDB_ENTITY"
    )
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        default=None, description="W&B mode; default WANDB_MODE, else online"
    )
    trackio_dir: str | None = Field(
        default=None, description="Trackio's local store; default TRACKIO_DIR, else the HF cache's trackio/"
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI (a server, 'sqlite:///mlflow.db', or a file store); default "
        "MLFLOW_TRACKING_URI, else MLflow's default",
    )
    flush_s: float = Field(
        default=60.0,
        ge=0,
        description="at the end of the run, wait at most this long for the trackers to send what is queued",
    )


class LearnerConfig(Section):
    server_urls: list[str] = Field(
        default=["http://127.0.0.1:8000"],
        min_length=1,
        description="the rollout server(s) the learner pulls from and publishes to: one URL, or several "
        "(each server with its own server.shard_index; on the command line a TOML list or a comma-separated "
        "string). With several, the learner pulls from all, skips one that is down and brings it to the "
        "current version when it is back; it stops only when none answers for server_retry_s",
    )

    @field_validator("server_urls", mode="before")
    @classmethod
    def _one_or_several(cls, v):
        return [u.strip() for u in v.split(",") if u.strip()] if isinstance(v, str) else v

    server_probe_s: float = Field(
        default=5.0,
        gt=0,
        description="with several server_urls: how often a server that is down is tried again",
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
    packed_attention: Literal["segments", "mask"] = Field(
        default="segments",
        description="with shared_prompt on an SDPA model: 'segments' attends each packed completion to its "
        "prompt and itself only (the arithmetic needed); 'mask': SDPA over the whole row under its mask, "
        "the reference (learner/attention.py)",
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
    keep_every: int = Field(
        default=10,
        ge=1,
        description="a checkpoint is written after every step (before its groups are acked, so a resume "
        "never loses or repeats a group); every keep_every-th one is kept for good",
    )
    keep_checkpoints: int = Field(
        default=2,
        ge=1,
        description="the newest checkpoints kept besides the keep_every-th ones; the published "
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
    served_policy_max_gap: float | None = Field(
        default=None,
        ge=0,
        description="the served-policy check: a step whose groups of the learner's own version have sampler "
        "log-probs that differ from the learner's by more than this (mean nats a token) stops the learner "
        "with one line, nothing acked: the server does not serve the weights it was given. Default: 10x "
        "and more the gap measured when it does: 0.01 in float32 (measured 3e-6 to 1e-5), 0.25 in bf16 "
        "(~0.025); a server that kept its old weights gave 27. 0: off",
    )
    replay_file: str | None = Field(
        default=None,
        description="train on the groups recorded in a previous run's groups.jsonl instead of a server "
        "(offline: debugging, and checking that N processes reproduce 1)",
    )
    seed: int = Field(default=0, description="the LoRA initialisation's seed")
    profile_step: int | None = Field(
        default=None,
        ge=1,
        description="profile this step's training (forward, backward, optimizer) with torch.profiler: the "
        "operators by self time in out_dir/profile/step_<N>.txt and a Chrome trace beside it; None: off",
    )
    report_to: list[Literal["tensorboard", "wandb", "trackio", "mlflow"]] = Field(
        default=["tensorboard"],
        description="where each step's metrics go besides metrics.jsonl: any of 'tensorboard', 'wandb', "
        "'trackio', 'mlflow' (each library an extra: pip install 'tandem[wandb]'); [] for none. A tracker "
        "runs on its own thread: one that fails or is slow never stops or slows training",
    )
    trackers: TrackersConfig = TrackersConfig()

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, v):
        return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        if self.lag_steps and self.replay_file:
            raise ValueError("learner.lag_steps does not apply to learner.replay_file (unset one of them)")
        if len(set(self.report_to)) != len(self.report_to):
            raise ValueError(f"learner.report_to names a tracker twice: {self.report_to}")
        return self
