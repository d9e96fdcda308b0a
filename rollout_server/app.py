"""The rollout server's HTTP surface (DESIGN.md §3). Routes declare the models of shared/protocol.py.

Every POST mutates or spends engine time and so requires `Authorization: Bearer <token>` when a token
is configured (environment variable named by `server.api_token_env`); GET /health and /metrics are open.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, File, Form, HTTPException, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse

from rollout_server.adapters import (
    CONFIG,
    WEIGHTS,
    AdapterRejected,
    AdapterStore,
    linear_module_names,
    resolve_under,
    validate_adapter,
)
from rollout_server.backend import RolloutBackend
from rollout_server.metrics import ServerMetrics
from rollout_server.policy import Policy
from rollout_server.producer import EventLog, Producer
from rollout_server.queue import LeaseError, LeaseQueue
from shared import protocol as P
from shared.config import TandemConfig
from shared.datasets import Problem, chat_prompt_ids

log = logging.getLogger("tandem.server")

BackendFactory = Callable[[], Awaitable[RolloutBackend]]


class Server:
    """Everything the routes need, built in the app's lifespan."""

    def __init__(self, cfg: TandemConfig, backend: RolloutBackend, problems: list[Problem], model_path: str):
        self.cfg = cfg
        self.backend = backend
        state_dir = Path(cfg.server.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        self.store = AdapterStore(state_dir / "adapters")
        self.policy = Policy(backend, self.store)
        self.queue = LeaseQueue(cfg.server.queue_size, cfg.server.lease_s)
        self.metrics = ServerMetrics(self)
        self.events = EventLog(state_dir / "events.jsonl")
        self.producer = Producer(
            cfg, backend, self.queue, self.policy, problems, state_dir, self.events, self.metrics
        )
        self.allowed_targets = linear_module_names(model_path)
        self.failure: str | None = None  # set when the producer dies: /health turns 503


def create_app(
    cfg: TandemConfig, problems: list[Problem], model_path: str, backend_factory: BackendFactory
) -> FastAPI:
    token = os.environ.get(cfg.server.api_token_env) or None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("starting %s backend for %s", cfg.server.backend, model_path)
        server = Server(cfg, await backend_factory(), problems, model_path)
        await server.policy.restore()
        app.state.server = server
        task = asyncio.create_task(server.producer.run())

        def on_done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                server.failure = f"producer stopped: {t.exception()!r}"
                log.error("%s", server.failure, exc_info=t.exception())

        task.add_done_callback(on_done)
        log.info(
            "ready: serving policy v%d on %s:%d", server.policy.version, cfg.server.host, cfg.server.port
        )
        yield
        task.cancel()
        await server.producer.stop()
        await server.backend.close()

    app = FastAPI(title="tandem rollout server", version=P.PROTOCOL_VERSION, lifespan=lifespan)

    def srv(request: Request) -> Server:
        return request.app.state.server

    def auth(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer "):
            raise HTTPException(
                401, "missing 'Authorization: Bearer <token>'", headers={"WWW-Authenticate": "Bearer"}
            )
        if not hmac.compare_digest(header[7:].strip().encode(), token.encode()):
            raise HTTPException(403, "wrong bearer token")

    @app.exception_handler(AdapterRejected)
    async def _rejected(request: Request, exc: AdapterRejected):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.exception_handler(LeaseError)
    async def _lease(request: Request, exc: LeaseError):
        return JSONResponse({"detail": exc.args[0]}, status_code=exc.status)

    @app.get("/health", response_model=P.Health)
    async def health(s: Server = Depends(srv)):
        if s.failure:
            raise HTTPException(503, s.failure)
        return P.Health(
            backend=s.backend.name,
            model=cfg.model.name,
            policy_version=s.policy.version,
            sleeping=s.producer.sleeping,
            group_size=cfg.sampling.group_size,
            queue_depth=s.queue.depth,
            leased=s.queue.leased,
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(s: Server = Depends(srv)):
        return PlainTextResponse(s.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/groups/pull", response_model=P.PullResponse, dependencies=[Depends(auth)])
    async def pull(req: P.PullRequest, s: Server = Depends(srv)):
        # Asleep with nothing queued, no group can come before a wake: answer now rather than hold the
        # connection for wait_s.
        wait_s = 0.0 if s.producer.sleeping and s.queue.depth == 0 else req.wait_s
        lease_id, groups = await s.queue.pull(req.max_groups, wait_s)
        if lease_id:
            s.events.write("lease", lease_id=lease_id, group_ids=[g.group_id for g in groups])
        return P.PullResponse(lease_id=lease_id, lease_s=s.queue.lease_s if lease_id else 0.0, groups=groups)

    @app.post("/v1/groups/ack", response_model=P.AckResponse, dependencies=[Depends(auth)])
    async def ack(req: P.AckRequest, s: Server = Depends(srv)):
        acked = await s.queue.ack(req.lease_id)
        s.events.write("ack", lease_id=req.lease_id, acked=acked)
        return P.AckResponse(acked=acked)

    @app.post("/v1/groups/release", response_model=P.ReleaseResponse, dependencies=[Depends(auth)])
    async def release(req: P.ReleaseRequest, s: Server = Depends(srv)):
        released = await s.queue.release(req.lease_id)
        s.events.write("release", lease_id=req.lease_id, released=released)
        return P.ReleaseResponse(released=released)

    async def _read(upload: UploadFile, limit: int) -> bytes:
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise AdapterRejected(f"{upload.filename or 'upload'} exceeds server.max_adapter_mb", status=413)
        return data

    async def _publish(
        s: Server, version: int, config_bytes: bytes, weights_bytes: bytes
    ) -> P.AdapterPublished:
        validate_adapter(
            config_bytes, weights_bytes, max_rank=cfg.server.max_lora_rank, allowed_targets=s.allowed_targets
        )
        adapter = await s.policy.publish(version, lambda v: s.store.write(v, config_bytes, weights_bytes))
        s.events.write("publish", version=version)
        return P.AdapterPublished(version=adapter.version, name=adapter.name)

    @app.post("/v1/adapters", response_model=P.AdapterPublished, dependencies=[Depends(auth)])
    async def publish_upload(
        version: int = Form(ge=1),
        adapter_config: UploadFile = File(description=CONFIG),
        adapter_model: UploadFile = File(description=WEIGHTS),
        s: Server = Depends(srv),
    ):
        limit = int(cfg.server.max_adapter_mb * 2**20)
        return await _publish(
            s, version, await _read(adapter_config, 2**20), await _read(adapter_model, limit)
        )

    @app.post("/v1/adapters/path", response_model=P.AdapterPublished, dependencies=[Depends(auth)])
    async def publish_path(req: P.AdapterPathRequest, s: Server = Depends(srv)):
        folder = resolve_under(cfg.server.adapter_root, req.path)
        files = {}
        for name in (CONFIG, WEIGHTS):
            f = folder / name
            if not f.is_file() or f.is_symlink():
                raise AdapterRejected(f"{req.path}/{name} is missing (or a symlink)", status=422)
            if f.stat().st_size > cfg.server.max_adapter_mb * 2**20:
                raise AdapterRejected(f"{req.path}/{name} exceeds server.max_adapter_mb", status=413)
            files[name] = f.read_bytes()
        return await _publish(s, req.version, files[CONFIG], files[WEIGHTS])

    @app.post("/v1/sleep", response_model=P.SleepState, dependencies=[Depends(auth)])
    async def sleep(s: Server = Depends(srv)):
        if not s.producer.sleeping:
            await s.producer.sleep()
        return P.SleepState(sleeping=True)

    @app.post("/v1/wake", response_model=P.SleepState, dependencies=[Depends(auth)])
    async def wake(s: Server = Depends(srv)):
        if s.producer.sleeping:
            await s.producer.wake()
        return P.SleepState(sleeping=False)

    def _check_awake(s: Server) -> None:
        if s.producer.sleeping:
            raise HTTPException(409, "the server is asleep; POST /v1/wake first")

    @app.post("/v1/generate", response_model=P.GenerateResponse, dependencies=[Depends(auth)])
    async def generate(req: P.GenerateRequest, s: Server = Depends(srv)):
        _check_awake(s)
        if len(req.prompts) * req.n > cfg.server.max_generate_sequences:
            raise HTTPException(
                422,
                f"{len(req.prompts)} prompts x n={req.n} exceed server.max_generate_sequences="
                f"{cfg.server.max_generate_sequences}; split the request",
            )
        adapter = s.policy.lookup(req.version)
        prompts = [chat_prompt_ids(s.backend.tokenizer, q) for q in req.prompts]
        room = cfg.model.max_model_len - max(len(p) for p in prompts)
        if room < 1:
            raise HTTPException(
                422, f"a prompt leaves no room within model.max_model_len={cfg.model.max_model_len}"
            )
        max_tokens = min(req.max_tokens or cfg.sampling.max_new_tokens, room)
        samples = await s.backend.generate(
            prompts, n=req.n, temperature=req.temperature, max_tokens=max_tokens, adapter=adapter
        )
        outputs = [
            [P.GeneratedText(text=x.text, token_ids=x.token_ids, finish_reason=x.finish_reason) for x in row]
            for row in samples
        ]
        return P.GenerateResponse(
            version=adapter.version if adapter else 0, prompt_token_ids=prompts, outputs=outputs
        )

    @app.post("/v1/score", response_model=P.ScoreResponse, dependencies=[Depends(auth)])
    async def score(req: P.ScoreRequest, s: Server = Depends(srv)):
        _check_awake(s)
        ids = req.prompt_token_ids + req.completion_token_ids
        if len(ids) > cfg.model.max_model_len:
            raise HTTPException(
                422, f"{len(ids)} tokens exceed model.max_model_len={cfg.model.max_model_len}"
            )
        if max(ids) >= len(s.backend.tokenizer):
            raise HTTPException(
                422, f"token id {max(ids)} is outside the vocabulary ({len(s.backend.tokenizer)})"
            )
        adapter = s.policy.lookup(req.version)
        async with s.producer.exclusive:
            logprobs = await s.backend.score(req.prompt_token_ids, req.completion_token_ids, adapter)
        return P.ScoreResponse(version=adapter.version if adapter else 0, logprobs=logprobs)

    return app


def serve(cfg: TandemConfig) -> int:
    import uvicorn

    from rollout_server.backend import make_backend
    from shared.datasets import DatasetError, load_problems
    from shared.models import ModelError, resolve_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        model_path = resolve_model(cfg.model.name)
        problems = load_problems(cfg.data)
    except (ModelError, DatasetError) as e:
        print(f"error: {e}", flush=True)
        return 2
    log.info("%d %s problems (%s split)", len(problems), cfg.data.task, cfg.data.split)
    app = create_app(cfg, problems, model_path, lambda: make_backend(cfg, model_path))
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal under the handler that
    # was installed before it started; with the default one the process would die by the signal (exit
    # 143) after a clean shutdown. A handler that does nothing lets serve() return 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    uvicorn.run(
        app, host=cfg.server.host, port=cfg.server.port, log_level="info", timeout_graceful_shutdown=10
    )
    return 0
