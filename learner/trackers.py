"""Experiment trackers (learner.report_to): Weights & Biases, Trackio and MLflow, beside metrics.jsonl.

Each tracker gets the resolved config once, every step's metrics under metrics.jsonl's names, the held-out
evaluations a run is given (out_dir/evaluations.jsonl, written by `learner.evaluate --run-dir`), a table of
sampled trajectories every `learner.trackers.samples_every` steps, and the run's summary at the end.

A tracker must never stop or slow training: each runs on its own thread behind a queue. A call that fails
is logged once per tracker, retried in the background with backoff, and counted (`tracker/<name>/errors`
and `tracker/<name>/dropped` in the next step's metrics); a tracker that cannot start is tried again
before each later call. A tracker whose library is not installed is a config error at start
(shared/cli.check_trackers). Only rank 0 tracks.

Resume: out_dir/trackers.json keeps each tracker's run id and the last step it took. A resumed learner
continues the same tracker run, sends the steps of metrics.jsonl the tracker never got (a crash between
the checkpoint and the tracker), and skips the ones it has: a step is logged once. A step trained again
after falling back to an older checkpoint keeps the tracker's first record of it (metrics.jsonl has the
new one); W&B would refuse a step that goes back anyway.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Any

from shared.config import TandemConfig
from shared.files import write_atomic

STATE_FILE = "trackers.json"
EVALUATIONS_FILE = "evaluations.jsonl"
SAMPLE_COLUMNS = (
    "step", "version", "group", "prompt", "completion", "reward", "rewards", "advantage", "tokens",
    "model_tokens", "turns", "finish_reason",
)  # fmt: skip
_ATTEMPTS = 5  # a call that fails this many times is dropped (counted): a tracker down for good must not
_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # hold the queue; the next call tries again
_QUEUE_MAX = 10_000


class Tracker:
    """One library's run. `start` returns the id a resumed learner continues it with."""

    name = ""

    def __init__(self, cfg: TandemConfig, out: Path):
        self.cfg, self.settings, self.out = cfg, cfg.learner.trackers, out

    def start(self, run_id: str | None, config: dict) -> str:
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float], samples: list[dict] | None) -> None:
        raise NotImplementedError

    def finish(self, summary: dict) -> None:
        raise NotImplementedError


class _RowTracker(Tracker):
    """W&B and Trackio: a step is one row of metrics, the samples a Table of the library (`self.lib`)
    in it, logged to `self.run`."""

    def log(self, step, metrics, samples):
        row: dict[str, Any] = dict(metrics)
        if samples:
            row["samples"] = self.lib.Table(columns=list(SAMPLE_COLUMNS), data=_table_data(samples))
        self.run.log(row, step=step)


class WandbTracker(_RowTracker):
    name = "wandb"

    def start(self, run_id, config):
        import wandb

        s = self.settings
        self.lib = wandb
        self.run = wandb.init(
            project=s.project, entity=s.wandb_entity, name=s.run_name, tags=s.tags or None, config=config,
            id=run_id, resume="allow", dir=str(self.out), mode=s.wandb_mode,
        )  # fmt: skip
        return self.run.id

    def finish(self, summary):
        self.run.summary.update(summary)
        self.run.finish()


class TrackioTracker(_RowTracker):
    """Trackio resumes a run by its name: the id kept is the name."""

    name = "trackio"

    def start(self, run_id, config):
        if self.settings.trackio_dir:  # read when trackio is imported
            os.environ["TRACKIO_DIR"] = self.settings.trackio_dir
        import trackio

        s = self.settings
        self.lib = trackio
        self.run = trackio.init(
            project=s.project, name=run_id or s.run_name, config=config, resume="allow", embed=False
        )
        return self.run.name

    def finish(self, summary):
        """Trackio has no run summary: its numbers go into the last step's row as summary/<key>."""
        numbers = _scalars(summary)
        if numbers and isinstance(summary.get("step"), int):
            self.run.log({f"summary/{k}": v for k, v in numbers.items()}, step=summary["step"])
        self.run.finish()


class MlflowTracker(Tracker):
    """Through MlflowClient (no global active run): the config as params and as config.json, metrics by
    step, each samples table as an artifact samples/step_NNNNNN.json, the summary as run_summary.json."""

    name = "mlflow"

    def start(self, run_id, config):
        from mlflow.tracking import MlflowClient

        s = self.settings
        self.client = MlflowClient(tracking_uri=s.mlflow_tracking_uri)
        if run_id is not None:
            self.run_id = self.client.get_run(run_id).info.run_id
            return self.run_id
        exp = self.client.get_experiment_by_name(s.project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(s.project)
        run = self.client.create_run(exp_id, run_name=s.run_name, tags=dict.fromkeys(s.tags, "true"))
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
        for i in range(0, len(params), 100):  # the store's limit per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_dict(self.run_id, config, "config.json")
        return self.run_id

    def log(self, step, metrics, samples):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_name(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])
        if samples:
            table = {
                "columns": list(SAMPLE_COLUMNS),
                "data": _table_data(samples),
            }
            self.client.log_dict(self.run_id, table, f"samples/step_{step:06d}.json")

    def finish(self, summary):
        self.client.log_dict(self.run_id, summary, "run_summary.json")
        self.client.set_terminated(self.run_id)


def mlflow_name(key: str) -> str:
    """MLflow takes only letters, digits and `_-. :/` in a metric's name: the others become '_'
    (eval/pass@1_greedy -> eval/pass_1_greedy)."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key)


KINDS: dict[str, type[Tracker]] = {t.name: t for t in (WandbTracker, TrackioTracker, MlflowTracker)}


def _table_data(samples: list[dict]) -> list[list]:
    """The rows of a samples table in SAMPLE_COLUMNS' order, as cells the three libraries all take:
    numbers and strings (a dict as its JSON)."""
    return [[json.dumps(v, sort_keys=True) if isinstance(v, dict) else v for v in map(r.get, SAMPLE_COLUMNS)]
            for r in samples]  # fmt: skip


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            flat |= _flatten(v, f"{prefix}{k}.")
        else:
            flat[f"{prefix}{k}"] = v
    return flat


class _Worker:
    """One tracker on its own thread: calls run in order; a failing one is retried with backoff, then
    dropped; nothing here ever raises into the training loop."""

    def __init__(self, tracker: Tracker, book: Bookkeeping, log):
        self.tracker, self.book, self.log = tracker, book, log
        self.calls: queue.Queue = queue.Queue(maxsize=_QUEUE_MAX)
        self.errors = self.dropped = 0
        self.started = False
        self._reported = False
        self.thread = threading.Thread(target=self._run, name=f"tracker-{tracker.name}", daemon=True)
        self.thread.start()

    def put(self, kind: str, *args) -> None:
        try:
            self.calls.put_nowait((kind, args))
        except queue.Full:  # the tracker has been failing for a long while: its backlog is not kept
            self.dropped += 1

    def _run(self) -> None:
        while True:
            kind, args = self.calls.get()
            if kind == "stop":
                return
            for attempt in range(_ATTEMPTS):
                try:
                    self._call(kind, args)
                    break
                except Exception as e:  # noqa: BLE001 (whatever the library raises: counted, never fatal)
                    self.errors += 1
                    if not self._reported:
                        self._reported = True
                        self.log(
                            f"tracker {self.tracker.name}: {type(e).__name__}: {e} (training goes on; the "
                            "tracker is retried in the background, its failures counted in "
                            f"tracker/{self.tracker.name}/errors)"
                        )
                    if attempt + 1 < _ATTEMPTS:
                        time.sleep(_BACKOFF_S[attempt])
            else:
                self.dropped += 1

    def _call(self, kind: str, args: tuple) -> None:
        name = self.tracker.name
        if kind != "start" and not self.started:  # a start that failed is tried again first
            self._call("start", self.start_args)
        if kind == "start":
            self.start_args = args
            run_id = self.tracker.start(self.book.run_id(name), *args)
            self.book.set(name, id=run_id)
            self.started = True
            self.log(f"tracker {name}: run {run_id}")
        elif kind == "log":
            step, metrics, samples, evals, merge = args
            last = self.book.step(name)
            if merge:  # evaluations after the last step: into its row (W&B takes no step that goes back)
                step = last
            if step > last or merge:  # a step the tracker has is not sent again
                self.tracker.log(step, metrics, samples)
                self.book.set(name, step=step, evals=max(evals, self.book.get(name, "evals", 0)))
        elif kind == "finish":
            self.tracker.finish(*args)

    def join(self, timeout: float) -> bool:
        self.put("stop")
        self.thread.join(timeout)
        return not self.thread.is_alive()


class Bookkeeping:
    """out_dir/trackers.json: each tracker's run id, the last step it took, and how many lines of
    evaluations.jsonl it has. Written by the workers' threads."""

    def __init__(self, out: Path):
        self.path = out / STATE_FILE
        self.lock = threading.Lock()
        try:
            self.state: dict[str, dict] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.state = {}

    def get(self, name: str, key: str, default=None):
        with self.lock:
            return self.state.get(name, {}).get(key, default)

    def run_id(self, name: str) -> str | None:
        return self.get(name, "id")

    def step(self, name: str) -> int:
        return self.get(name, "step", 0)

    def set(self, name: str, **fields) -> None:
        """Kept in memory first: a file that cannot be written (a full disk) costs a resume's exactness,
        never a duplicate now (a raise here would retry a call the tracker already took)."""
        with self.lock:
            self.state.setdefault(name, {}).update(fields)
            with contextlib.suppress(OSError):
                write_atomic(self.path, json.dumps(self.state, indent=2) + "\n")


class Trackers:
    """The trackers of learner.report_to (TensorBoard excepted: learner/metrics.py writes its local
    files), fed from the training loop."""

    def __init__(self, cfg: TandemConfig, out: Path, log, kinds: dict[str, type[Tracker]] | None = None):
        kinds = KINDS if kinds is None else kinds
        self.cfg, self.out, self.log = cfg, out, log
        self.book = Bookkeeping(out)
        self.every = cfg.learner.trackers.samples_every
        self.rows = cfg.learner.trackers.samples_rows
        names = [n for n in cfg.learner.report_to if n in kinds]
        self.workers = [_Worker(kinds[n](cfg, out), self.book, log) for n in names]
        self._evals_seen = 0  # lines of evaluations.jsonl sent

    def __bool__(self) -> bool:
        return bool(self.workers)

    def start(self, config: dict, step: int) -> None:
        """Start (or continue) each tracker's run; send the steps of metrics.jsonl up to `step`, the one
        resumed from, that a tracker never got (each tracker skips the steps it has)."""
        for w in self.workers:
            w.put("start", config)
        self._evals_seen = max((self.book.get(w.tracker.name, "evals", 0) for w in self.workers), default=0)
        path = self.out / "metrics.jsonl"
        if step and path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:  # truncate_records drops a line cut short; a tracker must not fail a start
                    continue
                if (
                    isinstance(record, dict)
                    and isinstance(record.get("step"), int)
                    and 0 < record["step"] <= step
                ):
                    self._log(record["step"], _scalars(record), None)

    def step(self, step: int, metrics: dict, groups=None, decode=None) -> None:
        """A trained step's metrics, the held-out evaluations written since the last step, and (at step 1
        and every samples_every steps) a table of its trajectories."""
        samples = None
        if groups and decode is not None and (step == 1 or step % self.every == 0):
            from learner.batch import sequences

            try:  # the table is for people: a failure to build it costs the table, not the step
                advantages = sequences(groups, self.cfg.grpo)[1].tolist()
                samples = sample_rows(step, groups, decode, advantages, self.rows)
            except Exception as e:  # noqa: BLE001
                self.log(f"trackers: no samples table at step {step}: {type(e).__name__}: {e}")
        self._log(step, _scalars(metrics) | self._new_evaluations(), samples)

    def metrics(self) -> dict[str, float]:
        """Each tracker's failures so far, for metrics.jsonl."""
        out = {}
        for w in self.workers:
            out[f"tracker/{w.tracker.name}/errors"] = float(w.errors)
            out[f"tracker/{w.tracker.name}/dropped"] = float(w.dropped)
        return out

    def close(self, summary: dict) -> None:
        """The evaluations not yet sent (into the last step's row), the summary, and the end of each run;
        waits at most learner.trackers.flush_s for all of it."""
        if evals := self._new_evaluations():
            self._log(0, evals, None, merge=True)
        for w in self.workers:
            w.put("finish", summary)
        deadline = time.monotonic() + self.cfg.learner.trackers.flush_s
        for w in self.workers:
            if not w.join(max(0.0, deadline - time.monotonic())):
                self.log(
                    f"tracker {w.tracker.name}: still sending after learner.trackers.flush_s; left behind"
                )

    def _log(self, step: int, metrics: dict, samples, merge: bool = False) -> None:
        for w in self.workers:
            w.put("log", step, metrics, samples, self._evals_seen, merge)

    def _new_evaluations(self) -> dict[str, float]:
        """The lines of evaluations.jsonl not yet sent, flattened as eval/<key> (the newest line wins)."""
        try:  # read in the training loop: nothing here may stop a step
            lines = [line for line in (self.out / EVALUATIONS_FILE).read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError):
            return {}
        out: dict[str, float] = {}
        for line in lines[self._evals_seen :]:
            try:
                out |= {f"eval/{k}": v for k, v in _scalars(_flatten(json.loads(line))).items()}
            except ValueError:  # a line cut short by a crash of the evaluation that wrote it
                continue
        self._evals_seen = len(lines)
        return out


def _scalars(record: dict) -> dict[str, float]:
    """The numbers of a metrics record (None, the timestamp and the step itself left out)."""
    skip = {"step", "time"}
    return {
        k: float(v)
        for k, v in record.items()
        if k not in skip and isinstance(v, int | float) and not isinstance(v, bool)
    }


def sample_rows(step: int, groups, decode, advantages, limit: int) -> list[dict]:
    """The first `limit` trajectories of a step's groups, whole groups first: prompt, completion, rewards
    by function, advantage, version, length, finish reason, turns (model turns of an episode)."""
    rows: list[dict] = []
    for gi, g in enumerate(groups):
        prompt = decode(g.prompt_token_ids)
        for ci, c in enumerate(g.completions):
            if len(rows) >= limit:
                return rows
            adv = advantages[gi][ci] if advantages is not None else None
            rows.append({
                "step": step, "version": g.policy_version, "group": g.group_id, "prompt": prompt,
                "completion": c.text, "reward": c.reward, "rewards": dict(c.rewards),
                "advantage": None if adv is None else float(adv), "tokens": len(c.token_ids),
                "model_tokens": c.num_model_tokens, "turns": _turns(c.mask),
                "finish_reason": c.finish_reason,
            })  # fmt: skip
    return rows


def _turns(mask: list[int] | None) -> int:
    """Model turns: the runs of 1s in the mask (a single turn has none)."""
    if mask is None:
        return 1
    return sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))
