"""The external-engine backend's logic (server.backend = "openai") against fake vLLM endpoints served by
httpx's MockTransport: what it checks at start, where each version goes, what happens when an endpoint is
lost and comes back. The real engines run in tests/test_external_engine_e2e.py."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from transformers import AutoTokenizer

from rollout_server.engines.base import Adapter, AdapterLoadError
from rollout_server.engines.external import OpenAIBackend, check_processed_logprobs
from shared.config import ConfigError, TandemConfig

RAW = {10: -0.5, 11: -1.5, 12: -3.0}  # the fake model's next-token logprobs, at every position


def _processed(t: float) -> dict[int, float]:
    z = {tok: lp / t for tok, lp in RAW.items()}
    lse = math.log(sum(math.exp(v) for v in z.values()))
    return {tok: v - lse for tok, v in z.items()}


class FakeEngine:
    """What tandem asks of a vLLM server: /v1/models, /tokenize, the token route, runtime LoRA."""

    def __init__(self, tokenizer, *, processed=True, scale_out=True, runtime_lora=True, max_model_len=1024):
        self.tokenizer = tokenizer
        self.processed, self.scale_out, self.runtime_lora = processed, scale_out, runtime_lora
        self.max_model_len = max_model_len
        self.up = True
        self.loras: dict[str, str] = {}
        self.refuse: set[str] = set()  # adapter names whose load fails (400)
        self.requests: list[str] = []  # the model each generate request named

    def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        path, body = request.url.path, (request.read() and __import__("json").loads(request.content))
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            model = {"id": "base", "parent": None, "max_model_len": self.max_model_len}
            return httpx.Response(
                200, json={"data": [model] + [{"id": n, "parent": "base"} for n in self.loras]}
            )
        if path == "/tokenize":
            return httpx.Response(
                200, json={"tokens": self.tokenizer.encode(body["prompt"], add_special_tokens=False)}
            )
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            if not self.runtime_lora:
                return httpx.Response(404, json={"detail": "Not Found"})
            name = body["lora_name"]
            if path.startswith("/v1/unload"):
                if self.loras.pop(name, None) is None:
                    return httpx.Response(404, json={"error": {"message": f"'{name}' not found"}})
                return httpx.Response(200, text="ok")
            if name in self.refuse:
                return httpx.Response(400, json={"error": {"message": "bad adapter"}})
            if name in self.loras:
                return httpx.Response(400, json={"error": {"message": f"'{name}' has already been loaded"}})
            self.loras[name] = body["lora_path"]
            return httpx.Response(200, text="ok")
        if path == "/inference/v1/generate":
            if not self.scale_out:
                return httpx.Response(403, json={"error": {"message": "Scale-out endpoints are disabled"}})
            if body["model"] not in ("base", *self.loras):
                return httpx.Response(
                    404, json={"error": {"message": f"The model `{body['model']}` does not exist"}}
                )
            self.requests.append(body["model"])
            return httpx.Response(200, json=self._generate(body))
        return httpx.Response(404, json={"detail": "Not Found"})

    def _generate(self, body: dict) -> dict:
        sp = body["sampling_params"]
        t = sp.get("temperature", 1.0)
        dist = _processed(t) if self.processed and t > 0 else dict(RAW)
        n, k = sp.get("n", 1), sp.get("logprobs")
        choices = []
        for i in range(n):
            ids = [10] * sp["max_tokens"]
            content = None
            if k is not None:
                tops = [
                    {"token_id": tok, "logprob": lp} for tok, lp in sorted(dist.items(), key=lambda x: -x[1])
                ][: max(k, 1)]
                content = [{"token_id": 10, "logprob": dist[10], "top_logprobs": tops} for _ in ids]
            choices.append(
                {"index": i, "finish_reason": "length", "token_ids": ids, "logprobs": {"content": content}}
            )
        out = {"choices": choices}
        if sp.get("prompt_logprobs") is not None:
            steps = [None] + [
                {str(tok): {"logprob": lp} for tok, lp in {**RAW, t_: RAW.get(t_, -9.0)}.items()}
                for t_ in body["token_ids"][1:]
            ]
            out["prompt_logprobs"] = steps
        return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _backend(tokenizer, engines: dict[str, FakeEngine]) -> OpenAIBackend:
    cfg = TandemConfig.model_validate(
        {"server": {"backend": "openai", "openai": {"endpoints": list(engines), "probe_s": 0.05}}}
    )
    by_host = {httpx.URL(u).host: e for u, e in engines.items()}
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: by_host[r.url.host].handle(r)))
    return OpenAIBackend(cfg, tokenizer, client)


def test_the_logprob_check_tells_processed_from_raw():
    t = 0.5
    scored = [dict(RAW)] * 3
    assert check_processed_logprobs([_processed(t)] * 3, scored) == pytest.approx(2.0)
    assert check_processed_logprobs([dict(RAW)] * 3, scored) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="far enough"):
        check_processed_logprobs([{10: -0.1}], [{10: -0.1}])


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ({"processed": False}, "--logprobs-mode processed_logprobs"),
        ({"scale_out": False}, "--enable-scale-out"),
        ({"runtime_lora": False}, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
        ({"max_model_len": 256}, "model.max_model_len=1024"),
    ],
)
def test_an_endpoint_missing_what_training_needs_is_refused_at_start_naming_it(tokenizer, setting, says):
    engine = FakeEngine(tokenizer, **setting)
    backend = _backend(tokenizer, {"http://a:8000": engine})
    with pytest.raises(ConfigError, match="http://a:8000") as e:
        asyncio.run(backend.start(0))
    assert says in str(e.value)


def test_an_endpoint_serving_another_model_is_refused(tokenizer, model_dir):
    class Other(FakeEngine):
        def handle(self, request):
            if request.url.path == "/tokenize":
                return httpx.Response(200, json={"tokens": [1, 2, 3]})
            return super().handle(request)

    backend = _backend(tokenizer, {"http://a:8000": Other(tokenizer)})
    with pytest.raises(ConfigError, match="tokenizes text unlike"):
        asyncio.run(backend.start(0))


def test_something_else_at_the_url_is_refused_in_one_line(tokenizer):
    class Html(FakeEngine):
        def handle(self, request):
            return httpx.Response(200, text="<html>a web page</html>")

    backend = _backend(tokenizer, {"http://a:8000": Html(tokenizer)})
    with pytest.raises(ConfigError, match="answers unlike a vLLM server"):
        asyncio.run(backend.start(0))


def test_versions_go_only_where_loaded_and_a_lost_endpoint_is_brought_back(tokenizer):
    a, b = FakeEngine(tokenizer), FakeEngine(tokenizer)
    backend = _backend(tokenizer, {"http://a:8000": a, "http://b:8000": b})
    events = []
    backend.on_event = lambda event, **f: events.append((event, f.get("endpoint"), f.get("version")))

    async def run():
        b.up = False  # down at start: the server starts on a alone
        await backend.start(0)
        assert [e.up for e in backend.endpoints] == [True, False]
        a.requests.clear()  # the start's probes
        v1 = Adapter(1, "/store/v1")
        await backend.load_adapter(v1)
        assert set(a.loras) == {"policy-v1"} and not b.loras
        out = await backend.generate([[1, 2, 3]] * 4, n=2, temperature=1.0, max_tokens=3, adapter=v1)
        assert [len(g) for g in out] == [2] * 4 and a.requests == ["policy-v1"] * 4
        b.up = True  # back: checked, given v1, then it samples too
        for _ in range(100):
            if backend.endpoints[1].up:
                break
            await asyncio.sleep(0.02)
        assert b.loras == {"policy-v1": "/store/v1"}
        b.requests.clear()  # its probes on return
        await backend.generate([[1, 2, 3]] * 4, n=2, temperature=1.0, max_tokens=3, adapter=v1)
        assert b.requests == ["policy-v1"] * 2  # the least busy endpoint: half each
        # b restarted under us (its adapters gone): its request is retried on a, b is reloaded on return
        b.loras.clear()
        await backend.generate([[1, 2, 3]] * 2, n=1, temperature=1.0, max_tokens=3, adapter=v1)
        assert ("endpoint_down", "http://b:8000", None) in events
        v2 = Adapter(2, "/store/v2")
        await backend.load_adapter(v2)
        await backend.unload_adapter(v1)
        assert "policy-v1" not in a.loras
        for _ in range(100):
            if backend.endpoints[1].up:
                break
            await asyncio.sleep(0.02)
        assert set(b.loras) == {"policy-v2"}
        # an older version asked for by an evaluation is loaded where it goes
        await backend.score([1, 2], [10, 10], v1)
        assert sum("policy-v1" in e.loras for e in (a, b)) == 1
        await backend.close()

    asyncio.run(run())
    sampled = [e for e in events if e[0] == "sampled"]
    assert {ep for _, ep, _ in sampled} == {"http://a:8000", "http://b:8000"}


def test_older_versions_loaded_for_evaluations_do_not_pile_up_on_the_engine(tokenizer):
    """Versions no longer served that requests ask for are loaded where they go, and beyond ON_DEMAND_KEPT
    the least recently asked-for is unloaded again; the served version stays."""
    from rollout_server.engines.external import ON_DEMAND_KEPT

    a = FakeEngine(tokenizer)
    backend = _backend(tokenizer, {"http://a:8000": a})

    async def run():
        await backend.start(0)
        await backend.load_adapter(Adapter(9, "/store/v9"))  # the one served
        for v in (1, 2, 3, 2, 4):
            await backend.score([1, 2], [10, 10], Adapter(v, f"/store/v{v}"))
            assert "policy-v9" in a.loras and len(a.loras) <= 1 + ON_DEMAND_KEPT
        assert set(a.loras) == {"policy-v9", "policy-v2", "policy-v4"}  # 1 and 3: least recently asked for
        assert a.requests[-1] == "policy-v4"
        await backend.close()

    asyncio.run(run())


def test_a_request_waiting_for_a_version_that_is_retired_meanwhile_gets_it_on_demand(tokenizer):
    """An evaluation of v1 waits while no endpoint is up; v1 is retired and v2 published meanwhile. The
    endpoint comes back with v2 only: the waiting request is now on demand, loads v1 there and is answered
    (deciding "on demand" once, before the wait, left it waiting for an endpoint with v1 for ever)."""
    a = FakeEngine(tokenizer)
    backend = _backend(tokenizer, {"http://a:8000": a})

    async def run():
        await backend.start(0)
        v1, v2 = Adapter(1, "/store/v1"), Adapter(2, "/store/v2")
        await backend.load_adapter(v1)
        a.up = False
        waiting = asyncio.create_task(backend.score([1, 2], [10, 10], v1))
        for _ in range(100):  # the request found the endpoint gone and waits for one
            if not backend.endpoints[0].up:
                break
            await asyncio.sleep(0.02)
        assert not backend.endpoints[0].up and not waiting.done()
        await backend.unload_adapter(v1)
        await backend.load_adapter(v2)
        a.loras.clear()  # it restarted
        a.up = True
        await asyncio.wait_for(waiting, 5.0)
        assert a.requests[-1] == "policy-v1" and set(a.loras) == {"policy-v1", "policy-v2"}
        await backend.close()

    asyncio.run(run())


def test_a_refused_adapter_is_loaded_nowhere(tokenizer):
    a, b = FakeEngine(tokenizer), FakeEngine(tokenizer)
    b.refuse.add("policy-v1")
    backend = _backend(tokenizer, {"http://a:8000": a, "http://b:8000": b})

    async def run():
        await backend.start(0)
        with pytest.raises(AdapterLoadError, match="bad adapter"):
            await backend.load_adapter(Adapter(1, "/store/v1"))
        assert not a.loras and not b.loras and not backend.adapters
        await backend.close()

    asyncio.run(run())


def test_sampler_and_score_logprobs_are_read_per_token(tokenizer):
    backend = _backend(tokenizer, {"http://a:8000": FakeEngine(tokenizer)})

    async def run():
        await backend.start(0)
        (group,) = await backend.generate([[1, 2]], n=3, temperature=0.5, max_tokens=2, adapter=None)
        assert [s.token_ids for s in group] == [[10, 10]] * 3
        assert group[0].logprobs == pytest.approx([_processed(0.5)[10]] * 2)
        assert await backend.score([1, 2], [10, 11], None) == pytest.approx([RAW[10], RAW[11]])
        await backend.close()

    asyncio.run(run())


def test_each_endpoint_is_probed_once_at_start_and_again_when_it_comes_back(
    tokenizer, model_dir, monkeypatch
):
    """serve() checks the endpoints before the server starts (a bad one is one line, exit 2) and then
    creates the backend: the probe (it samples and scores on the engine) runs once, not twice."""
    engines = {"http://a:8000": FakeEngine(tokenizer), "http://b:8000": FakeEngine(tokenizer)}
    probes = {u: 0 for u in engines}

    def handle(request):
        url = f"http://{request.url.host}:{request.url.port}"
        probes[url] += request.url.path == "/v1/models"
        return engines[url].handle(request)

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handle)))
    cfg = TandemConfig.model_validate(
        {"server": {"backend": "openai", "openai": {"endpoints": list(engines), "probe_s": 0.05}}}
    )
    inspected = asyncio.run(OpenAIBackend.check(cfg, model_dir))
    assert inspected == {"http://a:8000": "base", "http://b:8000": "base"}
    assert probes == {"http://a:8000": 1, "http://b:8000": 1}

    async def start_then_lose_b():
        backend = await OpenAIBackend.create(cfg, model_dir, inspected)
        assert [ep.up for ep in backend.endpoints] == [True, True]
        assert probes == {"http://a:8000": 1, "http://b:8000": 1}  # not probed again
        b = backend.endpoints[1]
        b.up = False  # lost; brought back by the watcher, which probes it again (it may have restarted)
        while not b.up:
            await asyncio.sleep(0.02)
        await backend.close()

    asyncio.run(start_then_lose_b())
    assert probes == {"http://a:8000": 1, "http://b:8000": 2}
