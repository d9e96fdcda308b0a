"""The producer: prompts in a deterministic order -> G samples each -> the reward functions -> ScoredGroups
stamped with the policy version that produced them -> the lease queue.

Two ways to produce (server.production). "lockstep": server.prompts_per_batch prompts at a time, one
version for all of them; the next batch starts once every group of this one is scored and queued.
"continuous": up to server.max_inflight_groups groups in flight, each started, scored and queued on its
own, the next prompt started as soon as one is queued, so the engine never waits for a batch's slowest
completion or episode; groups then finish out of their prompts' order.

Production pauses while the queue is full, while asleep and while paused (POST /v1/production/pause: the
work in flight finishes and is queued, nothing new starts until a resume). A sleep cancels the work in
flight; its prompts are not counted as consumed, so they are generated again after the wake. The cursor
(every prompt before (epoch, position) is queued, and those `ahead` of it) is saved with every put's groups
in the queue's journal, so a restarted server, stopped or killed, continues where it was and takes back its
queue (groups waiting and leased): every prompt is queued once, none skipped, none repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from rollout_server.engines.base import GenerationAborted, RolloutBackend
from rollout_server.production import episodes
from rollout_server.production.curriculum import Curriculum
from rollout_server.production.events import EventLog
from rollout_server.production.policy import Policy
from rollout_server.production.queue import LeaseQueue, StateError
from rollout_server.tool_calls import tools_prompt_ids
from shared.config import TandemConfig
from shared.datasets import Problem, chat_prompt_ids, epoch_order
from shared.files import write_atomic
from shared.protocol import Completion, ScoredGroup, is_degenerate
from shared.rewards import RewardCall, RewardRunner, length_shaping

log = logging.getLogger("tandem.server")


@dataclass(frozen=True)
class Cursor:
    """Where production stands in the prompt order: every prompt before (epoch, position) is queued, and so
    are the prompts `ahead` of it (offsets > 0 from it, sorted: groups queued out of order)."""

    epoch: int = 0
    position: int = 0
    ahead: tuple[int, ...] = ()

    def saved(self, num_problems: int) -> tuple:
        """The journal's form: (epoch, position, problems[, ahead])."""
        head = (self.epoch, self.position, num_problems)
        return (*head, list(self.ahead)) if self.ahead else head

    def frontier(self, num_problems: int) -> int:
        """The prompt index (since epoch 0) of (epoch, position): every one below it is queued."""
        return self.epoch * num_problems + self.position

    def made(self, num_problems: int) -> int:
        """Prompts queued since epoch 0: grows with every put."""
        return self.frontier(num_problems) + len(self.ahead)


def _ahead(value, fix: str, where) -> tuple[int, ...]:
    """A saved `ahead` list, checked."""
    if value is None:
        return ()
    if not (isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise StateError(f"{where}: 'ahead' must be a list of integers: {fix}")
    if any(v <= 0 for v in value) or len(set(value)) != len(value):
        raise StateError(f"{where}: 'ahead' must hold distinct offsets > 0: {fix}")
    return tuple(sorted(value))


def _read_state(path: Path, fix: str) -> dict:
    """A state file's JSON object; StateError naming the file and `fix` when it is not one."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateError(f"{path} is not readable JSON ({type(e).__name__}): {fix}") from None
    if not isinstance(saved, dict):
        raise StateError(f"{path} must hold a JSON object, not {type(saved).__name__}: {fix}")
    return saved


def load_cursor(path: Path, num_problems: int) -> Cursor:
    """The saved prompt cursor, checked: a fresh one when there is none, or when the dataset changed."""
    if not path.is_file():
        return Cursor()
    fix = "delete it to start the prompt order over at epoch 0 (prompts already used come round again)"
    saved = _read_state(path, fix)
    epoch, position, size = saved.get("epoch"), saved.get("position"), saved.get("num_problems")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, position, size)):
        raise StateError(f"{path} lacks integer epoch, position and num_problems: {fix}")
    if size != num_problems:
        log.warning("dataset changed since the saved cursor (%s); starting at epoch 0", path)
        return Cursor()
    if not (0 <= epoch < 2**31 and 0 <= position < num_problems):
        raise StateError(
            f"{path}: epoch {epoch}, position {position} is outside 0 <= position < {num_problems} "
            f"problems: {fix}"
        )
    return Cursor(epoch, position, _ahead(saved.get("ahead"), fix, path))


def load_queue(path: Path, model: str) -> tuple[list[ScoredGroup], dict[str, list[ScoredGroup]]]:
    """The groups an older server saved to `path` (queue.json) as it stopped: those waiting, and the leased
    ones by lease id. Nothing when there is no file, or when it was saved for another model (its token ids
    would mean other text). Servers now keep their queue in a journal (rollout_server/production/queue.py)."""
    if not path.is_file():
        return [], {}
    fix = "delete it to start with an empty queue (its groups' prompts then come round next epoch)"
    saved = _read_state(path, fix)
    if saved.get("model") != model:
        log.warning("%s holds groups of model %r, not %r; dropped", path, saved.get("model"), model)
        return [], {}
    try:
        ready = [ScoredGroup.model_validate(g) for g in saved["ready"]]
        leases = {str(k): [ScoredGroup.model_validate(g) for g in v] for k, v in saved["leases"].items()}
    except (KeyError, TypeError, AttributeError, ValidationError) as e:
        raise StateError(f"{path} does not hold scored groups ({type(e).__name__}): {fix}") from None
    return ready, leases


# A verifiers environment whose every episode failed this many batches in a row stops the server.
FAILING_BATCHES = 3


def max_inflight_groups(cfg: TandemConfig) -> int:
    """Continuous production's groups in flight at most: server.max_inflight_groups, else, on vLLM, twice
    the groups that fill its batch (server.vllm.max_num_seqs sequences): a group holds its slots until its
    slowest sample ends, so while some groups are in their tails (one sample still decoding) the groups
    waiting in vLLM's queue fill the slots the others freed; other engines, whose batch tandem does not
    size, server.prompts_per_batch. The queue's room bounds it further."""
    s = cfg.server
    if s.max_inflight_groups is not None:
        return s.max_inflight_groups
    if s.backend == "vllm":
        return 2 * math.ceil(s.vllm.max_num_seqs / cfg.sampling.group_size)
    return s.prompts_per_batch


class EnvironmentFailing(RuntimeError):
    """The environment failed every episode of FAILING_BATCHES batches in a row."""


class Producer:
    def __init__(
        self,
        cfg: TandemConfig,
        backend: RolloutBackend,
        queue: LeaseQueue,
        policy: Policy,
        problems: list[Problem],
        state_dir: Path,
        events: EventLog,
        metrics,
        rewards: RewardRunner,
        verifiers=None,
    ):
        """`verifiers`: the runner of a `verifiers` environment (env.kind = "verifiers"), which then plays
        every group's episodes and scores them."""
        self.cfg = cfg
        self.verifiers = verifiers
        self.rewards = rewards
        self.backend = backend
        self.queue = queue
        self.policy = policy
        self.problems = problems
        self.events = events
        self.metrics = metrics
        self._cursor_file = state_dir / "cursor.json"
        self.cursor = load_cursor(self._cursor_file, len(problems))
        # The queue's journal holds the cursor with the groups it put: newer when the server was killed
        # between the two writes.
        saved = queue.journal.cursor if queue.journal is not None else None
        if saved and saved[2] == len(problems):
            fix = f"delete {queue.journal.path} and {self._cursor_file} to start over at epoch 0"
            ahead = _ahead(saved[3] if len(saved) > 3 else None, fix, queue.journal.path)
            journaled = Cursor(saved[0], saved[1], ahead)
            if journaled.made(len(problems)) > self.cursor.made(len(problems)):
                self.cursor = journaled
        self.continuous = cfg.server.production == "continuous"  # groups made one by one, side by side
        self.inflight_limit = max_inflight_groups(cfg)
        self.curriculum = None  # data.curriculum: the problems skipped, and until which epoch
        if cfg.data.curriculum == "skip_settled":
            self.curriculum = Curriculum(state_dir / "curriculum.json", cfg.data.curriculum_skip_epochs)
        self._awake = asyncio.Event()
        self._awake.set()
        self._producing = asyncio.Event()  # cleared by pause(): nothing new starts until resume()
        self._producing.set()
        self._idle = asyncio.Event()  # set while no generation of production's is in flight
        self._idle.set()
        self._work: dict[int, asyncio.Task] = {}  # prompt index -> its batch's or group's generation
        self._put_lock = asyncio.Lock()  # a cursor computed is the cursor written, in order
        self._halted = False  # server shutdown: nothing new starts
        self._failing = 0  # verifiers batches (or groups) in a row in which every episode failed
        self._orders: dict[int, list[int]] = {}  # epoch -> its prompt order (the recent epochs)
        # Episodes of several turns: the environment, and the tools' schemas the prompts describe.
        self.env, self._tools = None, []
        if cfg.env.turns:
            self.env, self._tools = episodes.build(cfg.env, backend.tokenizer, rewards.call_env)

    def conversation_ids(self, conversation: list[dict]) -> list[int]:
        """A conversation as the prompt the model sees: through the chat template, with the environment's
        tools described (training and evaluation alike)."""
        if self._tools:
            return tools_prompt_ids(self.backend.tokenizer, conversation, self._tools)
        return chat_prompt_ids(self.backend.tokenizer, conversation)

    # -- cursor: prompt index i (since epoch 0) is problem order(i // N)[i % N] of epoch i // N ---------
    def _problem(self, index: int) -> tuple[int, Problem]:
        epoch, position = divmod(index, len(self.problems))
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = epoch_order(len(self.problems), self.cfg.data.seed, epoch)
        return epoch, self.problems[self._orders[epoch][position]]

    def _next(self, k: int) -> tuple[list[int], list[int]]:
        """The next k prompt indices neither queued nor in flight, in order; and those passed over on the
        way because the curriculum skips their problem in their epoch (at most an epoch's worth)."""
        c, n = self.cursor, len(self.problems)
        index = c.frontier(n)
        done = {index + a for a in c.ahead} | set(self._work)
        out, passed = [], []
        while len(out) < k:
            if index not in done:
                if self.curriculum and len(passed) < n and self.curriculum.skips(*self._problem_id(index)):
                    passed.append(index)
                else:
                    out.append(index)
            index += 1
        return out, passed

    def _problem_id(self, index: int) -> tuple[str, int]:
        epoch, problem = self._problem(index)
        return problem.id, epoch

    async def _take(self, k: int) -> list[int]:
        """The next k prompt indices to make groups of; those the curriculum passes over on the way are
        journaled as done, with no group (so a restart does not draw them either)."""
        indices, passed = self._next(k)
        if passed:
            await self._queue(passed, [])
            self.events.write("skip", prompt_ids=[self._problem_id(i)[0] for i in passed], indices=passed)
        return indices

    def _with(self, indices: list[int]) -> Cursor:
        """The cursor once the prompts at `indices` are queued too."""
        c, n = self.cursor, len(self.problems)
        start = c.frontier(n)
        done = {start + a for a in c.ahead} | set(indices)
        while start in done:
            done.remove(start)
            start += 1
        return Cursor(start // n, start % n, tuple(sorted(i - start for i in done)))

    def _save_cursor(self) -> None:
        c = self.cursor
        saved = {"epoch": c.epoch, "position": c.position, "num_problems": len(self.problems)}
        write_atomic(self._cursor_file, json.dumps(saved | ({"ahead": list(c.ahead)} if c.ahead else {})))

    async def _queue(self, indices: list[int], groups: list[ScoredGroup]) -> None:
        """Queue the groups made from the prompts at `indices` (fewer when some were dropped) with the cursor
        that counts those prompts, in one journal line: a kill after it neither skips nor repeats them."""
        async with self._put_lock:
            after = self._with(indices)
            await self.queue.put(groups, cursor=after.saved(len(self.problems)))
            self.cursor = after
            self._save_cursor()
            if self.curriculum is not None and groups:
                epochs = dict(self._problem_id(i) for i in indices)
                for g in groups:
                    self.curriculum.observe(g.prompt_id, epochs[g.prompt_id], is_degenerate(g.rewards))
                self.curriculum.save()
                self.metrics.curriculum_skipped.set(self.curriculum.skipped(after.epoch))
        for g in groups:
            self.events.write("group", group_id=g.group_id, version=g.policy_version)

    # -- sleep / wake --------------------------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        return not self._awake.is_set()

    async def until_awake(self) -> None:
        await self._awake.wait()

    async def sleep(self) -> None:
        self._awake.clear()
        await self._cancel_work()
        await self.backend.sleep()
        self.metrics.sleeping.set(1)
        self.events.write("sleep")

    async def wake(self) -> None:
        await self.backend.wake()
        self._awake.set()
        self.metrics.sleeping.set(0)
        self.events.write("wake")

    async def _cancel_work(self) -> None:
        """Cancel the generation in flight: its prompts are not queued, so they are made again."""
        work = {t for t in self._work.values() if not t.done()}
        for task in work:
            task.cancel()
        if work:
            await asyncio.wait(work)

    # -- pause / resume (POST /v1/production/*): the engine stays awake for other work --------------
    @property
    def paused(self) -> bool:
        return not self._producing.is_set()

    async def pause(self) -> None:
        """Start nothing new; returns once the work in flight, if any, has ended (its groups queued): from
        then on no group appears until resume()."""
        if not self.paused:
            self._producing.clear()
            self.events.write("pause")
        await self._idle.wait()

    def resume(self) -> None:
        if self.paused:
            self._producing.set()
            self.events.write("resume")

    # -- the loop ------------------------------------------------------------------------------------
    def halt(self) -> None:
        """Start nothing after the work in flight (server shutdown; stop() then cancels that)."""
        self._halted = True

    async def stop(self) -> None:
        await self._cancel_work()
        if self.verifiers is not None:
            await self.verifiers.close()

    async def run(self) -> None:
        if self.continuous:
            await self._run_continuous()
            return
        while not self._halted:
            await self._awake.wait()
            await self._producing.wait()
            await self.queue.wait_for_space()
            if self.sleeping or self.paused or self._halted:
                continue
            self._idle.clear()
            try:
                await self._one_batch()
            finally:
                self._idle.set()

    async def _one_batch(self) -> None:
        """The next prompts -> groups -> the queue, with the cursor; nothing queued if the batch is
        cancelled (sleep), aborted by the engine or the server is shutting down."""
        indices = await self._take(min(self.cfg.server.prompts_per_batch, self.queue.space()))
        batch = [self._problem(i) for i in indices]
        adapter = self.policy.acquire()
        try:
            task = asyncio.create_task(self._make_groups(batch, adapter))
            self._work = dict.fromkeys(indices, task)
            await asyncio.wait({task})  # not cancelled with the batch: see sleep()
        finally:
            self._work = {}
            await self.policy.release(adapter)
        if task.cancelled():
            return  # put to sleep mid-batch: the same prompts go again after the wake
        error = task.exception()
        if self._halted:
            # Shutting down, however the batch ended (the engine may have aborted it or died on the
            # same stop signal): nobody will pull its groups; its prompts go again at the restart.
            return
        if isinstance(error, GenerationAborted):
            log.warning("generation batch aborted by the engine (%s); its prompts go again", error)
            return
        await self._queue(indices, task.result())

    async def _run_continuous(self) -> None:
        """Up to inflight_limit groups in flight, while the queue has room for them; each one queued as
        soon as it is scored (out of order), the next prompt started at once."""

        def room() -> bool:
            self._reap()
            if self.sleeping or self.paused or self._halted:
                return False
            return len(self._work) < min(self.inflight_limit, self.queue.space())

        try:
            while not self._halted:
                await self._awake.wait()
                await self._producing.wait()
                await self.queue.wait_until(room, poll_s=0.2)
                if not room():
                    continue
                (index,) = await self._take(1)
                if not room():  # (the curriculum's skips were journaled meanwhile)
                    continue
                self._idle.clear()
                task = self._work[index] = asyncio.create_task(self._one_group(index))
                task.add_done_callback(lambda _: self._idle.set() if self._all_done() else None)
        finally:  # halted, cancelled, or a group failed: the groups still in flight are not queued
            await self._cancel_work()
            with contextlib.suppress(Exception):
                self._reap()

    def _all_done(self) -> bool:
        return all(t.done() for t in self._work.values())

    def _reap(self) -> None:
        """Forget the groups that ended; a group's error (other than the engine aborting it) ends the loop,
        as a batch's does: the server exits and its supervisor restarts it."""
        errors = []
        for index, task in list(self._work.items()):
            if task.done():
                del self._work[index]
                if not task.cancelled() and task.exception() is not None:
                    errors.append(task.exception())
        if errors:
            raise errors[0]

    async def _one_group(self, index: int) -> None:
        adapter = self.policy.acquire()
        try:
            groups = await self._make_groups([self._problem(index)], adapter)
        except GenerationAborted as e:
            log.warning("generation aborted by the engine (%s); the prompt goes again", e)
            return
        finally:
            await self.policy.release(adapter)
        if not self._halted:
            await self._queue([index], groups)

    async def _make_groups(self, batch: list[tuple[int, Problem]], adapter) -> list[ScoredGroup]:
        version = adapter.version if adapter else 0
        if self.verifiers is not None:
            return await self._verifiers_groups(batch, version)
        s = self.cfg.sampling
        limit = self.cfg.model.max_model_len
        prompts = [self.conversation_ids(p.conversation()) for _, p in batch]
        kept = [(b, ids) for b, ids in zip(batch, prompts, strict=True) if len(ids) < limit - 1]
        self.metrics.prompts_too_long.inc(len(batch) - len(kept))
        if not kept:
            return []
        max_tokens = min(s.max_new_tokens, limit - max(len(ids) for _, ids in kept))
        t0 = time.perf_counter()
        if self.cfg.server.inflight_updates == "continue":
            # (continuous production: one prompt; single-turn, checked by the config)
            version, continued = await self._continued(kept[0][1], max_tokens, adapter)
            trajectories = [continued]
        else:
            samples = await self.backend.generate(
                [ids for _, ids in kept],
                n=s.group_size,
                temperature=s.temperature,
                max_tokens=max_tokens,
                adapter=adapter,
            )
            trajectories = [[_Trajectory.of(smp) for smp in group] for group in samples]
        if self.env is not None:
            played = await self.play(
                [(ids, p.conversation(), p.answer, dict(p.metadata)) for (_, p), ids in kept],
                samples,
                adapter,
                s.temperature,
                s.max_new_tokens,
            )
            decode = self.backend.tokenizer.decode
            trajectories = [[_Trajectory.of_episode(e, decode(e.ids)) for e in group] for group in played]
        elapsed = time.perf_counter() - t0
        # (epoch, problem, prompt ids, trajectories) of each group whose samples are all usable
        usable = [(*b, ids, g) for (b, ids), g in zip(kept, trajectories, strict=True) if _usable(g)]
        self.metrics.groups_invalid.inc(len(kept) - len(usable))
        calls = [
            RewardCall(
                t.scored_text, problem.answer, problem.prompt_text, dict(problem.metadata) | t.metadata
            )
            for _, problem, _, group in usable
            for t in group
        ]
        rewards = await self.rewards.score(calls)
        zero = [t.env_failed or (self.cfg.reward.truncated == "zero" and t.finish_reason == "length")
                for *_, group in usable for t in group]  # fmt: skip
        rewards = iter([dict.fromkeys(r, 0.0) if z else r for r, z in zip(rewards, zero, strict=True)])
        groups, cap = [], max_tokens  # the cap these completions were sampled under
        for epoch, problem, ids, group in usable:
            scores = [next(rewards) for _ in group]
            totals = [self.rewards.total(r) for r in scores]
            # length shaping (reward.overlong_buffer, length_penalty): parts of their own, added unweighted
            shaping = [length_shaping(len(t.token_ids), cap, self.cfg.reward) for t in group]
            scores = [r | parts for r, parts in zip(scores, shaping, strict=True)]
            totals = [t + sum(parts.values()) for t, parts in zip(totals, shaping, strict=True)]
            groups.append(_group(epoch, problem, ids, group, version, scores, totals))
        self.metrics.observe_batch(groups, elapsed, self.continuous)
        return groups

    async def _continued(self, prompt: list[int], max_tokens: int, adapter) -> tuple[int, list[_Trajectory]]:
        """G samples of `prompt`, each moved to every newer version served before it ends (server.
        inflight_updates = "continue"): the engine interrupts the samples in flight when a version is
        published, and each unfinished one goes on under the new version from the prompt and the tokens it
        has so far (token in, token out: nothing re-tokenised). Its prompt and tokens are prefilled again
        under the new version (the KV cache is the old weights'; vLLM's prefix cache, keyed by adapter,
        shares the prompt's among the G continuations). Each token keeps the sampler log-prob of the version
        that sampled it, and each sample where each version's tokens begin; the group's version is its
        oldest token's. `adapter` is held by the caller; the newer ones are held here."""
        s = self.cfg.sampling
        parts = [_Parts() for _ in range(s.group_size)]
        held = []
        try:
            while pending := [p for p in parts if p.finish is None]:
                version = adapter.version if adapter else 0
                newer = self.policy.newer_than(version)
                kw = dict(temperature=s.temperature, adapter=adapter, interrupt=newer)
                if not any(p.ids for p in pending):  # the group's start: one request of n samples
                    out = await self.backend.generate([prompt], n=len(pending), max_tokens=max_tokens, **kw)
                    samples = out[0]
                else:  # each unfinished sample on from where it was, under the version now served
                    calls = [
                        self.backend.generate([prompt + p.ids], n=1, max_tokens=max_tokens - len(p.ids), **kw)
                        for p in pending
                    ]
                    samples = [out[0][0] for out in await asyncio.gather(*calls)]
                for p, smp in zip(pending, samples, strict=True):
                    p.add(smp, version)
                    if p.finish is None and len(p.ids) >= max_tokens:  # interrupted at its last token
                        p.finish = "length"
                if any(p.finish is None for p in pending):
                    adapter = self.policy.acquire()  # the version that interrupted them
                    held.append(adapter)
                    self.metrics.samples_continued.inc(sum(p.finish is None for p in pending))
        finally:
            for a in held:
                await self.policy.release(a)
        decode = self.backend.tokenizer.decode
        firsts = [p.versions[0][1] for p in parts if p.versions]
        oldest = min(firsts, default=adapter.version if adapter else 0)
        return oldest, [p.trajectory(decode, oldest) for p in parts]

    async def _verifiers_groups(self, batch: list[tuple[int, Problem]], version: int) -> list[ScoredGroup]:
        """Each problem's G episodes played by the `verifiers` environment (rollout_server/
        verifiers_runner.py), scored by its rewards. A group with an episode that cannot be trained on (its
        tokens not the engine's, several branches) is dropped, counted and logged; an episode the
        environment failed counts 0."""
        t0, g = time.perf_counter(), self.cfg.sampling.group_size
        played = await asyncio.gather(
            *(self.verifiers.play(p.metadata["verifiers_task"], g, version) for _, p in batch)
        )
        self._check_environment(played)
        decode, groups = self.backend.tokenizer.decode, []
        for (epoch, problem), episodes_ in zip(batch, played, strict=True):
            why = next((e for e in episodes_ if isinstance(e, str)), None)
            if why is None and len({tuple(e.prompt_ids) for e in episodes_}) > 1:
                why = "the episodes of one task start from different prompts"
            if why is not None:
                log.warning("group of %s dropped: %s", problem.id, why)
                self.metrics.groups_invalid.inc()
                continue
            for e in episodes_:
                if e.failed:
                    log.warning("an episode of %s failed (its rewards count 0): %s", problem.id, e.failed)
            trajectories = [_Trajectory.of_played(e, decode(e.token_ids)) for e in episodes_]
            scores = [dict.fromkeys(e.rewards, 0.0) if e.failed else e.rewards for e in episodes_]
            totals = [0.0 if e.failed else e.total for e in episodes_]
            ids = episodes_[0].prompt_ids
            groups.append(_group(epoch, problem, ids, trajectories, version, scores, totals))
        elapsed = time.perf_counter() - t0
        self.metrics.observe_batch(groups, elapsed, self.continuous)
        return groups

    def _check_environment(self, played: list[list]) -> None:
        """Stop (EnvironmentFailing: the server exits 1 with the reason) once every episode of
        FAILING_BATCHES batches in a row (continuous production: as many batches' worth of groups) failed or
        could not be trained on: an environment that fails every time (a tool server that does not start,
        a judge that refuses every request) would otherwise feed the learner groups of zeros for as long as
        the run lasts. One good episode resets the count."""
        reasons = [e if isinstance(e, str) else e.failed for episodes_ in played for e in episodes_]
        if not reasons or not all(reasons):
            self._failing = 0
            return
        unit, units, limit = "batch", "batches", FAILING_BATCHES
        if self.continuous:
            unit, units, limit = "group", "groups", FAILING_BATCHES * self.cfg.server.prompts_per_batch
        self._failing += 1
        if self._failing >= limit:
            raise EnvironmentFailing(
                f"env.kind = 'verifiers': every episode of the last {limit} {units} failed; "
                f"the last {unit}'s first reason: {reasons[0]}"
            )
        log.warning("every episode of this %s failed (%d in a row): %s", unit, self._failing, reasons[0])

    async def play(
        self, rows: list[tuple], samples, adapter, temperature: float, max_new_tokens: int
    ) -> list[list[episodes.Episode]]:
        """Each first-turn sample continued as an episode until the environment or a bound ends it. `rows`:
        (prompt ids, conversation, answer, metadata) of each prompt. Every turn samples with `adapter`,
        held by the caller for all of them: an episode has one version."""
        limit, eps, answers = self.cfg.model.max_model_len, [], []
        for (ids, conversation, answer, metadata), group in zip(rows, samples, strict=True):
            budget = min(self.cfg.env.max_tokens or limit, limit - len(ids))
            for smp in group:
                e = episodes.Episode(ids, list(conversation), budget)
                e.add_model_turn(smp)
                eps.append(e)
                answers.append((answer, metadata))
        await episodes.run_turns(
            self.backend, eps, answers, self.env, max_new_tokens, temperature=temperature, adapter=adapter
        )
        out = iter(eps)
        return [[next(out) for _ in group] for group in samples]


@dataclass
class _Parts:
    """A sample built across in-flight weight updates: its tokens so far, their sampler log-probs, and
    where each version's tokens begin."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)  # (token index, version)
    requests: int = 0
    text: str = ""  # the engine's text of the first request (all there is when it was the only one)
    finish: str | None = None

    def add(self, smp, version: int) -> None:
        if smp.token_ids and (not self.versions or self.versions[-1][1] != version):
            self.versions.append((len(self.ids), version))
        self.ids += smp.token_ids
        self.logprobs += smp.logprobs
        self.requests += 1
        self.text = smp.text if self.requests == 1 else ""
        self.finish = None if smp.finish_reason == "interrupted" else smp.finish_reason

    def trajectory(self, decode, group_version: int) -> _Trajectory:
        # one request: the engine's text; several: the whole token sequence decoded at once (a character
        # may span the tokens of two requests)
        text = self.text if self.requests == 1 else decode(self.ids, skip_special_tokens=True)
        versions = None if self.versions in ([], [(0, group_version)]) else self.versions
        return _Trajectory(self.ids, self.logprobs, None, text, text, self.finish, versions=versions)


@dataclass
class _Trajectory:
    """What a group's completion is made of: a single-turn sample, or an episode."""

    token_ids: list[int]
    logprobs: list[float]
    mask: list[int] | None  # None: every token is the model's
    text: str  # all of it, for people
    scored_text: str  # what the reward functions score: the model's (last) turn
    finish_reason: str
    env_failed: bool = False
    metadata: dict = field(default_factory=dict)  # extra row metadata for the reward functions
    versions: list[tuple[int, int]] | None = None  # where each version's tokens begin (several versions)

    @classmethod
    def of(cls, smp) -> _Trajectory:
        return cls(smp.token_ids, smp.logprobs, None, smp.text, smp.text, smp.finish_reason)

    @classmethod
    def of_episode(cls, e: episodes.Episode, text: str) -> _Trajectory:
        mask = _environment_mask(e.mask)
        episode = {"messages": e.messages, "turns": e.turns}
        return cls(
            e.ids,
            e.logprobs,
            mask,
            text,
            e.last_text,
            e.finish_reason,
            e.failed is not None,
            {"episode": episode},
        )

    @classmethod
    def of_played(cls, e, text: str) -> _Trajectory:
        """A `verifiers` episode's trainable branch (rollout_server/verifiers_runner.Played)."""
        mask = _environment_mask(e.mask)
        return cls(e.token_ids, e.logprobs, mask, text, e.last_reply, e.finish_reason, e.failed is not None)


def _environment_mask(mask: list[int]) -> list[int] | None:
    """An episode's loss mask as the protocol carries it: None when every token is the model's."""
    return mask if 0 in mask else None


def _usable(trajectories: list[_Trajectory]) -> bool:
    """A group is kept only if every sample has tokens and finite logprobs: a group with fewer than G
    completions would bias its baseline."""
    return all(t.token_ids and all(math.isfinite(lp) for lp in t.logprobs) for t in trajectories)


def _group(
    epoch: int,
    problem: Problem,
    prompt_ids: list[int],
    trajectories,
    version: int,
    rewards: list[dict[str, float]],
    totals: list[float],
) -> ScoredGroup:
    """One group from G trajectories, each one's {function: reward} and the weighted sum of them that is
    trained on."""
    completions = [
        Completion(
            token_ids=t.token_ids,
            logprobs=[min(lp, 0.0) for lp in t.logprobs],  # float noise can give +1e-7
            mask=t.mask,
            text=t.text,
            reward=total,
            rewards=r,
            finish_reason=t.finish_reason,
            versions=t.versions,
        )
        for t, r, total in zip(trajectories, rewards, totals, strict=True)
    ]
    return ScoredGroup(
        group_id=f"{problem.id}-e{epoch}-{uuid.uuid4().hex[:12]}",
        prompt_id=problem.id,
        prompt_token_ids=prompt_ids,
        answer=problem.answer,
        policy_version=version,
        completions=completions,
    )
