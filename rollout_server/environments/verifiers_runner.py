"""Episodes of a `verifiers` environment played on this server's engine (env.kind = "verifiers").

The library runs unchanged: its harness program drives the conversation (turns, tools, the env's own
control flow between seats), its training client renders each turn to token ids and asks this server's
token route (POST /inference/v1/generate) for it, naming the version the producer holds, so every turn of
an episode samples from one version; its rewards and judges score the trace. The episode's trace carries,
per branch, the token ids, which of them the model sampled, and their logprobs.

Nothing of it is trusted: before an episode becomes a completion, each span the model sampled is checked
against the server's own record of what the engine answered (token_api.Records, by content): the prompt the
engine was given (every token before the span), every token and every logprob, bit for bit. An episode
that fails the check (a harness that edits replies, a client that re-renders the conversation) makes its
group invalid: counted and logged, never trained on. The completion is the branch after its first sampled
token, the mask telling the model's tokens from the harness's, up to the model's last token.

The runner's own requests carry a per-process secret header: they are production, not evaluation, and do
not take server.openai_max_sequences' slots."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from dataclasses import dataclass

import httpx

from shared import verifiers_tasks
from shared.config import TandemConfig
from shared.protocol import adapter_name

log = logging.getLogger("tandem.server")
PRODUCTION_HEADER = "x-tandem-production"


@dataclass
class Played:
    """One episode as tandem trains it."""

    prompt_ids: list[int]  # the branch before the model's first token
    token_ids: list[int]  # the rest, up to the model's last token
    mask: list[int]  # 1: sampled by the model
    logprobs: list[float]  # one per sampled token
    finish_reason: str  # the last turn's: "stop" or "length"
    last_reply: str
    rewards: dict[str, float]  # each reward's score, by name
    total: float  # their weighted sum (the library's weights)
    failed: str | None  # the episode's first error (its rewards then count 0)


def as_played(episode, records, version: int) -> Played | str:
    """The episode's one trainable branch as a completion, each sampled span checked against `records`
    (what the engine answered, for `version`); a string says why it cannot be trained on."""
    traces = [t for t in episode.traces if t.agent.trainable]
    if len(traces) != 1:
        return f"{len(traces)} trainable traces in an episode (tandem trains one)"
    trace = traces[0]
    branches = [b for b in trace.branches if b.trainable]
    if len(branches) != 1:
        return f"{len(branches)} trainable branches in a trace (tandem trains one)"
    branch = branches[0]
    ids, sampled, lps = branch.token_ids, branch.sampled_mask, branch.logprobs
    if True not in sampled:
        return "the model sampled no token"
    start, end = sampled.index(True), len(sampled) - sampled[::-1].index(True)
    i = start
    while i < end:  # each span of sampled tokens, with everything before it as its prompt
        j = i
        while j < end and sampled[j]:
            j += 1
        if why := records.check(version, ids[:i], ids[i:j], lps[i:j]):
            return f"a sampled span at token {i - start}: {why}"
        while j < end and not sampled[j]:
            j += 1
        i = j
    rewards, total = verifiers_tasks.trace_rewards(trace)
    finish = trace.calls[-1].finish_reason if trace.calls else None
    errors = [*episode.errors, *trace.errors]
    return Played(
        prompt_ids=ids[:start],
        token_ids=ids[start:end],
        mask=[int(m) for m in sampled[start:end]],
        logprobs=[lp for lp, m in zip(lps[start:end], sampled[start:end], strict=True) if m],
        finish_reason="length" if finish == "length" else "stop",
        last_reply=trace.last_reply or "",
        rewards=rewards,
        total=total,
        failed=None if episode.ok else (f"{errors[0].type}: {errors[0].message}" if errors else "not ok"),
    )


class VerifiersRunner:
    def __init__(self, cfg: TandemConfig, records, model_path: str):
        self.cfg, self.records, self.model_path = cfg, records, model_path
        self.env, self.tasks = verifiers_tasks.load(cfg.env)
        self.renderer = verifiers_tasks.renderer_config(cfg.env)
        self.secret = secrets.token_hex(16)
        host = cfg.server.host if cfg.server.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        self.url = f"http://{host}:{cfg.server.port}"
        self.key_var = verifiers_tasks.prepare_process(os.environ.get(cfg.server.api_token_env))
        self._serving: contextlib.AsyncExitStack | None = None
        self._lock = asyncio.Lock()

    def context(self, version: int):
        import verifiers.v1 as vf

        s = self.cfg.sampling
        client = vf.TrainClientConfig(
            base_url=f"{self.url}/v1",
            api_key_var=self.key_var,
            renderer=self.renderer,
            renderer_model_name=self.model_path,
            headers={PRODUCTION_HEADER: self.secret},
        )
        sampling = vf.SamplingConfig(max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=1.0)
        model = adapter_name(version) if version else "base"
        return vf.ModelContext(model=model, client=client, sampling=sampling)

    async def _start(self) -> None:
        """The environment's serving resources (tool servers, the interception the harness talks to), once
        this server answers its own requests (the producer starts before uvicorn listens)."""
        async with self._lock:
            if self._serving is not None:
                return
            deadline = time.monotonic() + 120
            async with httpx.AsyncClient(timeout=5) as http:
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get(f"{self.url}/health")).status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"env.kind = 'verifiers': no answer from {self.url}")
                    await asyncio.sleep(0.2)
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(self.env.serving())
            self._serving = stack
            log.info("verifiers environment '%s' serving (%d tasks)", self.env.config.env_id, len(self.tasks))

    async def play(self, task_index: int, n: int, version: int) -> list[Played | str]:
        """`n` episodes of the task, every turn sampled by `version`. The library records an episode's
        failures on it; anything it raises instead is this episode's reason not to be trained on (logged
        with its traceback), not the server's end."""
        await self._start()
        ctx = self.context(version)
        slots = self.env.slots(self.tasks[task_index], n)
        episodes = await asyncio.gather(
            *(self.env.run_slot(slot, ctx) for slot in slots), return_exceptions=True
        )
        out: list[Played | str] = []
        for e in episodes:
            if isinstance(e, asyncio.CancelledError):
                raise e
            if isinstance(e, BaseException):
                log.error("the verifiers environment raised", exc_info=e)
                out.append(f"the environment raised {type(e).__name__}: {e}")
            else:
                out.append(as_played(e, self.records, version))
        return out

    async def close(self) -> None:
        if self._serving is not None:
            stack, self._serving = self._serving, None
            await stack.aclose()
