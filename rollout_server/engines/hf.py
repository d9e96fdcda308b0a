"""transformers + peft `generate` behind the RolloutBackend seam: needs no vLLM, runs anywhere torch
does, and is the correctness reference for the vLLM backend's logprobs. One request at a time, in a
worker thread so the event loop (HTTP, leases) stays responsive."""

from __future__ import annotations

import asyncio
import threading

import torch

from rollout_server.engines.base import Adapter, AdapterLoadError, Piece, Sample, TextRequest, TokenLogprob
from shared.config import TandemConfig


def _until(*events: threading.Event):
    """Stopping criteria that end generation at the next token once any of `events` is set: the request is
    cancelled (the server went to sleep: the worker thread would otherwise compute the whole batch while
    the learner trains), or interrupted by a newer version (generate's `interrupt`)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Cancelled(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stop = any(e.is_set() for e in events)
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool)

    return StoppingCriteriaList([Cancelled()])


async def _relay(interrupt: asyncio.Event, interrupted: threading.Event) -> None:
    """Pass an asyncio event on to the generating thread."""
    await interrupt.wait()
    interrupted.set()


def _logprobs(logprobs: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """[T, V] log-probabilities -> each position's chosen token's and its `top` most likely."""
    values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logprobs.device)[:, None]).squeeze(-1)
    return [
        TokenLogprob(t, lp, {**dict(zip(i, v, strict=True)), t: lp})
        for t, lp, i, v in zip(tokens, chosen.tolist(), ids.tolist(), values.tolist(), strict=True)
    ]


class HFBackend:
    """Two ways to serve an adapter version: as a peft adapter on the shared base (`merge=False`: little
    memory, LoRA's extra matmuls on every token), or as a copy of the base with the adapter merged into
    its weights (`merge=True`, server.adapter_mode = "merge": one model's memory per loaded version, and the
    base model's speed; ~20 % more tokens/s on a 2-core CPU with SmolLM2, logprobs equal to 1e-5)."""

    name = "hf"
    one_version = False  # every loaded version answers at once (a peft adapter or a merged copy each)

    def __init__(self, model, tokenizer, device: str, merge: bool = False):
        self.model = model  # the base model, or a PeftModel once an adapter is loaded (merge=False)
        self.base = model
        self.tokenizer = tokenizer
        self.device = device
        self.merge = merge
        self._lock = threading.Lock()
        self._loaded: set[str] = set()
        self._merged: dict[str, object] = {}  # adapter name -> base copy with the adapter merged in

    @classmethod
    async def create(cls, cfg: TandemConfig, model_path: str) -> HFBackend:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(cfg.server.seed)
        device = "cuda" if torch.cuda.is_available() else "cpu"

        def load():
            tok = AutoTokenizer.from_pretrained(model_path)
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, cfg.model.dtype))
            return model.to(device).eval(), tok

        model, tok = await asyncio.to_thread(load)
        return cls(model, tok, device, merge=cfg.server.adapter_mode == "merge")

    @property
    def _pad_id(self) -> int:
        """The padding token, the EOS token for tokenizers without one."""
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    async def _run(self, fn, *args):
        def locked():
            with self._lock, torch.inference_mode():
                return fn(*args)

        return await asyncio.to_thread(locked)

    def _select(self, adapter: Adapter | None):
        """The context to run under: the adapter's weights, or the base model (adapters disabled)."""
        from contextlib import nullcontext

        if self.merge:
            if adapter is not None and adapter.name not in self._merged:
                self._load(adapter)
            self.model = self._merged[adapter.name] if adapter is not None else self.base
            return nullcontext()
        if adapter is None:
            return self.model.disable_adapter() if self._loaded else nullcontext()
        if adapter.name not in self._loaded:
            self._load(adapter)
        self.model.set_adapter(adapter.name)
        return nullcontext()

    def _generate(self, prompts, n, temperature, max_tokens, adapter, cancelled, logprobs, interrupted=None):
        """`cancelled`, `interrupted`: threading.Events (generate's cancellation and its `interrupt`)."""
        if cancelled.is_set():  # cancelled while this thread waited for the lock: nobody wants the result
            return []
        eos, pad = self.tokenizer.eos_token_id, self._pad_id
        width = max(len(p) for p in prompts)
        rows = [p for p in prompts for _ in range(n)]  # [len(prompts) * n]
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=self.device)
        sample = temperature > 0
        keep_logits = sample and logprobs  # [R, S, V] floats: GBs for a large evaluation request
        with self._select(adapter):
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                do_sample=sample,
                temperature=temperature if sample else None,
                top_p=1.0 if sample else None,
                top_k=0 if sample else None,  # generation_config may default to top_k=50
                max_new_tokens=max_tokens,
                pad_token_id=pad,
                eos_token_id=eos,
                stopping_criteria=_until(cancelled, *([interrupted] if interrupted else [])),
                output_logits=keep_logits,
                return_dict_in_generate=True,
            )
        new = out.sequences[:, width:]  # [R, S]
        if keep_logits:
            logits = torch.stack(out.logits, dim=1).float() / temperature  # [R, S, V]
            token_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None]).squeeze(-1)
        samples = []
        cut_short = new.shape[1] < max_tokens  # interrupted (or every row stopped)
        for r in range(len(rows)):
            ids = new[r].tolist()
            stop = ids.index(eos) + 1 if eos in ids else None
            ids = ids[:stop] if stop else ids
            lps = token_logprobs[r, : len(ids)].tolist() if keep_logits else []
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            reason = "stop" if stop else "interrupted" if cut_short and interrupted is not None else "length"
            samples.append(Sample(ids, lps, text, reason))
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    async def generate(self, prompts, *, n, temperature, max_tokens, adapter, logprobs=True, interrupt=None):
        cancelled = threading.Event()
        interrupted = threading.Event() if interrupt is not None else None
        relay = None
        if interrupt is not None and interrupt.is_set():
            interrupted.set()  # a newer version already: one token each
        elif interrupt is not None:
            relay = asyncio.ensure_future(_relay(interrupt, interrupted))
        try:
            return await self._run(
                self._generate, prompts, n, temperature, max_tokens, adapter, cancelled, logprobs, interrupted
            )
        except asyncio.CancelledError:
            cancelled.set()
            raise
        finally:
            if relay is not None:
                relay.cancel()

    def _text(self, prompt: list[int], request: TextRequest, adapter, cancelled: threading.Event) -> Piece:
        ids = torch.tensor([prompt], device=self.device)
        sample = request.temperature > 0
        prompt_lps = None
        with self._select(adapter):
            if request.prompt_logprobs is not None:
                logits = self.model(input_ids=ids).logits[0, :-1].float()
                prompt_lps = [None, *_logprobs(logits.log_softmax(-1), prompt[1:], request.prompt_logprobs)]
            if request.max_tokens == 0 or cancelled.is_set():
                return Piece([], "", [] if request.logprobs is not None else None, "length", prompt_lps)
            eos = self.tokenizer.eos_token_id
            ends = [eos, *(t for t in request.stop_token_ids if t != eos)]
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=sample,
                temperature=request.temperature if sample else None,
                top_p=request.top_p if sample else None,
                top_k=0 if sample else None,
                max_new_tokens=request.max_tokens,
                pad_token_id=self._pad_id,
                eos_token_id=ends,
                stopping_criteria=_until(cancelled),
                output_scores=request.logprobs is not None,  # after temperature and top_p: what was sampled
                return_dict_in_generate=True,
            )
        new = out.sequences[0, len(prompt) :].tolist()
        finish = "length"
        end = next((i for i, t in enumerate(new) if t in ends), None)
        if end is not None:
            new, finish = new[: end + 1], "stop"
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        hits = [(i, x) for x in request.stop if x and (i := text.find(x)) >= 0]
        if hits:  # as vLLM: the tokens up to the one completing the stop string, the text before it
            cut, hit = min(hits)
            decode = self.tokenizer.decode
            k = next(k for k in range(1, len(new) + 1) if hit in decode(new[:k], skip_special_tokens=True))
            new, text, finish = new[:k], text[:cut], "stop"
        lps = None
        if request.logprobs is not None:
            # generate's scores: the logits divided by the temperature, -inf outside top_p's nucleus (as
            # vLLM's processed logprobs); at temperature 0 the model's own.
            scores = torch.stack(out.scores[: len(new)], dim=1)[0].float()
            lps = _logprobs(scores.log_softmax(-1), new, request.logprobs)
        return Piece(new, text, lps, finish, prompt_lps)

    async def stream(self, prompt, request, adapter):
        """One piece: transformers' generate has no incremental output worth the threads it would take."""
        cancelled = threading.Event()
        try:
            yield await self._run(self._text, prompt, request, adapter, cancelled)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def _score(self, prompt, completion, adapter):
        ids = torch.tensor([prompt + completion], device=self.device)
        with self._select(adapter):
            logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [C, V]
        return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).tolist()

    async def score(self, prompt, completion, adapter):
        return await self._run(self._score, prompt, completion, adapter)

    def _load(self, adapter: Adapter) -> None:
        import copy

        from peft import PeftModel

        try:  # peft raises many types for a bad adapter; say which adapter and why
            if self.merge:
                merged = PeftModel.from_pretrained(copy.deepcopy(self.base), adapter.path).merge_and_unload()
            elif not self._loaded:
                self.model = PeftModel.from_pretrained(self.model, adapter.path, adapter_name=adapter.name)
            else:
                self.model.load_adapter(adapter.path, adapter_name=adapter.name)
        except Exception as e:
            raise AdapterLoadError(f"peft could not load {adapter.name}: {e}") from e
        if self.merge:
            self._merged[adapter.name] = merged.eval()
            return
        self.model.eval()
        self._loaded.add(adapter.name)

    async def load_adapter(self, adapter: Adapter) -> None:
        await self._run(self._load, adapter)

    def _unload(self, adapter: Adapter) -> None:
        if self.merge:
            if self._merged.pop(adapter.name, None) is not None and self.model is not self.base:
                self.model = self.base
            return
        if adapter.name in self._loaded and len(self._loaded) > 1:  # peft keeps >= 1 adapter attached
            self.model.delete_adapter(adapter.name)
            self._loaded.discard(adapter.name)

    async def unload_adapter(self, adapter: Adapter) -> None:
        await self._run(self._unload, adapter)

    def _models(self) -> list:
        """Every model whose weights this backend holds: the base (with its peft adapters) and the merged
        copies."""
        return [self.model if not self.merge else self.base, *self._merged.values()]

    def _move(self, device: str) -> None:
        for model in self._models():
            model.to(device)
        if device == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    async def sleep(self) -> None:
        """On a GPU, the weights go to host RAM until the wake, so that a time-sliced learner has the GPU
        (vLLM's sleep mode does the same for its own weights). On CPU there is nothing to free: the
        producer's pause is what matters. Adapters loaded while asleep land in host RAM and move with
        the rest at the wake."""
        if self.device != "cpu":
            await self._run(self._move, "cpu")

    async def wake(self) -> None:
        if self.device != "cpu":
            await self._run(self._move, self.device)

    async def close(self) -> None:
        return None
