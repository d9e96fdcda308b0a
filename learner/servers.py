"""The learner's conversation with its rollout servers: connecting (one server, or a pool of them), pulling
a step's groups under leases (each lease on disk before its groups are used), acking them after the step
is checkpointed, and giving them back when it is not."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import Protocol

from learner import checkpoint as ckpt
from learner.batch import is_degenerate, is_stale
from learner.client import Interrupted, RolloutClient, ServerError
from learner.pool import ServerPool
from learner.process import Stop
from learner.pulled import Pulled
from shared import protocol as P
from shared.config import TandemConfig


class Servers(Protocol):
    """What the learner asks of its rollout servers: one (learner.client.RolloutClient) or several behind
    one face (learner.pool.ServerPool). Each answers as the server's routes do; `retry_s` is how long an
    unreachable server is waited for (0: fail at once)."""

    retry_s: float

    def wait_ready(self, timeout_s: float, log=print) -> P.Health: ...
    def health(self) -> P.Health: ...
    def pull(self, max_groups: int, wait_s: float, request_id: str | None = None) -> P.PullResponse: ...
    def ack(self, lease_id: str) -> P.AckResponse: ...
    def release(self, lease_id: str) -> P.ReleaseResponse: ...
    def release_pull(self, request_id: str) -> P.ReleaseResponse: ...
    def publish(self, version: int, folder: str | Path) -> P.AdapterPublished: ...
    def sleep(self) -> P.SleepState: ...
    def wake(self) -> P.SleepState: ...
    def metrics(self) -> dict[str, float]: ...
    def close(self) -> None: ...


def collect_groups(
    client: Servers,
    cfg: TandemConfig,
    version: int,
    out: Path,
    floor_version: int = 0,
    holding: tuple[str, ...] = (),
) -> Pulled:
    """B usable groups. Stale ones are dropped; with dynamic sampling degenerate ones too, pulling more
    for up to max_pull_rounds, after which degenerate groups fill what is missing (they still carry
    the KL term). Everything pulled is acked with the step, dropped groups included (and counted).
    Each lease is on disk (inflight_leases.json) before its groups are used; one that cannot be written
    there is given back to the server at once, and the error raised. `holding`: leases of earlier pulls
    still open (learner.lag_steps), kept in the record."""
    need, lc = cfg.learner.prompts_per_step, cfg.learner
    pulled, spare, rounds, t0 = Pulled([], []), [], 0, time.perf_counter()
    told_paused = False
    while len(pulled.groups) < need:
        filtering = lc.dynamic_sampling and rounds < lc.max_pull_rounds
        if not filtering and spare:  # the bound is hit: degenerate groups fill the gap
            take = need - len(pulled.groups)
            pulled.groups, spare = pulled.groups + spare[:take], spare[take:]
            continue
        # The pull's id is on disk before it is sent: killed between the server's answer and the record of
        # its lease id below, the learner's successor can still release that lease (sync_server).
        request_id = uuid.uuid4().hex
        _record(client, out, [*holding, *pulled.lease_ids, PULLING + request_id], pulled.lease_ids)
        resp = client.pull(need - len(pulled.groups), wait_s=lc.pull_wait_s, request_id=request_id)
        rounds += 1
        if resp.paused and not resp.groups and not told_paused:
            told_paused = True
            print(
                "[learner] the rollout server's production is paused (POST /v1/production/pause): "
                "waiting for groups until it is resumed (POST /v1/production/resume)",
                flush=True,
            )
        kept = 0
        for g in resp.groups:
            if is_stale(g, version, lc.max_staleness, floor_version):
                pulled.stale += 1
                continue
            pulled.seen += 1
            kept += 1
            if is_degenerate(g):
                pulled.degenerate += 1
                if filtering:
                    spare.append(g)
                    continue
            pulled.groups.append(g)
        if resp.lease_id and kept:
            leases = [*pulled.lease_ids, resp.lease_id]
            _record(client, out, [*holding, *leases], leases)
            pulled.lease_ids.append(resp.lease_id)
        else:
            if resp.lease_id:  # only stale groups: done with them now, before the lease can run out
                ack(client, resp.lease_id)
            _record(client, out, [*holding, *pulled.lease_ids], pulled.lease_ids)
    pulled.dropped_degenerate = len(spare)
    pulled.seconds = time.perf_counter() - t0
    return pulled


PULLING = "pull:"  # in inflight_leases.json: a pull sent, its lease id not yet known


def _record(client: Servers, out: Path, inflight: list[str], held: list[str]) -> None:
    """inflight_leases.json := `inflight`; if out_dir cannot take it, the leases `held` are given back
    and the error raised."""
    try:
        ckpt.write_inflight(out, inflight)
    except ckpt.OutDirError:
        release(client, held)
        raise


def ack(client: Servers, lease_id: str) -> None:
    """Ack a lease. One that expired and whose groups went out again is reported, not fatal: the groups
    were trained on here, and stopping would not undo the other copy (raise server.lease_s)."""
    try:
        client.ack(lease_id)
    except ServerError as e:
        if e.status not in (404, 409):
            raise
        print(f"[learner] WARNING: {e}", flush=True)


def release(client: Servers, lease_ids: list[str]) -> None:
    """Give leases back untrained (their groups go to the front of the queue), as far as the server
    can be reached: what it cannot take back returns by itself after server.lease_s."""
    retry, client.retry_s = client.retry_s, 0.0  # on the way out: no waiting for a server that is gone
    try:
        for lease_id in lease_ids:
            with contextlib.suppress(ServerError, Interrupted):
                client.release(lease_id)
    finally:
        client.retry_s = retry


def collect_or_stop(client: Servers, cfg: TandemConfig, state: ckpt.State, out: Path, log, holding=()):
    """collect_groups; None when a stop is requested while the server cannot be reached; a Pulled with
    only `error` set when out_dir cannot record the leases (they were given back). Crosses ranks as is."""
    try:
        return collect_groups(client, cfg, state.version, out, state.floor_version, tuple(holding))
    except Interrupted as e:
        log(f"{e}: exit (the last step's checkpoint stands)")
        return None
    except ckpt.OutDirError as e:
        return Pulled([], [], error=str(e))


def connect(cfg: TandemConfig, log, stop: Stop) -> Servers:
    """A client for the server (a pool when learner.server_urls names several), once one answers; its group
    size must be the learner's."""
    lc, token = cfg.learner, os.environ.get(cfg.server.api_token_env) or None
    urls = lc.server_urls
    if len(urls) > 1:
        members = [RolloutClient(url, token=token, log=log) for url in urls]  # fail fast: the pool retries
        client = ServerPool(members, lc.server_retry_s, lc.server_probe_s, log, lambda: stop.requested)
        log(f"{len(urls)} rollout servers: {', '.join(urls)}")
    else:
        client = RolloutClient(
            urls[0], token=token, retry_s=lc.server_retry_s, log=log, should_stop=lambda: stop.requested
        )
    health = client.wait_ready(cfg.learner.connect_timeout_s, log=log)
    log(f"server ok: {health.backend} backend, {health.model}, serving v{health.policy_version}")
    if health.group_size != cfg.sampling.group_size:
        raise ServerError(
            f"server samples group_size={health.group_size}, learner expects sampling.group_size="
            f"{cfg.sampling.group_size}: start both from the same config"
        )
    return client


def _settle_leases(client: Servers, state: ckpt.State, out: Path, log) -> None:
    """Ack what the checkpoint trained on; release what a killed predecessor pulled but never trained,
    so those groups are trained next (not whenever their lease would have expired)."""
    for lease_id in dict.fromkeys([*state.pending_leases, *ckpt.read_inflight(out)]):
        trained = lease_id in state.pending_leases
        try:
            if lease_id.startswith(PULLING):
                if n := client.release_pull(lease_id.removeprefix(PULLING)).released:
                    log(f"released {n} group(s) a pull got just before the restart, never recorded")
            elif trained:
                client.ack(lease_id)
            else:
                n = client.release(lease_id).released
                log(f"released {n} group(s) pulled before the restart but never trained")
        except ServerError as e:
            if e.status != 404:  # 404: already acked (after its checkpoint) or long expired
                log(f"WARNING: could not settle lease {lease_id} from before the restart: {e}")
    state.pending_leases = []
    ckpt.write_inflight(out, [])


def sync_server(client: Servers, engine, state: ckpt.State, out: Path, log) -> None:
    """Settle leases left by a previous run, wake the server if it was left asleep, and make it serve
    exactly this learner's weights before training starts.

    A server ahead of the checkpoint (it serves a version this learner's state does not hold: another
    run's, or steps after a checkpoint that was lost) gets this learner's weights as the next version;
    groups made by older versions are then stale (ckpt.State.floor_version)."""
    _settle_leases(client, state, out, log)
    health = client.health()
    if health.sleeping:  # a previous learner may have died between sleep and wake
        client.wake()
    served = health.policy_version
    if served == state.version:
        return
    if served > state.version:
        log(
            f"WARNING: the server serves v{served}, ahead of this learner's checkpoint (step {state.step}, "
            f"v{state.version}); publishing this learner's weights as v{served + 1} so both sides agree. "
            f"Groups made by v{served} and older are dropped as stale"
        )
        state.version = state.floor_version = served + 1
    # Saved from the weights just loaded, never taken from disk: after a jump, adapters/v<N> may hold the
    # weights of a step that the resumed checkpoint does not (one trained after it, then pointed back).
    folder = ckpt.save_adapter(engine, out, state.version)
    client.publish(state.version, folder)
    log(f"published v{state.version} to the server (it served v{served})")
