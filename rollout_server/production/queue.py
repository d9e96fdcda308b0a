"""A bounded queue of scored groups with leases.

Pulled groups are leased, not removed: `ack` removes them, and a lease that expires returns its groups
to the front of the queue, so nothing is lost if the learner dies mid-step. An ack that arrives after
its lease expired still succeeds while none of its groups has been handed to anyone else (the learner
was slow, not dead): nothing is trained on twice either way.

The queue is kept on disk as it changes (`Journal`): a server killed outright (SIGKILL, the OOM killer, a
lost machine's process) takes back its groups, waiting and leased, at the next start, as one stopped
cleanly does; the prompts its cursor has passed are never skipped.

All methods run on the server's event loop; none awaits between reading and changing state, so
concurrent pullers never receive the same group.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass

from shared.protocol import ScoredGroup

log = logging.getLogger("tandem.server")


class StateError(RuntimeError):
    """A file in server.state_dir is damaged; the message names it and says what to do."""


class LeaseError(Exception):
    """Unknown lease (404), or one whose groups were already handed to another puller (409)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass
class _Lease:
    groups: list[ScoredGroup]
    deadline: float


class LeaseQueue:
    def __init__(self, capacity: int, lease_s: float, clock=time.monotonic):
        self.capacity = capacity
        self.lease_s = lease_s
        self._clock = clock
        self._ready: deque[ScoredGroup] = deque()
        self._leases: dict[str, _Lease] = {}
        self._expired: dict[str, list[str]] = {}  # lease id -> group ids returned to the queue
        self._requests: dict[str, str] = {}  # a puller's request id -> the lease it got (for its retries)
        self._withdrawn: dict[str, None] = {}  # request ids released before their pull was answered
        self._changed = asyncio.Condition()
        self.closed = False  # the server is shutting down: pulls answer at once
        self.waiting = 0  # pulls waiting for groups now
        self.expired_total = 0  # groups returned by expiry
        self.acked_total = 0
        self.journal: Journal | None = None  # every change on disk before it is answered, once attached

    # -- sizes: the groups waiting to be pulled are bounded by capacity (the producer waits for space).
    # Leased groups do not count: a learner that drops degenerate groups (dynamic sampling) holds its
    # lease while it pulls more, and counting the lease would starve it until pull_wait_s ran out.
    @property
    def depth(self) -> int:
        return len(self._ready)

    @property
    def leased(self) -> int:
        return sum(len(lease.groups) for lease in self._leases.values())

    def space(self) -> int:
        self.expire()
        return self.capacity - self.depth

    # -- producer side -------------------------------------------------------------------------------
    async def put(self, groups: list[ScoredGroup], cursor: tuple[int, int, int] | None = None) -> None:
        """Queue `groups`; `cursor` (epoch, position, problems) is the producer's once they are made, kept
        with them on disk: a restart neither skips their prompts nor makes them again."""
        async with self._changed:
            self._write({"put": [g.model_dump(mode="json") for g in groups], "cursor": cursor})
            self._ready.extend(groups)
            self._changed.notify_all()

    async def wait_for_space(self, poll_s: float = 1.0) -> None:
        """Return once at least one group fits. Polls too, because space also frees by lease expiry."""
        await self.wait_until(lambda: self.space() > 0, poll_s)

    async def wait_until(self, ready, poll_s: float = 1.0) -> None:
        """Return once `ready()` holds, checked at each change of the queue and every poll_s."""
        async with self._changed:
            while not ready():
                await self._wait(poll_s)

    async def _wait(self, timeout: float) -> None:
        """Wait for a change, at most `timeout` (the condition's lock must be held). asyncio.timeout, not
        wait_for: Python 3.11's wait_for can swallow a cancellation that lands as the wait ends, and a
        producer cancelled at a kill or a shutdown then went on starting generations."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._changed.wait()

    # -- a graceful restart: what a stopping server saves and a starting one takes back --------------
    def contents(self) -> tuple[list[ScoredGroup], dict[str, list[ScoredGroup]]]:
        """The groups waiting, in order, and the leased ones by lease id."""
        self.expire()
        return list(self._ready), {k: list(v.groups) for k, v in self._leases.items()}

    def restore(
        self,
        ready: list[ScoredGroup],
        leases: dict[str, list[ScoredGroup]],
        expired: dict[str, list[str]] | None = None,
        requests: dict[str, str] | None = None,
    ) -> None:
        """Take back the queue of a server before its restart, in front of anything queued since. A lease
        comes back with a whole lease_s to run: its learner may still ack or release it; one that had
        expired (`expired`: lease id -> group ids) may still be acked late while its groups wait."""
        self._ready.extendleft(reversed(ready))
        deadline = self._clock() + self.lease_s
        for lease_id, groups in leases.items():
            self._leases[lease_id] = _Lease(list(groups), deadline)
        self._expired.update(expired or {})
        self._requests.update(requests or {})

    def close(self) -> None:
        """Shutdown: a pull waiting for groups answers "none" within a second, as at the end of its wait,
        rather than hold the shutdown and end as a 500 when the server gives up on it."""
        self.closed = True

    # -- learner side --------------------------------------------------------------------------------
    def lease_of(self, request_id: str) -> str | None:
        """The lease a pull of `request_id` got, while it is held."""
        return (self.answered(request_id) or (None, []))[0]

    def withdraw(self, request_id: str) -> None:
        """The puller of `request_id` is gone (its successor released the pull, or its connection closed)
        before the pull was answered: a pull still waiting under that id, or arriving later, leases
        nothing. Remembered for the recent ones, as answers are."""
        self._withdrawn[request_id] = None
        if len(self._withdrawn) > 1024:
            del self._withdrawn[next(iter(self._withdrawn))]

    def answered(self, request_id: str) -> tuple[str | None, list[ScoredGroup]] | None:
        """What a pull of `request_id` got, if one was answered: a retry whose answer was lost on the way
        (a reset connection, a timeout) gets the same lease again, or nothing when that lease was settled
        or expired since (its groups are not this puller's any more); None for a new request."""
        if request_id not in self._requests:
            return None
        self.expire()
        lease = self._leases.get(self._requests[request_id])
        return (self._requests[request_id], list(lease.groups)) if lease is not None else (None, [])

    async def pull(
        self, max_groups: int, wait_s: float, request_id: str | None = None
    ) -> tuple[str | None, list[ScoredGroup]]:
        """Lease up to `max_groups`, waiting up to `wait_s` for the first. A pull whose request id was
        withdrawn meanwhile (its puller is gone) ends within a second with nothing leased."""
        deadline = self._clock() + wait_s
        async with self._changed:
            self.waiting += 1
            try:
                while True:
                    if request_id in self._withdrawn:
                        return None, []
                    self.expire()
                    if self._ready:
                        break
                    remaining = deadline - self._clock()
                    if remaining <= 0 or self.closed:
                        return None, []
                    await self._wait(min(remaining, 1.0))
            finally:
                self.waiting -= 1
            groups = list(itertools.islice(self._ready, max_groups))
            lease_id = uuid.uuid4().hex
            self._write({"lease": lease_id, "ids": [g.group_id for g in groups], "request": request_id})
            for _ in groups:
                self._ready.popleft()
            self._leases[lease_id] = _Lease(groups, self._clock() + self.lease_s)
            if request_id is not None:
                self._requests[request_id] = lease_id
                if len(self._requests) > 1024:  # recent pulls only: a retry comes within minutes
                    del self._requests[next(iter(self._requests))]
            return lease_id, groups

    async def ack(self, lease_id: str) -> int:
        async with self._changed:
            self.expire()
            lease = self._leases.get(lease_id)
            if lease is None:
                n = self._ack_expired(lease_id)
            else:
                self._write({"ack": lease_id})
                del self._leases[lease_id]
                n = len(lease.groups)
            self.acked_total += n
            self._changed.notify_all()  # space for the producer
            return n

    async def release(self, lease_id: str) -> int:
        """Return a lease's groups to the front of the queue now (a learner restarting without them)."""
        async with self._changed:
            self.expire()
            lease = self._leases.get(lease_id)
            if lease is None:
                if lease_id in self._expired:  # already back in the queue by expiry
                    return 0
                raise LeaseError(f"unknown lease '{lease_id}'", 404)
            self._write({"back": lease_id})
            del self._leases[lease_id]
            self._ready.extendleft(reversed(lease.groups))
            self._changed.notify_all()
            return len(lease.groups)

    def _ack_expired(self, lease_id: str) -> int:
        ids = self._expired.get(lease_id)
        if ids is None:
            raise LeaseError(f"unknown lease '{lease_id}'", 404)
        waiting = {g.group_id for g in self._ready}
        if not set(ids) <= waiting:
            raise LeaseError(
                f"lease '{lease_id}' expired and its groups were handed out again; "
                "ack sooner or raise server.lease_s",
                409,
            )
        self._write({"ack": lease_id, "ids": ids})
        del self._expired[lease_id]
        self._ready = deque(g for g in self._ready if g.group_id not in set(ids))
        return len(ids)

    def expire(self) -> int:
        """Return the groups of leases past their deadline. Waiters see them on their next poll (<= 1 s)."""
        now = self._clock()
        returned = 0
        for lease_id in [k for k, v in self._leases.items() if v.deadline <= now]:
            self._write({"back": lease_id, "expired": True})
            lease = self._leases.pop(lease_id)
            self._ready.extendleft(reversed(lease.groups))  # back to the front, in their order
            self._expired[lease_id] = [g.group_id for g in lease.groups]
            returned += len(lease.groups)
        if len(self._expired) > 1024:  # remember recent expiries only
            for k in list(self._expired)[:-1024]:
                del self._expired[k]
        self.expired_total += returned
        return returned

    def _write(self, change: dict) -> None:
        """On disk before it is made (the journal may rewrite itself from the queue as it stands)."""
        if self.journal is not None:
            self.journal.write(change, self)


class Journal:
    """The queue on disk: one JSON line per change, appended (and flushed to the OS, which keeps it when the
    process dies) before the change is made, so the file always holds at least what the server answered.
    Replayed at start-up; rewritten whole, as the queue's contents, at start-up and whenever it holds many
    more lines than the queue holds groups. A line cut short by a kill is the change that was never made.

    Lines: {"model"} first; {"put": [groups], "cursor"}; {"lease", "ids", "request"} (the puller's request
    id, for its retries); {"ack"[, "ids"]} (the ids of a lease acked after it expired); {"back"[,
    "expired"]} (a lease's groups back to the front); {"expired", "ids"} (a compacted file's memory of an
    expired lease, for its late ack)."""

    def __init__(self, path, model: str):
        self.path, self.model = path, model
        self.cursor: tuple[int, int, int] | None = None  # the newest cursor written
        self.requests: dict[str, str] = {}  # request id -> lease id, of the leases replay() found
        self._lines = 0
        self._file = None

    def replay(self) -> tuple[list[ScoredGroup], dict[str, list[ScoredGroup]], dict[str, list[str]]]:
        """The queue the file describes: groups waiting in order, leases, and leases returned by expiry
        (lease id -> group ids, so their learner's late ack still works). Nothing for another model's."""
        from pydantic import ValidationError

        ready: list[ScoredGroup] = []
        leases: dict[str, list[ScoredGroup]] = {}
        expired: dict[str, list[str]] = {}
        if not self.path.is_file():
            return ready, leases, expired
        fix = "delete it to start with an empty queue (its groups' prompts then come round next epoch)"
        lines = self.path.read_text(errors="replace").splitlines()
        for n, line in enumerate(lines, 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):
                    break  # the change being written when the server was killed: never made
                raise StateError(f"{self.path}, line {n}: not JSON: {fix}") from None
            try:
                if n == 1:
                    if rec.get("model") != self.model:
                        other, path = rec.get("model"), self.path
                        log.warning("%s holds groups of model %r, not %r; dropped", path, other, self.model)
                        return [], {}, {}
                elif "put" in rec:
                    ready += [ScoredGroup.model_validate(g) for g in rec["put"]]
                    if rec.get("cursor") is not None:
                        self.cursor = tuple(rec["cursor"])
                elif "lease" in rec:
                    if rec.get("request"):
                        self.requests[rec["request"]] = rec["lease"]
                    ids = set(rec["ids"])
                    leases[rec["lease"]] = [g for g in ready if g.group_id in ids]
                    ready = [g for g in ready if g.group_id not in ids]
                elif "ack" in rec:
                    if rec["ack"] in leases:
                        del leases[rec["ack"]]
                    else:
                        ids = set(rec.get("ids", []))
                        ready = [g for g in ready if g.group_id not in ids]
                        expired.pop(rec["ack"], None)
                elif "back" in rec:
                    groups = leases.pop(rec["back"], [])
                    ready = groups + ready
                    if rec.get("expired"):
                        expired[rec["back"]] = [g.group_id for g in groups]
                elif "expired" in rec:
                    expired[rec["expired"]] = list(rec["ids"])
                else:
                    raise KeyError("no known change")
            except (KeyError, TypeError, AttributeError, ValueError, ValidationError) as e:
                what = f"not a queue change ({type(e).__name__})"
                raise StateError(f"{self.path}, line {n}: {what}: {fix}") from None
        return ready, leases, expired

    def write(self, change: dict, queue: LeaseQueue) -> None:
        if change.get("cursor") is not None:
            self.cursor = tuple(change["cursor"])
        if self._lines > 64 + 8 * (queue.depth + queue.leased) or not self.path.exists():
            self.compact(queue)
        if self._file is None:
            self._file = self.path.open("a")
        self._file.write(json.dumps(change) + "\n")
        self._file.flush()
        self._lines += 1

    def compact(self, queue: LeaseQueue) -> None:
        """Rewrite the file as the queue's contents now (whole or not at all)."""
        ready, leases = list(queue._ready), {k: v.groups for k, v in queue._leases.items()}
        asked = {lease: request for request, lease in queue._requests.items()}
        everything = [*ready, *(g for groups in leases.values() for g in groups)]
        lines = [
            {"model": self.model},
            {"put": [g.model_dump(mode="json") for g in everything], "cursor": self.cursor},
            *(
                {"lease": k, "ids": [g.group_id for g in groups], "request": asked.get(k)}
                for k, groups in leases.items()
            ),
            *({"expired": k, "ids": ids} for k, ids in queue._expired.items()),
        ]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
        if self._file is not None:
            self._file.close()
            self._file = None
        tmp.replace(self.path)
        self._lines = len(lines)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
