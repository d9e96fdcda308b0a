"""The GRPO loop. Each step: pull scored groups (leased) -> drop stale ones -> dynamic sampling -> [sleep
the server] -> per micro-batch: log-probs, reference log-probs, grpo_loss, backward -> optimizer step
-> checkpoint -> ack -> publish adapter v+1 [-> wake the server] -> metrics.

Rank 0 talks to the server and broadcasts the groups; every rank trains on its shard. The conversation with
the servers (leases) is in learner/servers.py, the step's math on a batch in learner/step.py, the process's
signals, threads and memory settings in learner/process.py, what a step leaves on disk in checkpoint.py.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from learner import checkpoint as ckpt
from learner.batch import is_degenerate
from learner.client import Interrupted, ServedPolicyError, ServerError
from learner.engine import (
    broadcast_object,
    build_beside_server,
    build_engine,
    gather_objects,
    init_distributed,
    move_frozen,
    optimizer_state_numel,
)
from learner.metrics import MetricsSink, SignalWatch
from learner.process import Stop, crash_point, keep_freed_memory, pin_threads
from learner.pulled import Pulled, batch_metrics
from learner.servers import Servers, ack, collect_or_stop, connect, release, sync_server
from learner.step import train_step
from learner.trackers import Trackers
from shared.config import TandemConfig, check_batch_size

# The served-policy check's default bound per training dtype: 10x or more the mean |log π - log π_sampler|
# on the tokens of the version both sides hold: float32, 3e-6 to 1e-5 measured against vLLM merged, vLLM
# LoRA and HF (single-turn; the episode tests' re-scoring allows up to 2e-3, so 1e-2); bf16, ~0.025
# (docs/benchmarks.md §12). A server that kept old weights gave 27 nats here (tests/test_faults.py).
SERVED_GAP = {torch.float32: 1e-2, torch.bfloat16: 0.25, torch.float16: 0.25}
MIN_SERVED_TOKENS = 32


def served_policy_error(metrics: dict, bound: float, version: int, servers: list[str]) -> str | None:
    """The one line that stops the learner when the tokens stamped with `version` (the weights this step
    started from) disagree with the learner's own log-probs by more than `bound` (None: they agree, or too
    few were sampled by it to tell)."""
    gap, tokens = metrics.get("served/logp_gap"), metrics.get("served/tokens", 0.0)
    if not bound or gap is None or tokens < MIN_SERVED_TOKENS or gap <= bound:
        return None
    return (
        f"the rollout server ({', '.join(servers)}) does not serve the weights published as v{version}: its "
        f"samples stamped v{version} differ from the learner's v{version} by {gap:.4g} nats a token on "
        f"{tokens:.0f} tokens (learner.served_policy_max_gap = {bound:g}). The step is not recorded and "
        "its groups go back; check that the server loads each published adapter (its log, /health)"
    )


@dataclass
class _Run:
    """What the loop needs besides the state it advances."""

    cfg: TandemConfig
    engine: object
    client: Servers | None
    offload: bool  # frozen weights to host RAM while the server generates (time-sliced, one GPU)
    device: object
    out: Path
    sink: MetricsSink
    stop: Stop
    rank: int
    world: int
    pad_id: int
    decode: object  # token ids -> text (the trackers' samples table)
    log: object
    published: bool = True  # False: stopped before the last step's publish (server unreachable)
    held: deque[Pulled] = field(default_factory=deque)  # learner.lag_steps: pulled, waiting their turn
    watch: SignalWatch | None = None  # rank 0: says when steps carry no learning signal
    served_gap: float = 0.0  # the served-policy check's bound (0: off)

    def held_leases(self) -> list[str]:
        return [lease for p in self.held for lease in p.lease_ids]


def _pull(run: _Run, state: ckpt.State) -> Pulled | None:
    """The step's groups: replayed from a file, or pulled from the server on rank 0 and broadcast. None:
    stopped while waiting for the server (this step has not begun)."""
    if run.cfg.learner.replay_file:
        groups = ckpt.replay_groups(run.cfg.learner.replay_file, state.step + 1)
        return Pulled(groups, [], seen=len(groups), degenerate=sum(map(is_degenerate, groups)))
    pulled = broadcast_object(
        collect_or_stop(run.client, run.cfg, state, run.out, run.log, run.held_leases())
        if run.rank == 0
        else None
    )
    if pulled is not None and pulled.error is not None:
        raise ckpt.OutDirError(pulled.error)
    return pulled


def _next_batch(run: _Run, state: ckpt.State) -> Pulled | None:
    """The batch this step trains on: the one pulled now, or with learner.lag_steps = k the one pulled k
    steps ago. The first step pulls k + 1 batches from version 0, so step s trains the groups of version
    max(0, s-1-k): the lag builds up to exactly k. None: stopped while waiting for the server."""
    while len(run.held) <= run.cfg.learner.lag_steps:
        pulled = _pull(run, state)
        if pulled is None:
            return None
        run.held.append(pulled)
    return run.held.popleft()


def _give_back_held(run: _Run) -> None:
    """At the end, or on the way out: batches held back for learner.lag_steps were never trained, so their
    groups go back (inflight_leases.json keeps them: what the server could not take back now, a resume
    gives back)."""
    if run.held and run.client is not None:
        release(run.client, run.held_leases())
    run.held.clear()


def _before_training(run: _Run) -> None:
    """Time-sliced: the server stops producing and frees its memory; the base weights come back to the
    GPU. Interrupted: the server is down, so it is not producing either; train, then stop."""
    if run.client is not None and run.cfg.learner.placement == "timeslice":
        with contextlib.suppress(Interrupted):
            run.client.sleep()
    if run.offload:
        move_frozen(run.engine.module, run.device)


def _handoff(run: _Run, state: ckpt.State, pulled: Pulled, adapter) -> tuple[bool, float]:
    """ack the step's leases -> publish its adapter -> [wake the server]. Returns (interrupted: the server
    could not be reached, so --resume will finish this; the server's queue depth after)."""
    client, depth = run.client, 0.0
    crash_point("before_ack", state.step)
    if client is None:
        return False, depth
    try:
        for lease_id in pulled.lease_ids:
            ack(client, lease_id)
        ckpt.write_inflight(run.out, run.held_leases())
        crash_point("before_publish", state.step)
        client.publish(state.version, adapter)
        crash_point("after_publish", state.step)
        if run.cfg.learner.placement == "timeslice":
            client.wake()
        depth = float(client.health().queue_depth)
    except Interrupted as e:
        run.log(f"{e}: stopping with step {state.step} not yet acked/published; --resume will do it")
        return True, depth
    return False, depth


@contextlib.contextmanager
def _profiled(run: _Run, step: int):
    """learner.profile_step: that step's training under torch.profiler, rank 0's operators by self time
    (the table) and its trace written to out_dir/profile/. Its train time includes the profiler's cost."""
    if run.cfg.learner.profile_step != step or run.rank != 0:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield
    folder = run.out / "profile"
    folder.mkdir(exist_ok=True)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    tables = [
        f"{title}:\n" + prof.key_averages(group_by_input_shape=shapes).table(sort_by=sort, row_limit=40)
        for title, shapes in (("by operator", False), ("by operator and input shapes", True))
    ]
    (folder / f"step_{step}.txt").write_text("\n".join(tables) + "\n")
    prof.export_chrome_trace(str(folder / f"step_{step}.trace.json"))
    run.log(f"step {step} profiled: {folder / f'step_{step}.txt'}")


def _loop(run: _Run, state: ckpt.State) -> None:
    """pull -> [sleep] -> train -> persist (adapter, groups, checkpoint) -> metrics -> ack -> publish ->
    [wake], until learner.steps or a stop."""
    cfg, engine = run.cfg, run.engine
    handoff_s, queue_depth = 0.0, 0.0  # the previous step's ack + publish + wake
    t_step = time.perf_counter()
    while state.step < cfg.learner.steps:
        if broadcast_object(run.stop.requested):  # stopped before this step began (while building)
            return
        pulled = _next_batch(run, state)
        if pulled is None:  # stopped while waiting for the server: the last step's checkpoint stands
            return
        _before_training(run)
        crash_point("in_training", state.step + 1)  # the step's groups leased, not yet trained
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t_train = time.perf_counter()
        checked = state.version if run.served_gap > 0 else None  # (0 in replay mode: no server's samples)
        with _profiled(run, state.step + 1):
            metrics = train_step(engine, pulled.groups, cfg, run.rank, run.world, run.pad_id, checked)
        train_s = time.perf_counter() - t_train
        error = served_policy_error(metrics, run.served_gap, state.version, cfg.learner.server_urls)
        if error is not None:  # every rank holds the same gathered metrics: all stop here together
            if run.client is not None:
                release(run.client, pulled.lease_ids)
            raise ServedPolicyError(error)
        if cuda:  # what training held on the GPU at its busiest (PyTorch's tensors; the context is extra)
            metrics["mem/gpu_train_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        state.step += 1
        state.version += 1
        state.pending_leases = pulled.lease_ids

        t_save = time.perf_counter()
        stopping = broadcast_object(run.stop.requested)  # rank 0 decides: no rank waits alone in a collective
        adapter, error = ckpt.persist_step(engine, cfg, run.out, state, pulled.groups, run.rank)
        if error is not None:
            if run.client is not None:  # not durably trained: the groups go back, and the server goes on
                release(run.client, pulled.lease_ids)
            raise ckpt.CheckpointError(error)
        if run.offload:
            move_frozen(engine.module, "cpu")  # free the GPU before the server wakes
        # The record goes out with the checkpoint, so every trained step has one whatever happens next.
        # The handoff (ack, upload, wake) comes after it: its time is reported with the next step.
        metrics |= batch_metrics(pulled, state.version - 1)
        metrics |= {
            "policy/version": float(state.version),
            "perf/train_s": train_s,
            "perf/save_s": time.perf_counter() - t_save,
            "perf/publish_s": handoff_s,
            "perf/step_s": time.perf_counter() - t_step,
            "server/queue_depth": queue_depth,
        }
        if run.client is not None:
            metrics |= run.client.metrics()  # several servers: each one's figures
        with ckpt.writing(run.out, "metrics.jsonl"):
            run.sink.write(state.step, metrics, pulled.groups, run.decode)
        if run.watch is not None:
            run.watch.observe(metrics)
        t_handoff = time.perf_counter()
        interrupted, queue_depth = _handoff(run, state, pulled, adapter)
        state.pending_leases = []
        handoff_s = time.perf_counter() - t_handoff
        if stopping or broadcast_object(interrupted):
            run.published = not interrupted
            return
        t_step = time.perf_counter() - handoff_s  # a step's time includes the handoff before it


def run(cfg: TandemConfig, model_path: str, resume: bool, stop: Stop | None = None) -> int:
    """`stop`: the stop handler, installed before the heavy imports (learner/__main__.py)."""
    rank, world, on_cpu = init_distributed()
    check_batch_size(cfg, world)
    out = Path(cfg.learner.out_dir)
    lead = rank == 0
    log = (lambda *a: print("[learner]", *a, flush=True)) if lead else (lambda *a: None)
    stop = stop or Stop()
    torch.manual_seed(cfg.learner.seed)  # the same LoRA init on every rank
    if on_cpu:
        pin_threads(cfg.learner.threads, log)
        keep_freed_memory(log)

    replay = cfg.learner.replay_file
    shares_gpu = cfg.learner.placement == "timeslice" and not on_cpu
    client = connect(cfg, log, stop) if lead and not replay else None
    try:  # from here on the server may be asleep for us: whatever stops us must not leave it so
        engine, offload = build_beside_server(
            client, cfg, shares_gpu, lambda: build_engine(cfg, model_path, world, on_cpu), log
        )
        device = next(p.device for p in engine.module.parameters() if p.requires_grad)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        state = ckpt.resume(engine, out, rank) if resume else ckpt.State()
        if lead:
            ckpt.truncate_records(out, state.step, log)
            ckpt.save_config(cfg, out)
        if lead and not replay:
            sync_server(client, engine, state, out, log)
        state = broadcast_object(state)  # sync_server may have moved the version on rank 0
        digest_start = ckpt.base_digest(engine) if lead else None
        trackers = Trackers(cfg, out, log) if lead else None
        if trackers:  # the resolved config once; the steps a tracker missed before a resume
            trackers.start(cfg.model_dump(), state.step)
        tensorboard = "tensorboard" in cfg.learner.report_to
        sink = MetricsSink(out, cfg.learner.steps, enabled=lead, tensorboard=tensorboard, trackers=trackers)
        placement = cfg.learner.placement
        log(f"steps {state.step + 1}..{cfg.learner.steps}, {world} process(es), {placement} placement")
        decode = tokenizer.decode
        run = _Run(cfg, engine, client, offload, device, out, sink, stop, rank, world, pad_id, decode, log)
        run.watch = SignalWatch(log) if lead else None
        bound = cfg.learner.served_policy_max_gap
        dtype = next(engine.module.parameters()).dtype
        run.served_gap = SERVED_GAP.get(dtype, 0.25) if bound is None else bound
        if cfg.learner.replay_file:  # replayed groups are no server's: nothing to check them against
            run.served_gap = 0.0
        try:
            _loop(run, state)
        finally:
            _give_back_held(run)
    except BaseException:
        if client is not None:
            client.retry_s = 0.0
            with contextlib.suppress(ServerError, Interrupted):
                client.wake()
        raise

    optimizer_numel = gather_objects(optimizer_state_numel(run.engine))  # a collective: every rank
    summary = ckpt.write_summary(out, engine, state, world, digest_start, optimizer_numel) if lead else None
    sink.close(summary)
    served = f"server serves v{state.version}" if run.published else f"v{state.version} not yet published"
    log(f"done at step {state.step}; {served}" + (" (stopped by signal)" if stop.requested else ""))
    return 0
