"""Which adapter version is served, and when an old one may be unloaded.

Versions only move forward. A publish is checked and stored first, then loaded into the engine under
its own name, and only then switched to; if any step fails the served version is unchanged. The version
it replaces is unloaded as soon as no generation in flight still uses it. Stored versions beyond
server.keep_versions are deleted (except every learner.keep_every-th), so the disk does not grow by
an adapter a step.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter

from rollout_server.engines.base import Adapter, AdapterLoadError, RolloutBackend
from rollout_server.production.adapters import AdapterRejected, AdapterStore

log = logging.getLogger("tandem.server")
# Fault tests only: acknowledge each publish after the first but keep serving the weights served before it,
# as a server whose adapter never reaches its engine would (the learner's served-policy check must stop).
SERVE_PREVIOUS = "TANDEM_FAULT_SERVE_PREVIOUS"


class Policy:
    def __init__(
        self,
        backend: RolloutBackend,
        store: AdapterStore,
        check=lambda folder: None,
        keep: int | None = None,
        keep_every: int = 0,
    ):
        self.backend = backend
        self.store = store
        self._check = check  # folder -> None, or AdapterRejected: the upload checks, for stored versions
        self.keep, self.keep_every = keep, keep_every  # stored versions: the newest `keep`, every k-th
        self.served: Adapter | None = None  # None = the base model, version 0
        self._inflight: Counter[int] = Counter()
        self._retired: set[int] = set()  # replaced versions still loaded
        self._lock = asyncio.Lock()
        self._next = asyncio.Event()  # set (and replaced) whenever a newer version is served

    @property
    def version(self) -> int:
        return self.served.version if self.served else 0

    def newer_than(self, version: int) -> asyncio.Event:
        """An event set once a version newer than `version` is served (at once if one is already)."""
        if self.version > version:
            served = asyncio.Event()
            served.set()
            return served
        return self._next

    def acquire(self) -> Adapter | None:
        """The adapter new work should use; pair with release()."""
        if self.served is not None:
            self._inflight[self.served.version] += 1
        return self.served

    async def release(self, adapter: Adapter | None) -> None:
        if adapter is None:
            return
        self._inflight[adapter.version] -= 1
        if self._inflight[adapter.version] <= 0:
            del self._inflight[adapter.version]
            if adapter.version in self._retired:
                await self._unload(adapter)

    async def _unload(self, adapter: Adapter) -> None:
        self._retired.discard(adapter.version)
        await self.backend.unload_adapter(adapter)
        log.info("unloaded %s", adapter.name)

    def lookup(self, version: int | None) -> Adapter | None:
        """The adapter for an evaluation request: None/served, 0 = base, or any stored version."""
        if version is None or version == self.version:
            return self.served
        if version == 0:
            return None
        if version > self.version:
            raise AdapterRejected(f"adapter version {version} was never published here", status=404)
        if not self.store.path(version).is_dir():
            kept = f"the newest {self.keep}" + (f" and every {self.keep_every}-th" if self.keep_every else "")
            why = f"no longer stored here (server.keep_versions: {kept})"
            raise AdapterRejected(f"adapter version {version} is {why}", status=404)
        return Adapter(version, str(self.store.path(version)))

    async def restore(self) -> None:
        """At start-up: serve the newest stored version, if any (a restarted server keeps its policy)."""
        for version in reversed(self.store.versions()):
            adapter = Adapter(version, str(self.store.path(version)))
            try:
                self._check(self.store.path(version))
                await self.backend.load_adapter(adapter)
            except (AdapterRejected, AdapterLoadError) as e:
                log.error("stored adapter v%d is refused (%s); trying an older one", version, e)
                continue
            self.served = adapter
            log.info("restored %s from %s", adapter.name, adapter.path)
            return

    async def publish(self, version: int, write) -> Adapter:
        """`write(version) -> Path` stores the (already validated) files; runs under the publish lock."""
        async with self._lock:
            if version <= self.version:
                raise AdapterRejected(
                    f"adapter version {version} is not newer than the served version {self.version}; "
                    "versions only move forward",
                    status=409,
                )
            path = write(version)
            adapter = Adapter(version, str(path))
            if os.environ.get(SERVE_PREVIOUS) == "1" and self.served is not None:
                log.warning("%s=1: v%d acknowledged, the weights served before kept", SERVE_PREVIOUS, version)
                adapter = Adapter(version, self.served.path)
            try:
                await self.backend.load_adapter(adapter)
            except AdapterLoadError as e:
                self.store.remove(version)
                raise AdapterRejected(str(e)) from None
            old, self.served = self.served, adapter
            self._next.set()  # samples in flight may move to it (server.inflight_updates = 'continue')
            self._next = asyncio.Event()
            if old is not None:
                self._retired.add(old.version)
                if not self._inflight[old.version]:
                    await self._unload(old)
            log.info("serving %s", adapter.name)
            self._prune()
            return adapter

    def _prune(self) -> None:
        """Delete stored versions beyond the newest `keep`, except every `keep_every`-th and any still in
        use (loaded, or generating)."""
        if self.keep is None:
            return
        versions = self.store.versions()
        kept = set(versions[-self.keep :]) | set(self._inflight) | self._retired | {self.version}
        for v in versions:
            if v not in kept and not (self.keep_every and v % self.keep_every == 0):
                self.store.remove(v)
