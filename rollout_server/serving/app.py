"""The rollout server's HTTP surface (docs/design.md §3). Routes declare the models of shared/protocol.py.

Every POST mutates or spends engine time and so requires `Authorization: Bearer <token>` when a token
is configured (environment variable named by `server.api_token_env`); GET /health and /metrics are open.
The token and the body's size are checked before the body is read (rollout_server/serving/guard.py).

If the producer dies (an engine failure), /health answers 503 and the server shuts down and exits 1, so
a supervisor (Compose, SLURM, systemd) restarts it; it restores its newest valid adapter on the way up.
SIGTERM cancels evaluation requests in flight (503) and stops within server.shutdown_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, File, Form, HTTPException, Request, UploadFile
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse

from rollout_server.engines.base import GenerationAborted, RolloutBackend
from rollout_server.environments.verifiers_runner import VerifiersRunner
from rollout_server.production.adapters import (
    AdapterRejected,
    AdapterStore,
    linear_modules,
    resolve_under,
    target_names,
    validate_adapter,
    validate_folder,
)
from rollout_server.production.events import EventLog
from rollout_server.production.policy import Policy
from rollout_server.production.producer import Producer, load_queue
from rollout_server.production.queue import Journal, LeaseError, LeaseQueue
from rollout_server.serving import generate_api, openai_api, openai_schema, token_api
from rollout_server.serving.deps import server_of
from rollout_server.serving.guard import RequestGuard
from rollout_server.serving.metrics import ServerMetrics
from rollout_server.serving.openai_schema import OpenAIError
from rollout_server.serving.traffic import OpenAIState
from shared import protocol as P
from shared.config import TandemConfig
from shared.datasets import DatasetError, Problem, render
from shared.rewards import RewardRunner

log = logging.getLogger("tandem.server")

BackendFactory = Callable[[], Awaitable[RolloutBackend]]
MAX_CONFIG_BYTES = 2**16  # adapter_config.json: peft writes about 1 KB


class Server:
    """The server's parts, built in the app's lifespan; the routes reach them through `deps.server_of`."""

    def __init__(self, cfg: TandemConfig, backend: RolloutBackend, problems: list[Problem], model_path: str):
        self.cfg = cfg
        self.backend = backend
        state_dir = Path(cfg.server.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        self.store = AdapterStore(state_dir / "adapters")
        shapes = linear_modules(model_path)
        self.adapter_checks = {
            "max_rank": cfg.server.max_lora_rank,
            "allowed_targets": target_names(shapes),
            "shapes": shapes,
        }
        self.policy = Policy(
            backend,
            self.store,
            lambda f: validate_folder(f, **self.adapter_checks),
            keep=cfg.server.keep_versions,
            keep_every=cfg.learner.keep_every,
        )
        self.queue = LeaseQueue(cfg.server.queue_size, cfg.server.lease_s)
        self.journal = Journal(state_dir / "queue.jsonl", cfg.model.name)
        ready, leases, expired = self.journal.replay()
        older = state_dir / "queue.json"  # what a server of an earlier release saved as it stopped
        ready_then, leases_then = load_queue(older, cfg.model.name)
        self.queue.restore([*ready_then, *ready], {**leases_then, **leases}, expired, self.journal.requests)
        self.journal.compact(self.queue)
        self.queue.journal = self.journal
        older.unlink(missing_ok=True)
        if self.queue.depth or self.queue.leased:
            log.info(
                "took back the last run's queue: %d groups waiting, %d leased (%s)",
                self.queue.depth, self.queue.leased, self.journal.path,
            )  # fmt: skip
        self.metrics = ServerMetrics(self.queue, self.policy)
        self.events = EventLog(state_dir / "events.jsonl")
        if hasattr(backend, "on_event"):  # an external engine's endpoints going down, up, loading versions
            backend.on_event = self.events.write
        judge = cfg.reward.judge
        switching = judge.url == "self" and judge.model != "latest" and cfg.server.adapter_mode == "merge"
        if "judge" in cfg.reward.functions and switching:
            log.warning(
                "reward.judge.model = %r on this server: each judged batch switches the merged weights to "
                "it (production waits); 'latest' judges with the version served at no such cost",
                judge.model,
            )
        host = cfg.server.host if cfg.server.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host  # (an IPv6 address)
        self.rewards = RewardRunner(
            cfg.reward,
            on_failure=lambda name, kind: self.metrics.reward_failures.labels(name, kind).inc(),
            env=[spec for _, spec in cfg.env.fields],  # the environment's code runs there too
            self_url=f"http://{host}:{cfg.server.port}",  # a judge of url = 'self' (its OpenAI API)
            self_token=os.environ.get(cfg.server.api_token_env, ""),
        )
        self.records = token_api.Records()  # what /inference/v1/generate answered, for checking it
        self.producer = Producer(
            cfg,
            backend,
            self.queue,
            self.policy,
            problems,
            state_dir,
            self.events,
            self.metrics,
            self.rewards,
            VerifiersRunner(cfg, self.records, model_path) if cfg.env.kind == "verifiers" else None,
        )
        self.failure: str | None = None  # set when the producer dies: /health turns 503
        self.evaluations: set[asyncio.Task] = set()  # /v1/generate work in flight
        self.openai = OpenAIState(cfg.server.openai_max_sequences)  # the OpenAI endpoints' slots
        self.shutting_down = False
        self.producer_task: asyncio.Task | None = None  # producer.run(), once the app has started

    def prompt_ids(self, prompt: str) -> list[int]:
        """A prompt as the token ids the model sees: rendered as a training prompt without its row (the
        system prompt, data.prompt_template, the chat template). 422 if the template needs a column."""
        try:
            return self.producer.conversation_ids(render(self.cfg.data, prompt))
        except DatasetError as e:
            raise HTTPException(422, f"{e}: send whole conversations in 'messages' instead") from None

    @property
    def paused(self) -> bool:
        return self.producer.paused

    @property
    def vocab_size(self) -> int:
        return len(self.backend.tokenizer)

    def begin_shutdown(self) -> None:
        """SIGTERM: evaluation requests end now (503) rather than hold the shutdown for minutes; a waiting
        pull answers "no groups"; no new generation batch starts."""
        self.shutting_down = True
        for task in self.evaluations:
            task.cancel()
        self.queue.close()
        self.producer.halt()


def body_limit(cfg: TandemConfig) -> Callable[[str], int]:
    """Bytes a POST body may carry: an adapter upload its weights (server.max_adapter_mb), its config
    (MAX_CONFIG_BYTES) and the form around them; any other request server.max_request_mb."""
    upload = int(cfg.server.max_adapter_mb * 2**20) + MAX_CONFIG_BYTES + 2**16
    other = int(cfg.server.max_request_mb * 2**20)
    return lambda path: upload if path == "/v1/adapters" else other


def create_app(
    cfg: TandemConfig,
    problems: list[Problem],
    model_path: str,
    backend_factory: BackendFactory,
    on_fatal: Callable[[], None] = lambda: None,
    skipped_prompts: int = 0,
) -> FastAPI:
    """`on_fatal` is called once the producer has died: serve() makes the process exit 1 then.
    `skipped_prompts`: problems left out at start for a prompt too long (counted in /metrics)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("starting %s backend for %s", cfg.server.backend, model_path)
        app.state.engine_starting = True  # a stop signal now ends the process at once (serve.py)
        backend = await backend_factory()
        app.state.engine_starting = False
        server = Server(cfg, backend, problems, model_path)
        server.metrics.prompts_too_long.inc(skipped_prompts)
        await server.policy.restore()
        app.state.loop = asyncio.get_running_loop()
        app.state.server = server
        task = server.producer_task = asyncio.create_task(server.producer.run())
        task.add_done_callback(lambda t: _producer_done(server, t, on_fatal))
        log.info(
            "ready: serving policy v%d on %s:%d", server.policy.version, cfg.server.host, cfg.server.port
        )
        yield
        task.cancel()
        await server.producer.stop()
        server.journal.compact(server.queue)
        server.journal.close()
        if kept := server.queue.depth + server.queue.leased:
            log.info("the queue's %d groups wait in %s for the next start", kept, server.journal.path)
        await server.rewards.close()
        await server.backend.close()

    app = FastAPI(title="tandem rollout server", version=P.PROTOCOL_VERSION, lifespan=lifespan)
    token = os.environ.get(cfg.server.api_token_env) or None
    app.add_middleware(RequestGuard, token=token, limit_for=body_limit(cfg))
    app.add_exception_handler(AdapterRejected, _openai_or(_rejected))
    app.add_exception_handler(GenerationAborted, _openai_or(_aborted))
    app.add_exception_handler(LeaseError, _lease_error)
    app.add_exception_handler(HTTPException, _openai_or(http_exception_handler))
    app.add_exception_handler(RequestValidationError, _openai_or(_invalid_request))
    app.add_exception_handler(OpenAIError, lambda request, exc: openai_schema.error_response(exc))
    app.include_router(router)
    app.include_router(generate_api.router)
    app.include_router(openai_api.router)
    app.include_router(token_api.router)
    return app


def _openai_or(handler):
    """`handler` for tandem's routes; OpenAI's error schema on the OpenAI-compatible ones (a validation
    error there is a 400 naming the field, as OpenAI answers)."""

    async def handle(request: Request, exc: Exception):
        if not openai_schema.is_openai_path(request.url.path):
            return await handler(request, exc)
        if isinstance(exc, RequestValidationError):
            return openai_schema.error_response(openai_schema.validation_error(list(exc.errors())))
        response = await handler(request, exc)
        detail = json.loads(response.body).get("detail")
        message = detail if isinstance(detail, str) else json.dumps(detail)
        err = OpenAIError(response.status_code, message)
        err.headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
        return openai_schema.error_response(err)

    return handle


def _producer_done(server: Server, task: asyncio.Task, on_fatal: Callable[[], None]) -> None:
    if task.cancelled() or task.exception() is None:
        return
    if server.shutting_down:
        # the stop signal reached the engine's own processes too (a process group, a SLURM job step)
        log.info("the engine stopped with the server (%s)", type(task.exception()).__name__)
    else:
        server.failure = f"producer stopped: {task.exception()!r}"
        log.error("%s; exiting 1 to be restarted", server.failure, exc_info=task.exception())
        on_fatal()


async def _invalid_request(request: Request, exc: RequestValidationError):
    """422 with the list of what is wrong, as FastAPI answers. Its `input` echoes the request, and Python's
    JSON reader takes NaN and Infinity, which JSON cannot write back (FastAPI's own handler answered 500):
    non-finite numbers are echoed as strings."""
    return JSONResponse({"detail": _json_safe(jsonable_encoder(exc.errors()))}, status_code=422)


def _json_safe(value):
    """`value` with every non-finite float turned into its name ('nan', 'inf', '-inf')."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


async def _rejected(request: Request, exc: AdapterRejected):
    return JSONResponse({"detail": str(exc)}, status_code=exc.status)


async def _aborted(request: Request, exc: GenerationAborted):
    detail = f"{exc}: the server went to sleep during this request; retry after POST /v1/wake"
    return JSONResponse({"detail": detail}, status_code=409)


async def _lease_error(request: Request, exc: LeaseError):
    return JSONResponse({"detail": exc.args[0]}, status_code=exc.status)


# -- routes ------------------------------------------------------------------------------------------
router = APIRouter()


@router.get("/health", response_model=P.Health)
async def health(s: Server = Depends(server_of)):
    if s.failure:
        raise HTTPException(503, s.failure)
    return P.Health(
        backend=s.backend.name,
        model=s.cfg.model.name,
        policy_version=s.policy.version,
        sleeping=s.producer.sleeping,
        paused=s.paused,
        group_size=s.cfg.sampling.group_size,
        queue_depth=s.queue.depth,
        leased=s.queue.leased,
        engines=s.backend.describe() if hasattr(s.backend, "describe") else None,
    )


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(s: Server = Depends(server_of)):
    return PlainTextResponse(s.metrics.render(), media_type="text/plain; version=0.0.4")


@router.post("/v1/groups/pull", response_model=P.PullResponse)
async def pull(req: P.PullRequest, request: Request, s: Server = Depends(server_of)):
    # Asleep with nothing queued, no group can come before a wake: answer now rather than hold the
    # connection for wait_s.
    wait_s = 0.0 if s.producer.sleeping and s.queue.depth == 0 else req.wait_s
    again = s.queue.answered(req.request_id) if req.request_id else None
    if again is not None:
        lease_id, groups = again
        return P.PullResponse(lease_id=lease_id, lease_s=s.queue.lease_s if lease_id else 0.0, groups=groups)
    lease_id, groups = await _pull_while_connected(s, req, wait_s, request)
    if lease_id:
        s.events.write("lease", lease_id=lease_id, group_ids=[g.group_id for g in groups])
    return P.PullResponse(
        lease_id=lease_id, lease_s=s.queue.lease_s if lease_id else 0.0, groups=groups, paused=s.paused
    )


async def _pull_while_connected(
    s: Server, req: P.PullRequest, wait_s: float, request: Request
) -> tuple[str | None, list[P.ScoredGroup]]:
    """queue.pull, given up when the puller's connection closes while it waits: a learner killed mid-pull
    would otherwise be leased groups nobody acks, holding queue slots until server.lease_s ran out."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    pulling = asyncio.ensure_future(s.queue.pull(req.max_groups, wait_s, req.request_id))
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({pulling, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (pulling, gone):
            task.cancel()  # nothing once done; a pull is cancelled only while it waits, before leasing
        await asyncio.gather(pulling, gone, return_exceptions=True)
    lease_id, groups = (None, []) if pulling.cancelled() else pulling.result()
    if gone.done() and not gone.cancelled():
        if lease_id:  # leased as the connection closed: the groups go back at once
            await s.queue.release(lease_id)
            s.events.write("release", lease_id=lease_id, released=len(groups), why="puller gone")
        log.info("a pull's connection closed while it waited; nothing leased to it")
        return None, []
    return lease_id, groups


@router.post("/v1/groups/ack", response_model=P.AckResponse)
async def ack(req: P.AckRequest, s: Server = Depends(server_of)):
    acked = await s.queue.ack(req.lease_id)
    s.events.write("ack", lease_id=req.lease_id, acked=acked)
    return P.AckResponse(acked=acked)


@router.post("/v1/groups/release", response_model=P.ReleaseResponse)
async def release(req: P.ReleaseRequest, s: Server = Depends(server_of)):
    lease_id = req.lease_id if req.request_id is None else s.queue.lease_of(req.request_id)
    if lease_id is None:  # that pull got no lease (yet: if it still waits, it gets none), or it was settled
        s.queue.withdraw(req.request_id)
        return P.ReleaseResponse(released=0)
    released = await s.queue.release(lease_id)
    s.events.write("release", lease_id=lease_id, released=released)
    return P.ReleaseResponse(released=released)


@router.post("/v1/adapters", response_model=P.AdapterPublished)
async def publish_upload(
    request: Request,
    version: int = Form(ge=1, le=P.MAX_VERSION, alias=P.UPLOAD_VERSION_FIELD),
    config_file: UploadFile = File(alias=P.UPLOAD_CONFIG_FIELD, description=P.ADAPTER_CONFIG_FILE),
    weights_file: UploadFile = File(alias=P.UPLOAD_WEIGHTS_FIELD, description=P.ADAPTER_WEIGHTS_FILE),
    s: Server = Depends(server_of),
):
    config_bytes = await _read(config_file, MAX_CONFIG_BYTES)
    weights_bytes = await _read(weights_file, int(s.cfg.server.max_adapter_mb * 2**20))
    return await _publish(s, version, config_bytes, weights_bytes, getattr(request.state, "arrived", None))


@router.post("/v1/adapters/path", response_model=P.AdapterPublished)
async def publish_path(req: P.AdapterPathRequest, s: Server = Depends(server_of)):
    folder = resolve_under(s.cfg.server.adapter_root, req.path)
    files = {}
    for name in (P.ADAPTER_CONFIG_FILE, P.ADAPTER_WEIGHTS_FILE):
        f = folder / name
        if not f.is_file() or f.is_symlink():
            raise AdapterRejected(f"{req.path}/{name} is missing (or a symlink)", status=422)
        if f.stat().st_size > s.cfg.server.max_adapter_mb * 2**20:
            raise AdapterRejected(f"{req.path}/{name} exceeds server.max_adapter_mb", status=413)
        files[name] = f.read_bytes()
    return await _publish(s, req.version, files[P.ADAPTER_CONFIG_FILE], files[P.ADAPTER_WEIGHTS_FILE])


async def _read(upload: UploadFile, limit: int) -> bytes:
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise AdapterRejected(f"{upload.filename or 'upload'} exceeds {limit} bytes", status=413)
    return data


async def _publish(
    s: Server, version: int, config_bytes: bytes, weights_bytes: bytes, arrived: float | None = None
) -> P.AdapterPublished:
    t = {"start": time.perf_counter()}
    validate_adapter(config_bytes, weights_bytes, **s.adapter_checks)
    t["validated"] = time.perf_counter()

    def store(v: int):
        path = s.store.write(v, config_bytes, weights_bytes)
        t["stored"] = time.perf_counter()
        return path

    async with _engine(s):
        adapter = await s.policy.publish(version, store)
    t["loaded"] = time.perf_counter()
    phases = {
        "receive": t["start"] - arrived if arrived is not None else 0.0,
        "validate": t["validated"] - t["start"],
        "store": t["stored"] - t["validated"],
        "load": t["loaded"] - t["stored"],
        "total": t["loaded"] - (arrived if arrived is not None else t["start"]),
    }
    for phase, seconds in phases.items():
        s.metrics.publish_s.labels(phase).inc(seconds)
    log.info("published %s: %s", adapter.name, ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in phases.items()))
    s.events.write("publish", version=version, **{f"{k}_s": round(v, 4) for k, v in phases.items()})
    return P.AdapterPublished(version=adapter.version, name=adapter.name)


@contextlib.asynccontextmanager
async def _engine(s: Server):
    """An engine call from a route: once SIGTERM has come, the engine refuses work ("Server shutting
    down"), and that is a 503 to retry against the restarted server, not a 500 with a traceback (the soak
    stopped a learner so: it took the 500 for an answer)."""
    try:
        yield
    except Exception:
        if not s.shutting_down:
            raise
        raise HTTPException(503, "the server is shutting down; retry when it is back") from None


@router.post("/v1/sleep", response_model=P.SleepState)
async def sleep(s: Server = Depends(server_of)):
    if not s.producer.sleeping:
        async with _engine(s):
            await s.producer.sleep()
    return P.SleepState(sleeping=True)


@router.post("/v1/wake", response_model=P.SleepState)
async def wake(s: Server = Depends(server_of)):
    if s.producer.sleeping:
        async with _engine(s):
            await s.producer.wake()
    return P.SleepState(sleeping=False)


@router.post("/v1/production/pause", response_model=P.ProductionState)
async def pause_production(s: Server = Depends(server_of)):
    """No new generation batch starts until /resume; answered once the batch in flight, if any, has
    finished and been queued (then no group appears until the resume). Pulls get what is queued. For
    evaluation or re-scoring after training, without generating groups nobody takes."""
    await s.producer.pause()
    return P.ProductionState(paused=True)


@router.post("/v1/production/resume", response_model=P.ProductionState)
async def resume_production(s: Server = Depends(server_of)):
    s.producer.resume()
    return P.ProductionState(paused=False)
