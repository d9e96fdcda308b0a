"""The server process: check what must hold before the engine starts (the data, the rewards, the state on
disk, the vLLM version), start the engine and the app, and run until SIGTERM/SIGINT (exit 0), a failure
of the producer (exit 1) or a bad start (one line, exit 2)."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from rollout_server.engines.base import RolloutBackend
from rollout_server.production.producer import StateError, load_cursor, load_queue
from rollout_server.production.queue import Journal
from rollout_server.serving.app import create_app
from shared.config import TandemConfig
from shared.datasets import DatasetError, Problem

log = logging.getLogger("tandem.server")


async def make_backend(
    cfg: TandemConfig, model_path: str, inspected: dict[str, str] | None = None, *, fork_engine: bool = False
) -> RolloutBackend:
    """Choose the engine by `server.backend`. Each implementation module is the only one importing its
    engine, so the other's dependencies need not be installed. `inspected`: the external endpoints
    _prepare checked (server.backend = "openai"). `fork_engine`: this process has run no torch computation
    (the server's own process), so vLLM's engine process may be forked from it (engines/vllm.py,
    start_engine)."""
    if cfg.server.backend == "vllm":
        from rollout_server.engines.vllm import VllmBackend

        return await VllmBackend.create(cfg, model_path, fork_engine=fork_engine)
    if cfg.server.backend == "openai":
        from rollout_server.engines.external import OpenAIBackend

        return await OpenAIBackend.create(cfg, model_path, inspected)
    from rollout_server.engines.hf import HFBackend

    return await HFBackend.create(cfg, model_path)


def _prepare(cfg: TandemConfig) -> tuple[str, list[Problem], int, dict[str, str]]:
    """What must hold before the engine starts (minutes on a GPU): the vLLM version, the model, the
    data, the reward functions, a readable cursor and saved queue. Raises the errors serve() turns into
    `error: ...` and exit 2. Returns the model's path, the problems, how many were too long, and the
    external endpoints found fit for training ({url: base model name}; server.backend = "openai")."""
    from transformers import AutoTokenizer

    from rollout_server.engines.vllm import check_vllm_settings, check_vllm_version  # import no vllm
    from shared.datasets import drop_long_prompts, load_problems
    from shared.models import resolve_model
    from shared.rewards import resolve

    if cfg.server.backend == "vllm":
        log.info("vLLM %s", check_vllm_version())
        check_vllm_settings(cfg)
    resolve(cfg.reward)
    model_path = resolve_model(cfg.model.name)
    inspected: dict[str, str] = {}
    if cfg.server.backend == "openai":  # what training needs from each endpoint (ConfigError: one line)
        import asyncio

        from rollout_server.engines.external import OpenAIBackend

        inspected = asyncio.run(OpenAIBackend.check(cfg, model_path))
    if cfg.env.kind == "verifiers":  # the environment's tasks are the problems (ConfigError: one line)
        from shared import verifiers_tasks

        problems, source = (
            verifiers_tasks.problems(cfg.env),
            f"verifiers taskset {cfg.env.verifiers['taskset']['id']}",
        )
    else:
        problems, source = load_problems(cfg.data), cfg.data.task
    shard = cfg.server.shard_index, cfg.server.num_shards
    if shard[1] > 1:  # each server its own prompts: two never produce the same one in an epoch
        problems = problems[shard[0] :: shard[1]]
        if not problems:
            raise DatasetError(
                f"server.shard_index={shard[0]} of server.num_shards={shard[1]} has no problems"
            )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if cfg.env.turns:  # its functions import, its tools have schemas, the template appends
        from rollout_server.production.episodes import build

        build(cfg.env, tokenizer)
    problems, dropped = drop_long_prompts(problems, tokenizer, cfg.model.max_model_len)
    if dropped:
        log.warning(
            "skipped %d of %d %s problems whose prompt alone leaves no room within model.max_model_len=%d "
            "(ids: %s%s)",
            len(dropped), len(problems) + len(dropped), source, cfg.model.max_model_len,
            ", ".join(dropped[:5]), ", ..." if len(dropped) > 5 else "",
        )  # fmt: skip
    if not problems:
        raise DatasetError(f"no {source} problem fits within model.max_model_len={cfg.model.max_model_len}")
    load_cursor(Path(cfg.server.state_dir) / "cursor.json", len(problems))
    load_queue(Path(cfg.server.state_dir) / "queue.json", cfg.model.name)
    Journal(Path(cfg.server.state_dir) / "queue.jsonl", cfg.model.name).replay()
    rewards = "the environment's" if cfg.env.kind == "verifiers" else ", ".join(cfg.reward.functions)
    log.info("%d %s problems (%s split%s); rewards: %s", len(problems), source, cfg.data.split,
             f", shard {shard[0]} of {shard[1]}" if shard[1] > 1 else "", rewards)  # fmt: skip
    return model_path, problems, len(dropped), inspected


def _exit_during_engine_start(sig: int) -> None:
    """A stop signal while the engine starts: the start blocks the event loop (vLLM's handshake with its
    engine process, a model load) for up to minutes, so uvicorn's graceful stop would wait for all of it.
    Nothing has been produced or leased yet (the queue and the cursor are untouched until the engine is
    up), so the engine's processes are stopped and this one exits 0 at once."""
    import multiprocessing
    import os

    log.info("%s while the engine was starting: nothing produced yet; exiting", signal.Signals(sig).name)
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()
    logging.shutdown()
    os._exit(0)


def serve(cfg: TandemConfig) -> int:
    """Run the server until SIGTERM/SIGINT (exit 0) or until its producer dies (exit 1)."""
    import uvicorn

    from rollout_server.engines.vllm import VllmVersionError
    from shared.config import ConfigError
    from shared.models import ModelError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        model_path, problems, skipped, inspected = _prepare(cfg)
    except (ModelError, DatasetError, StateError, VllmVersionError, ConfigError) as e:
        print(f"error: {e}", flush=True)
        return 2

    class Uvicorn(uvicorn.Server):
        fatal = False

        def handle_exit(self, sig, frame):  # SIGTERM: evaluation requests end now, not at their end
            super().handle_exit(sig, frame)
            if getattr(app.state, "engine_starting", False):
                _exit_during_engine_start(sig)
            if hasattr(app.state, "server"):  # runs on the loop's (main) thread, between callbacks
                app.state.loop.call_soon_threadsafe(app.state.server.begin_shutdown)

        def on_fatal(self) -> None:
            self.fatal, self.should_exit = True, True

    app = create_app(
        cfg,
        problems,
        model_path,
        lambda: make_backend(cfg, model_path, inspected, fork_engine=True),
        lambda: server.on_fatal(),
        skipped,
    )
    s = cfg.server
    server = Uvicorn(
        uvicorn.Config(
            app, host=s.host, port=s.port, log_level="info", timeout_graceful_shutdown=s.shutdown_s
        )
    )
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal under the handler that
    # was installed before it started; with the default one the process would die by the signal (exit
    # 143) after a clean shutdown. A handler that does nothing lets serve() return 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    server.run()
    return 1 if server.fatal else 0
