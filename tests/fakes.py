"""A deterministic in-process engine behind the RolloutBackend protocol, and the app built on it: the fast
tests of the server's logic (routes, producer, policy) run on these; the real engines run end to end in
the slow tests."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

from rollout_server.engines.base import GenerationAborted, Piece, Sample, TokenLogprob
from rollout_server.serving.app import create_app
from shared.config import TandemConfig
from shared.datasets import Problem

PROBLEMS = [Problem(f"arith-train-{i}", f"What is {i} + 1?", "3") for i in range(20)]


class FakeTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **ignored):  # (tools: no place)
        return [1] + [2 + ord(ch) % 90 for m in messages for ch in m["content"]]

    def encode(self, text):
        return [2 + ord(ch) % 90 for ch in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def __len__(self):
        return 100


class FakeBackend:
    """Sample i of a prompt answers "#### 3" when i is even and "#### 4" when odd (so with the answer 3
    every group has rewards 1, 0, 1, 0, ...), with logprob -0.5 a token. Records each generate call's
    shape and adapter, and the adapters loaded and unloaded.

    fail_after: calls past this many raise (an engine that died). delay_s: each call takes this long.
    abort_first: the first call is aborted as vLLM's sleep() aborts requests. release: an asyncio.Event
    that each call waits for (the test sets it to let the batch finish). unusable: (prompt token ids,
    "empty" | "nan"): that prompt's first sample comes back with no tokens or with a NaN logprob. cut: the
    sample of each prompt with this index stops at max_tokens (finish_reason "length").

    With generate's `interrupt` (in-flight updates) a sample is SAMPLE_TOKENS tokens (at most max_tokens)
    of id 20 + v, logprob -0.5 - 0.1 v (v: the adapter version), ending "stop" with the text above: the
    first `hold_after` at once, the rest once `release` is set; an interrupt before that returns the
    samples as far as they got ("interrupted"). Each such call's (prompt, n, max_tokens, v) is in
    `interruptible`.
    """

    SAMPLE_TOKENS = 4

    name = "fake"
    one_version = False  # a test sets it to act as vLLM's merge mode

    def __init__(
        self,
        fail_after: int | None = None,
        delay_s: float = 0.0,
        abort_first: bool = False,
        release: asyncio.Event | None = None,
        unusable: tuple[list[int], str] | None = None,
        cut: int | None = None,
    ):
        self.tokenizer = FakeTokenizer()
        self.calls: list[tuple[int, int]] = []  # (prompts, n) of each call
        self.texts: list[tuple] = []  # (prompt, TextRequest, adapter version) of each stream()
        self.streaming = self.peak_streaming = 0  # stream() calls running now, and the most at once
        self.adapters: list[int] = []  # the adapter version (0: base) of each call
        self.loaded: list[int] = []
        self.unloaded: list[int] = []
        self.fail_after, self.delay_s, self.abort_first = fail_after, delay_s, abort_first
        self.release, self.unusable, self.cut = release, unusable, cut
        self.started = asyncio.Event()  # set when a generate call begins
        self.hold_after = 2
        self.interruptible: list[tuple[list[int], int, int, int]] = []

    async def generate(self, prompts, *, n, temperature, max_tokens, adapter, logprobs=True, interrupt=None):
        if interrupt is not None:
            return await self._interruptible(prompts, n, max_tokens, adapter, interrupt)
        self.calls.append((len(prompts), n))
        self.adapters.append(adapter.version if adapter else 0)
        self.started.set()
        if self.fail_after is not None and len(self.calls) > self.fail_after:
            raise RuntimeError("engine core died")
        if self.abort_first and len(self.calls) == 1:
            raise GenerationAborted("the engine did not finish the request (abort)")
        await asyncio.sleep(self.delay_s)
        if self.release is not None:
            await self.release.wait()
        lp = [-0.5] if logprobs else []
        reason = ["length" if i == self.cut else "stop" for i in range(n)]
        out = [[Sample([7], lp, f"#### {3 + i % 2}", reason[i]) for i in range(n)] for _ in prompts]
        for row, prompt in zip(out, prompts, strict=True):
            if self.unusable and list(prompt) == list(self.unusable[0]):
                kind = self.unusable[1]
                row[0] = (
                    Sample([], [], "", "stop")
                    if kind == "empty"
                    else Sample([7], [math.nan], "#### 3", "stop")
                )
        return out

    async def _interruptible(self, prompts, n, max_tokens, adapter, interrupt):
        v = adapter.version if adapter else 0
        self.interruptible += [(list(p), n, max_tokens, v) for p in prompts]
        self.started.set()
        length = min(max_tokens, self.SAMPLE_TOKENS)
        done = length <= self.hold_after
        if not done and self.release is not None:
            waits = {asyncio.ensure_future(self.release.wait()), asyncio.ensure_future(interrupt.wait())}
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
            done = self.release.is_set()
        k = length if done else self.hold_after

        def sample(i):
            ids, lps = [20 + v] * k, [-0.5 - 0.1 * v] * k
            return Sample(ids, lps, f"#### {3 + i % 2}" if done else "", "stop" if done else "interrupted")

        return [[sample(i) for i in range(n)] for _ in prompts]

    async def score(self, prompt, completion, adapter):
        return [-0.5] * len(completion)

    async def stream(self, prompt, request, adapter):
        """An OpenAI-style sequence, a token a piece: tokens 20+v, 21+v, ... (v: the adapter version), five
        and a stop, or max_tokens; each token's logprob -0.5, the next ids' -1.5, -2.5, ...; every prompt
        token's -1.0. Honours stop strings and stop token ids, delay_s (per token), release and
        abort_first."""
        v = adapter.version if adapter else 0
        self.texts.append((list(prompt), request, v))
        self.started.set()
        if self.abort_first and len(self.texts) == 1:
            raise GenerationAborted("the engine did not finish the request (abort)")
        self.streaming += 1
        self.peak_streaming = max(self.peak_streaming, self.streaming)
        try:
            async for piece in self._pieces(prompt, request, v):
                yield piece
        finally:
            self.streaming -= 1

    async def _pieces(self, prompt, request, v):

        def entry(t, lp, k):
            return TokenLogprob(t, lp, {t: lp} | {t + j: lp - j for j in range(1, k + 1)})

        prompt_lps = None
        if request.prompt_logprobs is not None:
            prompt_lps = [None] + [entry(t, -1.0, request.prompt_logprobs) for t in prompt[1:]]
        if request.max_tokens == 0:
            yield Piece([], "", [] if request.logprobs is not None else None, "length", prompt_lps)
            return
        text = ""
        for i in range(request.max_tokens):
            await asyncio.sleep(self.delay_s)
            if self.release is not None:
                await self.release.wait()
            t = 20 + v + i
            piece = self.tokenizer.decode([t])
            hit = next((x for x in request.stop if x in text + piece), None)
            if hit is not None:
                keep = (text + piece).index(hit) - len(text)
                lps = [entry(t, -0.5, request.logprobs)] if request.logprobs is not None else None
                yield Piece([t], piece[: max(0, keep)], lps, "stop", prompt_lps if i == 0 else None)
                return
            text += piece
            end = "stop" if i == 4 or t in request.stop_token_ids else None
            end = end or ("length" if i == request.max_tokens - 1 else None)
            lps = [entry(t, -0.5, request.logprobs)] if request.logprobs is not None else None
            yield Piece([t], piece, lps, end, prompt_lps if i == 0 else None)
            if end:
                return

    async def load_adapter(self, adapter):
        self.loaded.append(adapter.version)

    async def unload_adapter(self, adapter):
        self.unloaded.append(adapter.version)

    async def sleep(self): ...
    async def wake(self): ...
    async def close(self): ...


def fake_app(
    tmp_path: Path,
    backend: FakeBackend,
    on_fatal=lambda: None,
    problems=PROBLEMS,
    reward=None,
    env=None,
    model=None,
    sampling=None,
    **server,
):
    """The real app (G = 4, batches of 2 prompts) on `backend`, state under tmp_path/state; `reward`, `env`,
    `model` and `sampling`: those sections (sampling's group_size 4 unless it says otherwise)."""
    cfg = TandemConfig.model_validate(
        {
            "sampling": {"group_size": 4, **(sampling or {})},
            "server": {"state_dir": str(tmp_path / "state"), "prompts_per_batch": 2, **server},
            "reward": reward or {},
            "env": env or {},
            "model": model or {},
        }
    )

    async def factory():
        return backend

    return create_app(cfg, problems, str(tmp_path), factory, on_fatal)


def tiny_adapter(folder: Path, r: int = 2, value: float = 0.01) -> Path:
    """A valid peft-format LoRA adapter on layer 0's q_proj (8 x 8), for a server whose model has no
    weights on disk (its shapes are not checked then)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.full((r, 8), value),
            f"{prefix}.lora_B.weight": torch.full((8, r), value),
        },
        str(folder / "adapter_model.safetensors"),
    )
    return folder
