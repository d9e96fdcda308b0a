"""A bounded queue of scored groups with leases.

Pulled groups are leased, not removed: `ack` removes them, and a lease that expires returns its groups
to the front of the queue, so nothing is lost if the learner dies mid-step. An ack that arrives after
its lease expired still succeeds while none of its groups has been handed to anyone else (the learner
was slow, not dead): nothing is trained on twice either way.

All methods run on the server's event loop; none awaits between reading and changing state, so
concurrent pullers never receive the same group.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from dataclasses import dataclass

from shared.protocol import ScoredGroup


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
        self._changed = asyncio.Condition()
        self.closed = False  # the server is shutting down: pulls answer at once
        self.expired_total = 0  # groups returned by expiry
        self.acked_total = 0

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
    async def put(self, groups: list[ScoredGroup]) -> None:
        async with self._changed:
            self._ready.extend(groups)
            self._changed.notify_all()

    async def wait_for_space(self, poll_s: float = 1.0) -> None:
        """Return once at least one group fits. Polls too, because space also frees by lease expiry."""
        async with self._changed:
            while self.space() <= 0:
                await self._wait(poll_s)

    async def _wait(self, timeout: float) -> None:
        """Wait for a change, at most `timeout` (the condition's lock must be held)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout=timeout)

    # -- a graceful restart: what a stopping server saves and a starting one takes back --------------
    def contents(self) -> tuple[list[ScoredGroup], dict[str, list[ScoredGroup]]]:
        """The groups waiting, in order, and the leased ones by lease id."""
        self.expire()
        return list(self._ready), {k: list(v.groups) for k, v in self._leases.items()}

    def restore(self, ready: list[ScoredGroup], leases: dict[str, list[ScoredGroup]]) -> None:
        """Take back what contents() gave a server before its restart, in front of anything queued since.
        A lease comes back with a whole lease_s to run: its learner may still ack or release it."""
        self._ready.extendleft(reversed(ready))
        deadline = self._clock() + self.lease_s
        for lease_id, groups in leases.items():
            self._leases[lease_id] = _Lease(list(groups), deadline)

    def close(self) -> None:
        """Shutdown: a pull waiting for groups answers "none" within a second, as at the end of its wait,
        rather than hold the shutdown and end as a 500 when the server gives up on it."""
        self.closed = True

    # -- learner side --------------------------------------------------------------------------------
    async def pull(self, max_groups: int, wait_s: float) -> tuple[str | None, list[ScoredGroup]]:
        deadline = self._clock() + wait_s
        async with self._changed:
            while True:
                self.expire()
                if self._ready:
                    break
                remaining = deadline - self._clock()
                if remaining <= 0 or self.closed:
                    return None, []
                await self._wait(min(remaining, 1.0))
            groups = [self._ready.popleft() for _ in range(min(max_groups, len(self._ready)))]
            lease_id = uuid.uuid4().hex
            self._leases[lease_id] = _Lease(groups, self._clock() + self.lease_s)
            return lease_id, groups

    async def ack(self, lease_id: str) -> int:
        async with self._changed:
            self.expire()
            lease = self._leases.pop(lease_id, None)
            n = len(lease.groups) if lease is not None else self._ack_expired(lease_id)
            self.acked_total += n
            self._changed.notify_all()  # space for the producer
            return n

    async def release(self, lease_id: str) -> int:
        """Return a lease's groups to the front of the queue now (a learner restarting without them)."""
        async with self._changed:
            self.expire()
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                if lease_id in self._expired:  # already back in the queue by expiry
                    return 0
                raise LeaseError(f"unknown lease '{lease_id}'", 404)
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
        del self._expired[lease_id]
        self._ready = deque(g for g in self._ready if g.group_id not in set(ids))
        return len(ids)

    def expire(self) -> int:
        """Return the groups of leases past their deadline. Waiters see them on their next poll (<= 1 s)."""
        now = self._clock()
        returned = 0
        for lease_id in [k for k, v in self._leases.items() if v.deadline <= now]:
            lease = self._leases.pop(lease_id)
            self._ready.extendleft(reversed(lease.groups))  # back to the front, in their order
            self._expired[lease_id] = [g.group_id for g in lease.groups]
            returned += len(lease.groups)
        if len(self._expired) > 1024:  # remember recent expiries only
            for k in list(self._expired)[:-1024]:
                del self._expired[k]
        self.expired_total += returned
        return returned
