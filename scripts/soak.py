"""Hours of training under random faults: the CPU stack under a supervisor that restarts what dies, a chaos
schedule drawn from a seed, and at the end the invariants checked from the records on disk.

    .venv/bin/python scripts/soak.py --minutes 60 [--servers 2] [--placement split] [--seed 0]
    .venv/bin/python scripts/soak.py --steps 6 --fault-every 40 --faults learner-kill,server-kill

Runs `--config` (deploy/configs/cpu.toml) as given: one learner and N rollout servers (shards of the
prompts), each server behind a small TCP proxy of this script's own, which is how the network faults
reach the loopback between them. The supervisor restarts a process that exits (the learner always with
--resume), as Compose's `restart:` does. Fault kinds (--faults; each logged with its time and target in
faults.jsonl):

  learner-kill, learner-term   SIGKILL / SIGTERM of the learner (and its DeepSpeed ranks)
  server-kill, server-term     SIGKILL / SIGTERM of a rollout server (and vLLM's processes)
  server-move                  a server stopped and started at another port; the learner is restarted
                               with the new address (as a scheduler re-placing a job would)
  net-delay, net-loss          the proxy delays every chunk, or resets a share of new connections
  net-reset, net-stall         the proxy resets every connection, or holds all traffic, for a while
  disk-full                    the learner's out_dir (a tmpfs; needs root) filled for a while
  slow-reward                  the reward function (the config's, in a worker) sleeps on every call

At the end (the time or the steps reached), the faults stop, everything is brought up, the learner is
stopped at a step boundary and the servers cleanly; then, from groups.jsonl, metrics.jsonl, the
checkpoints and each server's events.jsonl and saved queue: steps consecutive, each with a metrics line,
a checkpoint record and a published version; no group trained twice, no prompt trained twice in an epoch;
no group lost (each group a server produced was trained, dropped by the learner on purpose, or is still
queued); no lease open; the servers' version equal to the learner's. Every few seconds each process's
resident memory and open files, the run folder's size and the queue depth are sampled (resources.jsonl):
the report gives each one's slope per hour over its longest life, and soak.png. --eval N scores the final
policy on N held-out problems, and with --compare-with the adapter of the same step from a fault-free run
of the same seed (`--faults ''`, e.g. alongside). Exit 0 when every invariant holds (and the slopes are
below --max-mib-per-hour).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.net import free_port  # noqa: E402
from harness.procs import Proc, tandem_env  # noqa: E402

KINDS = (
    "learner-kill",
    "learner-term",
    "server-kill",
    "server-term",
    "server-move",
    "net-delay",
    "net-loss",
    "net-reset",
    "net-stall",
    "disk-full",
    "slow-reward",
)
SLOW_REWARD = '''"""The soak's reward: the config's verifier, slowed down while the flag file exists."""
import os, time
from shared.rewards import gsm8k

def verifier(completion, answer, prompt="", metadata=None):
    if os.path.exists({flag!r}):
        time.sleep(float(open({flag!r}).read() or 2))
    return gsm8k(completion, answer, prompt, metadata)
'''


# -- the network between learner and servers ---------------------------------------------------------------
class Proxy:
    """A TCP proxy from `port` to the server's current port, on its own event loop in a thread. Faults:
    `delay` seconds per chunk, a `loss` share of new connections reset, `reset` (every connection cut and
    new ones refused), `stall` (traffic held); each until its deadline."""

    def __init__(self, upstream: int):
        self.upstream, self.port = upstream, free_port()
        self.delay = self.loss = 0.0
        self.reset_until = self.stall_until = self.delay_until = self.loss_until = 0.0
        self._writers: set[asyncio.StreamWriter] = set()
        self._rng = random.Random(self.port)
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        serving = asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self._server = self._loop.run_until_complete(serving)
        started.set()
        self._loop.run_forever()
        self._loop.close()  # (close() stopped it)

    def close(self) -> None:
        """Stop listening and cut every connection (a moved server's old address), then end its loop."""

        async def shut():
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:  # each connection's task: its `finally` aborts both of its sockets
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.sleep(0.1)  # the aborted transports close their sockets on the loop's next turns
            self._loop.stop()

        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(shut()))

    def cut_all(self) -> None:
        """Reset every open connection (RST, as a dropped route or a restarted middlebox does)."""

        def cut():
            for w in list(self._writers):
                _abort(w)

        self._loop.call_soon_threadsafe(cut)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        now = time.time()
        if now < self.reset_until or (now < self.loss_until and self._rng.random() < self.loss):
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            _abort(writer)
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                _abort(w)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, RuntimeError):
            while data := await reader.read(65536):
                while time.time() < self.stall_until:
                    await asyncio.sleep(0.2)
                if time.time() < self.delay_until:
                    await asyncio.sleep(self.delay)
                if time.time() < self.reset_until:
                    break
                writer.write(data)
                await writer.drain()
        _abort(writer)


def _abort(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.transport.abort()


# -- the processes -----------------------------------------------------------------------------------------
@dataclass
class Slot:
    """One process the supervisor keeps running."""

    name: str
    start: callable
    proc: Proc | None = None
    restarts: int = 0
    held: bool = False  # not to be restarted now (a fault in progress, or the end)

    def launch(self) -> None:
        self.proc = self.start()


class Soak:
    def __init__(self, args: argparse.Namespace):
        from shared.config import load_config

        self.args, self.out = args, Path(args.out).resolve()
        self.t0 = time.time()
        self.rng = random.Random(args.seed)
        self.token = secrets.token_hex(16)
        self.env = tandem_env(self.token)
        self.env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
        self.learner_dir = self.out / "learner"
        self.disk = self.mount_disk() if "disk-full" in args.faults else None
        self.server_ports = [free_port() for _ in range(args.servers)]
        self.proxies = [Proxy(p) for p in self.server_ports]
        self.common = [
            f"--data.seed={args.seed}",
            f"--server.seed={args.seed}",
            f"--learner.seed={args.seed}",
            f"--server.num_shards={args.servers}",
            f"--learner.placement={args.placement}",
            *args.overrides,
        ]
        if "slow-reward" in args.faults:
            (self.out / "soak_reward.py").write_text(SLOW_REWARD.format(flag=str(self.out / "slow-reward")))
            self.common.append(f'--reward.functions=["{self.out / "soak_reward.py"}:verifier"]')
        self.cfg = load_config(REPO / args.config, [o[2:] for o in self.common])
        self.servers = [Slot(f"server{i}", lambda i=i: self.start_server(i)) for i in range(args.servers)]
        self.learner = Slot("learner", self.start_learner)
        self.faults = self.out / "faults.jsonl"

    # -- starting -------------------------------------------------------------------------------------
    def mount_disk(self) -> Path | None:
        """The learner's out_dir on a tmpfs, so a fault can fill it without filling this machine's disk."""
        self.learner_dir.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.args.disk_mb}m", "tmpfs", str(self.learner_dir)],
            capture_output=True,
            text=True,
        )
        if r.returncode:
            print(f"disk-full: cannot mount a tmpfs ({r.stderr.strip()}; needs root): that fault is left out")
            self.args.faults.remove("disk-full")
            return None
        return self.learner_dir

    def start_server(self, i: int) -> Proc:
        args = [
            "-m",
            "rollout_server",
            "--config",
            self.args.config,
            *self.common,
            f"--server.port={self.server_ports[i]}",
            f"--server.shard_index={i}",
            f"--server.state_dir={self.out / f'server{i}'}",
        ]
        return Proc(args, self.out / "logs" / f"server{i}.log", self.env)

    def server_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p.port}" for p in self.proxies]

    def start_learner(self) -> Proc:
        urls = self.server_urls()
        args = [
            "-m",
            "learner",
            "--config",
            self.args.config,
            "--resume",
            *self.common,
            f"--learner.steps={self.args.steps or 10**6}",
            f"--learner.out_dir={self.learner_dir}",
            "--learner.server_retry_s=3600",  # a long outage is waited out, as the supervisor restarts
            _servers_flag(urls),
        ]
        return Proc(args, self.out / "logs" / "learner.log", self.env)

    # -- the supervisor ---------------------------------------------------------------------------------
    def supervise(self) -> None:
        """Restart whatever exited (2 s later, as Compose does), unless it is held or the run is done."""
        for slot in [*self.servers, self.learner]:
            if slot.proc is None or slot.proc.alive() or slot.held:
                continue
            code = slot.proc.returncode
            if slot is self.learner and code == 0 and self.finished():
                slot.held = True
                continue
            self.log_event("exit", slot.name, code=code)
            time.sleep(2)
            slot.restarts += 1
            slot.launch()

    def finished(self) -> bool:
        return bool(self.args.steps) and self.last_step() >= self.args.steps

    def last_step(self) -> int:
        steps = [r["step"] for r in _jsonl(self.learner_dir / "metrics.jsonl")]
        return max(steps, default=0)

    def log_event(self, event: str, target: str, **info) -> None:
        rec = {"t": round(time.time() - self.t0, 1), "event": event, "target": target, **info}
        with self.faults.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"[soak {rec['t']:7.1f}s] {event} {target} {info or ''}", flush=True)

    # -- the faults -------------------------------------------------------------------------------------
    def inject(self, kind: str) -> list[tuple[float, callable]]:
        """Start a fault; returns (when, undo) for the ones that last a while."""
        rng, i = self.rng, self.rng.randrange(len(self.servers))
        proxy, server = self.proxies[i], self.servers[i]
        lasting = round(rng.uniform(*self.args.fault_s), 1)
        until = time.time() + lasting
        if kind in ("learner-kill", "learner-term"):
            sig = signal.SIGKILL if kind == "learner-kill" else signal.SIGTERM
            self.log_event(kind, "learner", pid=self.learner.proc.pid)
            self.learner.proc.signal(sig)
            return []
        if kind in ("server-kill", "server-term"):
            sig = signal.SIGKILL if kind == "server-kill" else signal.SIGTERM
            self.log_event(kind, server.name, pid=server.proc.pid)
            server.proc.signal(sig)
            return []
        if kind == "server-move":
            new = free_port()
            self.log_event(kind, server.name, port=new)
            server.held = True
            server.proc.stop()
            self.server_ports[i] = new
            # the learner is told the new address: here the proxy's port is the address it knows, so a new
            # proxy stands for the moved server, the old address stops answering, and the learner is
            # restarted with the new one
            self.proxies[i] = Proxy(new)
            proxy.close()
            server.held = False
            self.learner.proc.stop()
            return []
        self.log_event(kind, server.name if kind.startswith("net") else "learner", seconds=lasting)
        if kind == "net-delay":
            proxy.delay, proxy.delay_until = rng.uniform(0.2, 2.0), until
        elif kind == "net-loss":
            proxy.loss, proxy.loss_until = 0.3, until
        elif kind == "net-reset":
            proxy.reset_until = until
            proxy.cut_all()
        elif kind == "net-stall":
            proxy.stall_until = until
        elif kind == "disk-full":
            ballast = self.disk / "ballast"
            free = shutil.disk_usage(self.disk).free
            with ballast.open("wb") as f, contextlib.suppress(OSError):
                for _ in range(max(0, free // 2**20)):
                    f.write(b"\0" * 2**20)
            return [(until, lambda: ballast.unlink(missing_ok=True))]
        elif kind == "slow-reward":
            flag = self.out / "slow-reward"
            flag.write_text(f"{rng.uniform(1, 4):.1f}")
            return [(until, lambda: flag.unlink(missing_ok=True))]
        return []

    # -- the run ----------------------------------------------------------------------------------------
    def run(self) -> int:
        from harness.procs import wait_healthy

        print(f"soak -> {self.out}\n{self.args.config}, {len(self.servers)} server(s), {self.args.placement}")
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        for slot in self.servers:
            slot.launch()
        for slot, port in zip(self.servers, self.server_ports, strict=True):
            wait_healthy(slot.proc, f"http://127.0.0.1:{port}")
        self.learner.launch()
        sampler = Sampler(self)
        deadline = self.t0 + 60 * self.args.minutes if self.args.minutes else float("inf")
        next_fault = time.time() + self.rng.expovariate(1 / self.args.fault_every)
        undo: list[tuple[float, callable]] = []
        cycle, faulted = self.rng.sample(self.args.faults, len(self.args.faults)), 0
        try:
            while not self.finished() and time.time() < deadline:
                self.supervise()
                sampler.tick()
                now = time.time()
                for when, fn in [u for u in undo if u[0] <= now]:
                    fn()
                    undo.remove((when, fn))
                if self.args.fault_each_step:  # one fault per step reached, the kinds in a shuffled cycle
                    if self.args.faults and self.last_step() > faulted and not self.finished():
                        faulted = self.last_step()
                        undo += self.inject(cycle[(faulted - 1) % len(cycle)])
                elif now >= next_fault and self.args.faults and self.last_step() >= 1:
                    undo += self.inject(self.rng.choice(self.args.faults))
                    next_fault = now + self.rng.expovariate(1 / self.args.fault_every)
                time.sleep(1)
            self.log_event("end of faults", "all", step=self.last_step())
            for _, fn in undo:
                fn()
            for p in self.proxies:
                p.delay_until = p.loss_until = p.reset_until = p.stall_until = 0.0
            self.finish(sampler)
        finally:
            for slot in [self.learner, *self.servers]:
                if slot.proc is not None:
                    slot.proc.stop()
            sampler.tick(force=True)
        return self.report(sampler)

    def finish(self, sampler: Sampler) -> None:
        """Bring everything up and let the learner reach its last step: in --minutes mode the next multiple
        of --stop-every (SIGTERM: it finishes its step and exits 0, and is started again with that many
        steps), so a fault-free run of the same seed has kept an adapter of that step to compare with.
        Then stop the servers cleanly."""
        if self.args.minutes:
            every = self.args.stop_every
            self.args.steps = (self.last_step() // every + 1) * every
            self.log_event("stop", "learner", at_step=self.args.steps)
            self.learner.proc.signal(signal.SIGTERM)  # once: a second signal would abandon its step
        while not self.finished():
            self.supervise()
            sampler.tick()
            time.sleep(1)
        while self.learner.proc.alive():
            time.sleep(1)
        self.learner.held = True
        self.final_health = {}
        for slot, port in zip(self.servers, self.server_ports, strict=True):
            with contextlib.suppress(Exception):
                import httpx

                self.final_health[slot.name] = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
            slot.held = True
            slot.proc.stop(timeout=120)
        if self.args.eval:
            newest = max(int(p.name[1:]) for p in (self.learner_dir / "adapters").glob("v*"))
            folders = [self.learner_dir / "adapters" / f"v{newest}"]
            if self.args.compare_with:  # the fault-free run's adapter of the same step
                folders.append(Path(self.args.compare_with) / "learner" / "adapters" / f"v{self.last_step()}")
            self.accuracy = dict(zip(["soak", "fault-free"], self.evaluate(folders), strict=False))

    def evaluate(self, folders: list[Path]) -> list[float]:
        """Held-out greedy accuracy of each adapter folder, on one fresh server (published as v1, v2...)."""
        from harness.procs import start_server
        from learner.client import RolloutClient
        from learner.evaluate import evaluate

        port, where = free_port(), self.out / "eval"
        missing = [str(f) for f in folders if not f.is_dir()]
        if missing:
            raise SystemExit(
                f"--eval: no adapter at {', '.join(missing)} (a --compare-with run stopped sooner?)"
            )
        proc, url = start_server(
            self.args.config,
            [*self.common, f"--server.state_dir={where}"],
            port,
            self.out / "logs" / f"{where.name}.log",
            self.env,
        )
        try:
            client, scores = RolloutClient(url, token=self.token), []
            for version, folder in enumerate(folders, 1):
                client.publish(version, folder)
                scores.append(evaluate(client, self.cfg, version, self.args.eval)["pass@1_greedy"])
                print(f"held-out accuracy of {folder}: {100 * scores[-1]:.1f}% ({self.args.eval} problems)")
            return scores
        finally:
            proc.stop()

    def report(self, sampler: Sampler) -> int:
        audit = Audit(self.learner_dir, [self.out / s.name for s in self.servers], self.final_health).check()
        faults = [r["event"] for r in _jsonl(self.faults) if r["event"] in KINDS]
        by_kind = {k: faults.count(k) for k in KINDS if k in faults}
        slopes = sampler.slopes()
        report = {
            "config": self.args.config,
            "servers": len(self.servers),
            "placement": self.args.placement,
            "seed": self.args.seed,
            "minutes": round((time.time() - self.t0) / 60, 1),
            "steps": self.last_step(),
            "faults": by_kind,
            "restarts": {s.name: s.restarts for s in [self.learner, *self.servers]},
            **audit,
            "slopes_per_hour": slopes,
            "held_out_accuracy": getattr(self, "accuracy", None),
        }
        (self.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        sampler.plot(self.out / "soak.png")
        print(f"\n=== soak report ({self.out / 'report.json'}) ===\n{json.dumps(report, indent=2)}")
        leaks = {k: v for k, v in slopes.items() if k.endswith("rss_mib") and v > self.args.max_mib_per_hour}
        failed = audit["violations"] or leaks
        if leaks:
            print(f"FAIL: resident memory grows faster than {self.args.max_mib_per_hour} MiB/h: {leaks}")
        for v in audit["violations"]:
            print(f"FAIL: {v}")
        print("ok: every invariant holds" if not failed else "")
        return 1 if failed else 0


def _servers_flag(urls: list[str]) -> str:
    return f"--learner.server_urls={json.dumps(urls)}"


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


# -- resources -------------------------------------------------------------------------------------------
class Sampler:
    """Every `every` seconds: resident memory and open files of each process (by role and name), the run
    folder's size, each server's queue depth; to resources.jsonl."""

    def __init__(self, soak: Soak, every: float = 5.0):
        self.soak, self.every, self.last = soak, every, 0.0
        self.min_life_min = soak.args.min_life_min
        self.path = soak.out / "resources.jsonl"

    def tick(self, force: bool = False) -> None:
        import httpx
        import psutil

        now = time.time()
        if not force and now - self.last < self.every:
            return
        self.last = now
        procs = {}
        for slot in [*self.soak.servers, self.soak.learner]:
            if slot.proc is None or not slot.proc.alive():
                continue
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(slot.proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        key = f"{slot.name}/{p.name()[:24]}/{p.pid}"
                        procs[key] = [round(p.memory_info().rss / 2**20, 1), p.num_fds()]
        depth = {}
        for slot, port in zip(self.soak.servers, self.soak.server_ports, strict=True):
            with contextlib.suppress(Exception):
                h = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                depth[slot.name] = h.get("queue_depth")
        size = sum(
            f.stat().st_size
            for f in self.soak.out.rglob("*")
            if f.is_file() and not f.is_symlink() and f.name != "ballast"  # disk-full's, not the run's
        )
        rec = {"t": round(now - self.soak.t0, 1), "procs": procs, "run_mib": round(size / 2**20, 1)}
        with self.path.open("a") as f:
            f.write(json.dumps({**rec, "queue": depth}) + "\n")

    def series(self) -> dict[str, list[tuple[float, float, float]]]:
        """(t, rss, fds) of each process life, keyed role/name/pid."""
        out: dict[str, list] = {}
        for rec in _jsonl(self.path):
            for key, (rss, fds) in rec["procs"].items():
                out.setdefault(key, []).append((rec["t"], rss, fds))
        return out

    def slopes(self) -> dict[str, float]:
        """Per hour, over the longest life of each role/name if it lasted --min-life-min (its first fifth
        left out: warm-up): MiB of resident memory and open files; and the run folder's MiB."""
        best: dict[str, list] = {}
        for key, points in self.series().items():
            role = key.rsplit("/", 1)[0]
            if len(points) > len(best.get(role, [])):
                best[role] = points
        out = {}
        for role, points in sorted(best.items()):
            pts = points[len(points) // 5 :]
            if len(pts) < 4 or pts[-1][0] - pts[0][0] < 60 * self.min_life_min:
                continue  # warm-up is most of a short life: its slope says nothing about hours
            out[f"{role} rss_mib"] = round(_slope([(t, r) for t, r, _ in pts]) * 3600, 1)
            out[f"{role} fds"] = round(_slope([(t, f) for t, _, f in pts]) * 3600, 1)
            out[f"{role} minutes"] = round((pts[-1][0] - pts[0][0]) / 60, 1)
        sizes = [(r["t"], r["run_mib"]) for r in _jsonl(self.path)]
        if len(sizes) >= 4:
            out["run folder mib"] = round(_slope(sizes) * 3600, 1)
        return out

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
        series = {k: v for k, v in sorted(self.series().items()) if max(r for _, r, _ in v) >= 50}
        colors = {role: f"C{i}" for i, role in enumerate(sorted({k.rsplit("/", 1)[0] for k in series}))}
        for key, points in series.items():
            role = key.rsplit("/", 1)[0]
            t = [p[0] / 60 for p in points]
            ax1.plot(t, [p[1] for p in points], lw=1, color=colors[role], label=role)
        handles, labels = ax1.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax1.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left")
        ax1.set_ylabel("resident MiB (each life)")
        sizes = [(r["t"] / 60, r["run_mib"]) for r in _jsonl(self.path)]
        ax2.plot([s[0] for s in sizes], [s[1] for s in sizes], color="k", label="run folder MiB")
        for r in _jsonl(self.soak.faults):
            if r["event"] in KINDS:
                ax1.axvline(r["t"] / 60, color="r", alpha=0.2, lw=0.8)
        ax2.set_xlabel("minutes")
        ax2.set_ylabel("run folder MiB")
        fig.suptitle("soak: resident memory per process (red: faults), and disk")
        fig.tight_layout()
        fig.savefig(path, dpi=110)


def _slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else 0.0


# -- the invariants -----------------------------------------------------------------------------------------
_GROUP = re.compile(r"^(?P<prompt>.+)-e(?P<epoch>\d+)-[0-9a-f]{12}$")


class Audit:
    """The invariants, from the records on disk."""

    def __init__(self, learner: Path, servers: list[Path], health: dict[str, dict]):
        self.learner, self.servers, self.health = learner, servers, health

    def check(self) -> dict:
        v: list[str] = []
        trained_recs = _jsonl(self.learner / "groups.jsonl")
        steps = [r["step"] for r in trained_recs]
        if steps != list(range(1, len(steps) + 1)):
            v.append(f"groups.jsonl steps are not 1..{len(steps)} once each: {_runs(steps)}")
        metric_steps = [r["step"] for r in _jsonl(self.learner / "metrics.jsonl")]
        if metric_steps != steps:
            v.append(f"metrics.jsonl steps {_runs(metric_steps)} differ from groups.jsonl's {_runs(steps)}")
        trained = [g["group_id"] for r in trained_recs for g in r["groups"]]
        twice = len(trained) - len(set(trained))
        if twice:
            v.append(f"{twice} group(s) trained twice")
        per_epoch = [(m["prompt"], m["epoch"]) for g in trained if (m := _GROUP.match(g))]
        prompt_twice = len(per_epoch) - len(set(per_epoch))
        if prompt_twice:
            v.append(f"{prompt_twice} prompt(s) trained twice in one epoch")

        produced, acked, leases, settled, publishes = set(), set(), {}, set(), []
        queued = set()
        for s in self.servers:
            events = _jsonl(s / "events.jsonl")
            produced |= {e["group_id"] for e in events if e["event"] == "group"}
            leases.update({e["lease_id"]: e["group_ids"] for e in events if e["event"] == "lease"})
            for e in events:
                if e["event"] == "ack" and e.get("acked"):
                    acked |= set(leases.get(e["lease_id"], []))
                if e["event"] in ("ack", "release"):
                    settled.add(e["lease_id"])
                if e["event"] == "publish":
                    publishes.append(e["version"])
            queued |= _queued(s / "queue.jsonl")
        unknown = set(trained) - produced
        if unknown:
            v.append(f"{len(unknown)} trained group(s) no server produced: {sorted(unknown)[:3]}")
        lost = produced - set(trained) - acked - queued
        if lost:
            v.append(f"{len(lost)} group(s) produced and then lost (never trained, dropped or queued)")
        open_leases = {k: h.get("leased") for k, h in self.health.items() if h.get("leased")}
        if open_leases:
            v.append(f"leases left open at the end: {open_leases}")
        final = self._final_version()
        versions = {k: h.get("policy_version") for k, h in self.health.items()}
        if final is not None and any(x != final for x in versions.values()):
            v.append(f"the servers serve {versions}, the learner ended at v{final}")
        if steps and final is not None and final < steps[-1]:
            v.append(f"the learner's version v{final} is below its step {steps[-1]}")
        latest = self.learner / "checkpoints" / "latest"
        if steps and (not latest.is_file() or latest.read_text().strip() != f"step-{steps[-1]}"):
            v.append(f"the newest checkpoint is not step {steps[-1]}")
        return {
            "groups": {
                "produced": len(produced),
                "trained": len(set(trained)),
                "dropped_by_learner": len(acked - set(trained)),
                "queued_at_end": len(queued),
                "trained_twice": twice,
                "lost": len(lost),
            },
            "final_version": final,
            "violations": v,
        }

    def _final_version(self) -> int | None:
        path = self.learner / "run_summary.json"
        if path.is_file():
            return json.loads(path.read_text()).get("policy_version")
        return None


def _queued(path: Path) -> set[str]:
    """The ids of the groups a stopped server's queue journal holds, waiting or leased."""
    from rollout_server.production.queue import Journal

    if not path.is_file():
        return set()
    model = json.loads(path.read_text().split("\n", 1)[0])["model"]
    ready, leases, _ = Journal(path, model).replay()
    return {g.group_id for g in ready} | {g.group_id for gs in leases.values() for g in gs}


def _runs(steps: list[int]) -> str:
    return f"{steps[:3]}...{steps[-3:]} ({len(steps)})" if len(steps) > 6 else str(steps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="deploy/configs/cpu.toml")
    how_long = p.add_mutually_exclusive_group(required=True)
    how_long.add_argument("--minutes", type=float, help="run this long, then stop at a step boundary")
    how_long.add_argument("--steps", type=int, help="run until the learner has trained this many steps")
    p.add_argument("--servers", type=int, default=1, help="rollout servers (shards of the prompts)")
    p.add_argument("--placement", choices=["timeslice", "split"], default="timeslice")
    p.add_argument("--seed", type=int, default=0, help="the chaos schedule's, the data order's, sampling's")
    p.add_argument("--faults", default=",".join(KINDS), help=f"comma-separated kinds, of: {', '.join(KINDS)}")
    p.add_argument("--fault-every", type=float, default=180.0, help="mean seconds between faults")
    p.add_argument(
        "--fault-each-step",
        action="store_true",
        help="instead: one fault each time the learner reaches a new step, every kind in turn (tests)",
    )
    p.add_argument(
        "--fault-s", type=float, nargs=2, default=(20.0, 90.0), help="how long a lasting fault lasts (range)"
    )
    p.add_argument("--disk-mb", type=int, default=3000, help="size of the learner's tmpfs (disk-full)")
    p.add_argument("--eval", type=int, default=0, help="held-out problems to score the final policy on")
    p.add_argument(
        "--compare-with",
        default=None,
        metavar="DIR",
        help="with --eval: a fault-free run's folder (this script, --faults '', the same seed), run before "
        "or alongside; its adapter of the step this run ends at is scored beside this run's",
    )
    p.add_argument("--stop-every", type=int, default=10, help="--minutes: end at a multiple of this step")
    p.add_argument("--max-mib-per-hour", type=float, default=200.0, help="fail above this RSS slope")
    p.add_argument(
        "--min-life-min", type=float, default=10.0, help="judge the slope of processes that lived this long"
    )
    p.add_argument("--out", default=None, help="soak folder (default: runs/soak-<time>)")
    p.add_argument("overrides", nargs="*", metavar="--section.key=value", help="config overrides")
    args, extra = p.parse_known_args()
    args.overrides = [*args.overrides, *extra]
    bad = [o for o in args.overrides if not (o.startswith("--") and "=" in o)]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides look like --section.key=value)")
    args.faults = [k for k in args.faults.split(",") if k]
    unknown = [k for k in args.faults if k not in KINDS]
    if unknown:
        p.error(f"--faults: unknown kind(s) {', '.join(unknown)}; the kinds are {', '.join(KINDS)}")
    if args.servers < 1:
        p.error("--servers must be at least 1")
    args.out = args.out or str(REPO / "runs" / time.strftime("soak-%Y%m%d-%H%M%S"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: its processes are stopped too
    Path(args.out).mkdir(parents=True, exist_ok=True)
    soak = Soak(args)
    try:
        code = soak.run()
    finally:
        if soak.disk is not None:
            subprocess.run(["umount", str(soak.disk)], capture_output=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
