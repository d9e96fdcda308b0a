"""The wire protocol between rollout server and learner (docs/design.md §3). The only schema: FastAPI routes
declare these models and the learner's client parses responses with them.

Token-in/token-out: a group carries the prompt's and each completion's token ids plus the sampler's
per-token logprobs, so the learner never re-tokenises text. Validation lives here, so a malformed payload
is refused at whichever end receives it.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# 6: production can be paused (/v1/production/*, Health.paused, PullResponse.paused)
# 7: Completion.versions, the version that sampled each of a completion's tokens
PROTOCOL_VERSION = "7"

MAX_VERSION = 2**31 - 1  # versions are engine adapter ids (int32 in vLLM) and file names
Version = Annotated[
    int, Field(ge=0, le=MAX_VERSION, description="policy (adapter) version; 0 is the base model")
]
TokenId = Annotated[int, Field(ge=0)]

# POST /v1/adapters is multipart/form-data (weights are binary): these are its fields, and the file names
# peft writes, which the server stores under.
UPLOAD_VERSION_FIELD = "version"
UPLOAD_CONFIG_FIELD = "adapter_config"
UPLOAD_WEIGHTS_FIELD = "adapter_model"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


DEGENERATE_TOL = 1e-6


def is_degenerate(rewards: list[float], tol: float = DEGENERATE_TOL) -> bool:
    """A group whose rewards are all equal (max - min <= tol): zero std, no learning signal. The one
    definition: the server counts these, the learner drops them (dynamic sampling) and zeroes their
    advantages (learner.grpo.degenerate_groups, the same test on tensors)."""
    return max(rewards) - min(rewards) <= tol


def adapter_name(version: int) -> str:
    """The name a policy version is served (and answered) under. Each version has its own: vLLM keys its
    prefix cache by name, and same-name reloads have served stale KV and stale weights (vLLM #42125)."""
    return f"policy-v{version}"


class _Model(BaseModel):
    # No NaN or Infinity anywhere: Python's JSON reader takes them, but they are not JSON and no field of
    # the protocol has a use for them.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Completion(_Model):
    """One sampled completion of a prompt, scored by the reward functions. In an episode of several turns
    (an environment, tools) it is the whole trajectory after the prompt, token-exact: the model's turns as
    the engine sampled them and, between them, the tokens the chat template adds for each environment
    message; `mask` tells the two apart, and only the model's tokens are trained on."""

    token_ids: list[TokenId] = Field(min_length=1)
    # Sampler logprob of each model token (mask 1), in order: log π_sampler(token | all tokens before it).
    logprobs: list[float]
    mask: list[Literal[0, 1]] | None = Field(
        default=None,
        description="per token: 1 sampled by the model, 0 added by the environment (context, never trained "
        "on); None: every token is the model's (a single turn)",
    )
    text: str
    reward: float  # what the learner trains on: the weighted sum of `rewards`
    rewards: dict[str, float] = Field(default={}, description="each reward function's own value, by name")
    finish_reason: Literal["stop", "length"]
    versions: list[tuple[int, Version]] | None = Field(
        default=None,
        description="where each policy version's tokens begin when a new version took over mid-completion "
        "(an in-flight weight update): [model-token index, version] pairs, the first at index 0, both "
        "increasing, no version older than the group's policy_version; indices count the model's tokens "
        "only (environment tokens are unversioned). None: every token from the group's policy_version",
    )

    @model_validator(mode="after")
    def _check(self) -> Completion:
        if self.mask is not None:
            if len(self.mask) != len(self.token_ids):
                raise ValueError(f"mask has {len(self.mask)} values for {len(self.token_ids)} token ids")
            if self.mask[0] != 1 or self.mask[-1] != 1:
                raise ValueError("an episode starts and ends with the model's tokens (mask 1 at both ends)")
        model_tokens = self.num_model_tokens
        if len(self.logprobs) != model_tokens:
            raise ValueError(
                f"logprobs has {len(self.logprobs)} values for {model_tokens} model tokens; "
                "need exactly one per token the model sampled"
            )
        for t, lp in enumerate(self.logprobs):  # finite: no field of the protocol takes NaN or inf
            if lp > 0.0:
                raise ValueError(f"logprobs[{t}] = {lp}: a logprob must be <= 0")
        if self.versions is not None:
            starts = [i for i, _ in self.versions]
            if not self.versions or starts[0] != 0:
                raise ValueError("versions must start at model token 0")
            if starts[-1] >= model_tokens or any(a >= b for a, b in pairwise(starts)):
                raise ValueError(f"versions' token indices must increase and stay below {model_tokens}")
            if any(a >= b for (_, a), (_, b) in pairwise(self.versions)):
                raise ValueError("versions must increase: a later token never comes from an older version")
        return self

    def token_versions(self, version: int) -> list[int]:
        """The version that sampled each model token; `version` (the group's) when `versions` is None."""
        if self.versions is None:
            return [version] * self.num_model_tokens
        ends = [i for i, _ in self.versions[1:]] + [self.num_model_tokens]
        return [v for (start, v), end in zip(self.versions, ends, strict=True) for _ in range(end - start)]

    @property
    def num_model_tokens(self) -> int:
        return len(self.token_ids) if self.mask is None else sum(self.mask)

    @property
    def model_mask(self) -> list[int]:
        """1 per token the model sampled, 0 per environment token."""
        return [1] * len(self.token_ids) if self.mask is None else list(self.mask)


class ScoredGroup(_Model):
    """G completions of one prompt. `policy_version` is the version that sampled the group's oldest token:
    every token when no completion says otherwise; with in-flight weight updates newer versions take over
    mid-completion (Completion.versions)."""

    group_id: str = Field(min_length=1)
    prompt_id: str = Field(min_length=1)
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    answer: str  # the reference final answer the rewards were computed against
    policy_version: Version
    completions: list[Completion] = Field(min_length=2)

    @model_validator(mode="after")
    def _check_versions(self) -> ScoredGroup:
        for i, c in enumerate(self.completions):
            if c.versions is not None and c.versions[0][1] < self.policy_version:
                raise ValueError(
                    f"completion {i}'s first token is from v{c.versions[0][1]}, older than the group's "
                    f"policy_version v{self.policy_version} (the version of its oldest token)"
                )
        return self

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]

    def token_lags(self, version: int) -> list[int]:
        """How many versions behind `version` each model token of the group is, completion after
        completion (its staleness per token; the group's oldest token is `version - policy_version`)."""
        return [version - v for c in self.completions for v in c.token_versions(self.policy_version)]


class PullRequest(_Model):
    max_groups: int = Field(ge=1, le=4096)
    wait_s: float = Field(default=0.0, ge=0.0, le=600.0, description="block up to this long for >= 1 group")
    # The puller's own id for this pull, the same on each retry: a retried pull whose first answer was
    # lost on the way (a reset connection, a timeout) gets the same lease back, not a second one that
    # would hold its groups until the lease ran out.
    request_id: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")


class PullResponse(_Model):
    # None when no group was available within wait_s: there is nothing to ack.
    lease_id: str | None
    lease_s: float = Field(ge=0.0, description="seconds until un-acked groups return to the queue")
    groups: list[ScoredGroup]
    # production is paused (POST /v1/production/pause): what is queued is all there is until a resume
    paused: bool = False


class AckRequest(_Model):
    lease_id: str = Field(min_length=1)


class AckResponse(_Model):
    acked: int = Field(ge=0)


class ReleaseRequest(_Model):
    """Give a lease back untrained: its groups return to the front of the queue now, not at expiry. By
    `request_id` instead: the lease a pull of that id was answered with, if it is still held (a learner
    killed between the server's answer and its record of the lease id releases it so at its restart)."""

    lease_id: str | None = Field(default=None, min_length=1)
    request_id: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")

    @model_validator(mode="after")
    def _one(self) -> ReleaseRequest:
        if (self.lease_id is None) == (self.request_id is None):
            raise ValueError("give either lease_id or request_id")
        return self


class ReleaseResponse(_Model):
    released: int = Field(ge=0)


class Health(_Model):
    status: Literal["ok"] = "ok"
    protocol_version: str = PROTOCOL_VERSION
    backend: str
    model: str
    policy_version: Version
    sleeping: bool
    paused: bool = False  # POST /v1/production/pause: no new generation until /v1/production/resume
    group_size: int = Field(ge=2)
    queue_depth: int = Field(ge=0)
    leased: int = Field(ge=0)
    # server.backend = "openai": each endpoint's URL, whether it is up, the versions loaded there, and why
    # it is down
    engines: list[dict[str, Any]] | None = None


class AdapterPathRequest(_Model):
    """Publish an adapter that already lies in a folder under the server's adapter root."""

    version: Version
    path: str = Field(min_length=1, description="folder relative to the server's adapter_root")


class AdapterPublished(_Model):
    version: Version
    name: str


class ChatMessage(_Model):
    role: str = Field(min_length=1, max_length=64)
    content: str = Field(max_length=100_000)


class EpisodeRow(_Model):
    """What an environment needs of a prompt's row to play it: the reference answer and the metadata."""

    answer: str = Field(default="", max_length=100_000)
    metadata: dict[str, Any] = {}


class GenerateRequest(_Model):
    """Plain sampling for evaluation: either `prompts`, rendered as training prompts are without a row
    (the config's system prompt and prompt template with the string as {prompt}, then the chat template),
    or whole conversations in `messages`, put through the chat template as they are."""

    prompts: list[Annotated[str, Field(max_length=100_000)]] | None = Field(
        default=None, min_length=1, max_length=1024
    )
    messages: list[Annotated[list[ChatMessage], Field(min_length=1, max_length=256)]] | None = Field(
        default=None, min_length=1, max_length=1024
    )
    version: Version | None = Field(default=None, description="adapter version; None = the one served")
    n: int = Field(default=1, ge=1, le=64)
    temperature: float = Field(default=0.0, ge=0.0, le=5.0, description="0 = greedy")
    max_tokens: int | None = Field(default=None, ge=1, le=32768)
    rows: list[EpisodeRow] | None = Field(
        default=None,
        description="one per prompt: play each sample as an episode in the server's environment (env.kind "
        "other than single_turn), max_tokens a turn; the output's text is then the model's last turn",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> GenerateRequest:
        if (self.prompts is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompts' and 'messages'")
        if self.rows is not None and len(self.rows) != self.count:
            raise ValueError(
                f"'rows' has {len(self.rows)} entries for {self.count} prompts; give one per prompt"
            )
        return self

    @property
    def count(self) -> int:
        return len(self.prompts if self.prompts is not None else self.messages)


class GeneratedText(_Model):
    text: str
    token_ids: list[TokenId]  # an episode's: everything after the prompt, the environment's tokens included
    finish_reason: Literal["stop", "length"]
    turns: int = Field(default=1, ge=1, description="the model's turns (an episode's; else 1)")
    messages: list[ChatMessage] | None = Field(
        default=None, description="an episode's whole conversation, the prompt's messages first"
    )


class GenerateResponse(_Model):
    version: Version
    prompt_token_ids: list[list[TokenId]]
    outputs: list[list[GeneratedText]]  # [len(prompts)][n]


class ScoreRequest(_Model):
    """Teacher-forced logprobs of a given completion under an adapter version (diagnostics, tests)."""

    prompt_token_ids: list[TokenId] = Field(min_length=1)
    completion_token_ids: list[TokenId] = Field(min_length=1)
    version: Version | None = None


class ScoreResponse(_Model):
    version: Version
    logprobs: list[float]


class SleepState(_Model):
    sleeping: bool


class ProductionState(_Model):
    """POST /v1/production/pause and /resume: paused, the server starts no new generation (what is in
    flight finishes and is queued); the engine stays awake for evaluation and the OpenAI routes."""

    paused: bool
