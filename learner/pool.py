"""Several rollout servers behind the one-server interface the training loop uses (learner.server_urls).

- pull: the servers in turn, each asked without waiting first, so any server with groups answers at once;
  with none ready, short waits on each in turn until pull's wait_s. A lease id says which server issued
  it (`<server index>@<lease id>`), so ack and release go back to that server.
- publish, sleep, wake: to every server that is up, in parallel.
- A server that fails (connection refused, reset, timeout, 502/504) is marked down with a warning and
  skipped; it is tried again every learner.server_probe_s. When it answers again it is brought to the
  state of the others before it is pulled from: acks it missed, the newest published version (it may
  have restarted with an older stored adapter), asleep or awake as they are. Groups it made under a version
  older than learner.max_staleness are dropped and counted by the loop as stale, as always.
- When no server answers, the pool waits (backoff, as one client does) and raises ServerUnavailable after
  learner.server_retry_s, or Interrupted when a stop is requested meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from learner.client import Interrupted, RolloutClient, ServerError, ServerUnavailable
from shared import protocol as P

SEP = "@"


@dataclass
class Member:
    client: RolloutClient
    index: int
    up: bool = True
    next_probe: float = 0.0
    groups: int = 0  # pulled from it, over the run
    failures: int = 0
    version: int = 0  # served, as last seen
    queue_depth: int = 0
    unacked: list[str] = field(default_factory=list)  # its leases whose ack could not be delivered


class ServerPool:
    def __init__(self, clients: list[RolloutClient], retry_s: float, probe_s: float, log=print,
                 should_stop=lambda: False):  # fmt: skip
        self.members = [Member(c, i) for i, c in enumerate(clients)]
        self.retry_s, self.probe_s, self._log, self._should_stop = retry_s, probe_s, log, should_stop
        self.url = ", ".join(c.url for c in clients)
        self._turn = 0
        self._published: tuple[int, Path] | None = None  # the newest version sent out, and its folder
        self._asleep = False
        self._threads = ThreadPoolExecutor(max_workers=len(clients))
        self.group_size: int | None = None

    # -- membership ----------------------------------------------------------------------------------
    def _down(self, m: Member, error: Exception) -> None:
        m.failures += 1
        if m.up:
            self._log(f"WARNING: rollout server {m.index} ({m.client.url}) is down ({error}); going on with "
                      f"the others, trying it again every {self.probe_s:g} s")  # fmt: skip
        m.up, m.next_probe = False, time.monotonic() + self.probe_s

    def _call(self, m: Member, fn):
        """fn(client), or None with the server marked down when it cannot be reached."""
        try:
            return fn(m.client)
        except ServerUnavailable as e:
            self._down(m, e)
            return None

    def _catch_up(self, m: Member) -> None:
        """A server that answers again: check it, deliver what it missed, then count it up."""
        # one try, no waiting: ServerUnavailable if it does not answer (yet)
        health = m.client.wait_ready(0.0, log=lambda *a: None)
        if self.group_size is not None and health.group_size != self.group_size:
            raise ServerError(
                f"server {m.index} ({m.client.url}) samples group_size={health.group_size}, the others "
                f"{self.group_size}: start every server from the same config"
            )
        for lease in m.unacked:  # a restarted server never knew the lease: its groups are gone with it
            with contextlib.suppress(ServerError):
                m.client.ack(lease)
        m.unacked.clear()
        m.version = health.policy_version
        if self._published is not None and health.policy_version < self._published[0]:
            version, folder = self._published
            m.client.publish(version, folder)
            m.version = version
            self._log(f"rollout server {m.index} ({m.client.url}) is back; brought from "
                      f"v{health.policy_version} to v{version}")  # fmt: skip
        else:
            self._log(f"rollout server {m.index} ({m.client.url}) is back, serving v{health.policy_version}")
        if self._asleep:
            m.client.sleep()
        elif health.sleeping:
            m.client.wake()
        m.up = True

    def _probe(self) -> None:
        now = time.monotonic()
        for m in self.members:
            if not m.up and now >= m.next_probe:
                try:
                    self._catch_up(m)
                except ServerUnavailable:
                    m.next_probe = time.monotonic() + self.probe_s

    def live(self) -> list[Member]:
        """The servers up now (the ones due a probe tried first); waits while there are none, for up to
        retry_s, then ServerUnavailable."""
        deadline, delay = time.monotonic() + self.retry_s, 1.0
        while True:
            self._probe()
            up = [m for m in self.members if m.up]
            if up:
                return up
            if time.monotonic() + delay > deadline:
                raise ServerUnavailable(
                    f"no rollout server answered for learner.server_retry_s={self.retry_s:.0f} s ({self.url})"
                )
            if self._should_stop():
                raise Interrupted("stop requested while no rollout server was reachable")
            time.sleep(delay)
            for m in self.members:
                m.next_probe = 0.0
            delay = min(delay * 2, 30.0)

    def _everywhere(self, fn, needs=lambda m: True) -> list:
        """fn(client) on every server up that `needs` it, in parallel; the answers of those that answered."""
        members = self.live()
        answers = list(self._threads.map(lambda m: (m, self._call(m, fn)), [m for m in members if needs(m)]))
        if answers and all(a is None for _, a in answers):
            return self._everywhere(fn, needs)  # all failed meanwhile: wait for one (or give up) in live()
        return answers

    # -- the loop's interface ------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float, log=print) -> P.Health:
        """The first server to answer, within timeout_s; the others are probed as the run goes."""
        deadline = time.monotonic() + timeout_s
        while True:
            for m in self.members:
                try:
                    health = m.client.wait_ready(0.0, log=lambda *a: None)
                except ServerUnavailable:
                    continue
                self.group_size = health.group_size
                for other in self.members:
                    other.up, other.next_probe = other is m, 0.0
                self._probe()  # the rest, now, if they answer
                down = [o.client.url for o in self.members if not o.up]
                if down:
                    log(f"rollout servers not answering yet (skipped until they do): {', '.join(down)}")
                return health
            if time.monotonic() > deadline:
                raise ServerUnavailable(
                    f"no rollout server became healthy within {timeout_s:.0f} s ({self.url}). Are they "
                    "running, and is learner.server_urls right?"
                )
            time.sleep(1.0)

    def pull(self, max_groups: int, wait_s: float, request_id: str | None = None) -> P.PullResponse:
        deadline = time.monotonic() + wait_s
        while True:
            members = self.live()
            self._turn += 1
            order = members[self._turn % len(members) :] + members[: self._turn % len(members)]
            paused = True  # every server that answered has its production paused
            for i, m in enumerate(order):
                last = time.monotonic() >= deadline
                # first round: no waiting; then a short wait on one server at a time, in turn
                wait = 0.0 if i < len(order) - 1 or last else min(1.0, max(0.0, deadline - time.monotonic()))
                resp = self._call(m, lambda c, w=wait: c.pull(max_groups, w, request_id))
                if resp is not None and resp.groups:
                    m.groups += len(resp.groups)
                    return resp.model_copy(update={"lease_id": f"{m.index}{SEP}{resp.lease_id}"})
                paused = paused and (resp is None or resp.paused)
            if time.monotonic() >= deadline:
                return P.PullResponse(lease_id=None, lease_s=0.0, groups=[], paused=paused)

    def _member(self, lease_id: str) -> tuple[Member, str]:
        index, sep, inner = lease_id.partition(SEP)
        if not sep or not index.isdigit() or int(index) >= len(self.members):
            raise ServerError(f"lease {lease_id!r} names no server of learner.server_urls", 404)
        return self.members[int(index)], inner

    def ack(self, lease_id: str) -> P.AckResponse:
        m, inner = self._member(lease_id)
        if m.up:
            resp = self._call(m, lambda c: c.ack(inner))
            if resp is not None:
                return resp
        m.unacked.append(inner)  # delivered when it is back (a restarted server lost the groups anyway)
        return P.AckResponse(acked=0)

    def release(self, lease_id: str) -> P.ReleaseResponse:
        m, inner = self._member(lease_id)
        resp = self._call(m, lambda c: c.release(inner)) if m.up else None
        return resp if resp is not None else P.ReleaseResponse(released=0)

    def release_pull(self, request_id: str) -> P.ReleaseResponse:
        """On every server up: the lease a pull of `request_id` got there (one id per pull, all servers)."""
        got = [self._call(m, lambda c: c.release_pull(request_id)) for m in self.members if m.up]
        return P.ReleaseResponse(released=sum(r.released for r in got if r is not None))

    def publish(self, version: int, folder: str | Path) -> P.AdapterPublished:
        self._published = (version, Path(folder))

        def send(c: RolloutClient):
            try:
                return c.publish(version, folder)
            except ServerError as e:  # already there (a catch-up got in first): that is the goal
                if e.status == 409 and c.health().policy_version >= version:
                    return P.AdapterPublished(version=version, name=P.adapter_name(version))
                raise

        # live() may bring a server that is back to this very version first: it needs no second copy
        for m, answer in self._everywhere(send, needs=lambda m: m.version < version):
            if answer is not None:
                m.version = version
        return P.AdapterPublished(version=version, name=P.adapter_name(version))

    def sleep(self) -> P.SleepState:
        self._asleep = True
        self._everywhere(lambda c: c.sleep())
        return P.SleepState(sleeping=True)

    def wake(self) -> P.SleepState:
        self._asleep = False
        self._everywhere(lambda c: c.wake())
        return P.SleepState(sleeping=False)

    def health(self) -> P.Health:
        """The first server's health with the queue depth and leases of all that answer."""
        answers = [(m, h) for m, h in self._everywhere(lambda c: c.health()) if h is not None]
        for m, h in answers:
            m.version, m.queue_depth = h.policy_version, h.queue_depth
        first = answers[0][1]
        return first.model_copy(
            update={
                "queue_depth": sum(h.queue_depth for _, h in answers),
                "leased": sum(h.leased for _, h in answers),
            }
        )

    def metrics(self) -> dict[str, float]:
        """Per server: groups pulled (over the run), served version, queue depth, failures, up."""
        out = {}
        for m in self.members:
            k = f"server/{m.index}"
            out |= {f"{k}/groups": float(m.groups), f"{k}/version": float(m.version),
                    f"{k}/queue_depth": float(m.queue_depth), f"{k}/failures": float(m.failures),
                    f"{k}/up": float(m.up)}  # fmt: skip
        return out

    def close(self) -> None:
        self._threads.shutdown(wait=False)
        for m in self.members:
            m.client.close()
