"""A vLLM server's start, first group and stop, and a learner's exit: as shipped against the plain path,
side by side in one run.

    .venv/bin/python scripts/bench_start_stop.py [--rounds 2] [--set section.key=value ...]

Each round starts the rollout server (deploy/configs/cpu.toml, a fresh state folder) three ways, in turn:
  plain, cold  vLLM compiles its sampler's log-prob functions at the first request, into a compile cache of
               its own (empty: a fresh machine or container), and the process ends with the interpreter's
               teardown (tandem before docs/benchmarks.md §19)
  plain, warm  the same, with the compile cache the cold run filled
  tandem       as shipped: nothing compiled (server.vllm.enforce_eager), the teardown skipped
and times, for each: launch to a healthy /health, the first scored group (pulled at once), and SIGTERM to
the process's end. Then a learner (one step against the shipped server), plain and as shipped: its last
line to its exit. Prints each round and the medians; the ratio is the plain (warm) path's start-to-end time
against the shipped one's. Numbers and the machine: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.net import free_port  # noqa: E402
from harness.procs import Proc, tandem_env, wait_healthy  # noqa: E402
from harness.runs import SMALL_LEARNER, SMALL_RUN  # noqa: E402
from learner.client import RolloutClient  # noqa: E402

TOKEN = "bench-token"
# The plain path: the server's main() with vLLM left to compile, and an ordinary exit (no quick_exit).
PLAIN_SERVER = (
    "import sys; import rollout_server.engines.vllm as v; v.no_torch_compile = lambda: None; "
    "from rollout_server.__main__ import main; sys.exit(main())"
)
PLAIN_LEARNER = "import sys; from learner.__main__ import main; sys.exit(main())"


def one_server(how: str, work: Path, cache: Path, extra: list[str]) -> dict:
    port = free_port()
    state = work / f"state-{how}-{time.monotonic_ns()}"
    args = ["--config", "deploy/configs/cpu.toml", f"--server.port={port}", f"--server.state_dir={state}"]
    args += [*SMALL_RUN, *extra]
    launch = ["-m", "rollout_server"] if how == "tandem" else ["-c", PLAIN_SERVER]
    env = tandem_env(TOKEN, OMP_NUM_THREADS="2", TORCHINDUCTOR_CACHE_DIR=str(cache))
    t0 = time.monotonic()
    proc = Proc([*launch, *args], work / f"server-{how}.log", env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout=600)
    healthy = time.monotonic()
    client = RolloutClient(url, token=TOKEN)
    pulled = client.pull(1, wait_s=300)
    assert pulled.groups, f"{how}: no group within 300 s"
    first = time.monotonic()
    client.close()
    proc.stop(timeout=60)
    end = time.monotonic()
    return {"healthy": healthy - t0, "first": first - healthy, "stop": end - first, "total": end - t0}


def one_learner(how: str, work: Path, extra: list[str]) -> float:
    """A learner's exit: its last line to its end, one step against a shipped server."""
    port, work = free_port(), work / f"learner-{how}-{time.monotonic_ns()}"
    args = ["--config", "deploy/configs/cpu.toml", f"--server.port={port}", f"--server.state_dir={work}"]
    env = tandem_env(TOKEN, OMP_NUM_THREADS="2")
    server = Proc(["-m", "rollout_server", *args, *SMALL_RUN, *extra], work.with_suffix(".log"), env=env)
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}", timeout=600)
        launch = ["-m", "learner"] if how == "tandem" else ["-c", PLAIN_LEARNER]
        cmd = [sys.executable, *launch, "--config", "deploy/configs/cpu.toml", *SMALL_RUN, *extra]
        cmd += [f"--learner.server_urls=http://127.0.0.1:{port}", f"--learner.out_dir={work / 'run'}"]
        cmd += [*SMALL_LEARNER, "--learner.steps=1"]
        env = tandem_env(TOKEN, OMP_NUM_THREADS="1")
        learner = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        last, lines = time.monotonic(), []
        for line in learner.stdout:
            if line.strip():
                last = time.monotonic()
                lines.append(line.decode(errors="replace"))
        assert learner.wait(timeout=600) == 0, f"{how} learner failed:\n" + "".join(lines[-20:])
        return time.monotonic() - last
    finally:
        server.stop(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--rounds", type=int, default=2, help="rounds of the three starts and two learners")
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="a config override (repeatable)")
    args = p.parse_args(argv)
    extra = [f"--{kv}" for kv in args.set]
    rows: dict[str, list[dict]] = {"plain, cold": [], "plain, warm": [], "tandem": []}
    exits: dict[str, list[float]] = {"plain": [], "tandem": []}
    with tempfile.TemporaryDirectory(prefix="tandem-start-stop-") as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            cache = work / f"compile-cache-{r}"  # empty for the cold run, filled for the warm one
            for how, label in (("plain", "plain, cold"), ("plain", "plain, warm"), ("tandem", "tandem")):
                row = one_server(how, work, cache, extra)
                rows[label].append(row)
                print(
                    f"round {r + 1} {label:<12} healthy {row['healthy']:5.1f} s | first group "
                    f"{row['first']:5.1f} s | stop {row['stop']:4.1f} s | total {row['total']:5.1f} s",
                    flush=True,
                )
            for how in ("plain", "tandem"):
                exits[how].append(one_learner(how, work, extra))
                print(f"round {r + 1} learner {how:<7} last line to exit {exits[how][-1]:4.2f} s", flush=True)
    print("\nmedians")
    med = {label: {k: statistics.median(x[k] for x in xs) for k in xs[0]} for label, xs in rows.items()}
    for label, m in med.items():
        print(
            f"  server {label:<12} healthy {m['healthy']:5.1f} s | first group {m['first']:5.1f} s | "
            f"stop {m['stop']:4.1f} s | total {m['total']:5.1f} s"
        )
    for how, xs in exits.items():
        print(f"  learner {how:<7} last line to exit {statistics.median(xs):4.2f} s")
    warm, cold, ours = med["plain, warm"]["total"], med["plain, cold"]["total"], med["tandem"]["total"]
    print(
        f"\nserver start to end: plain (warm) / tandem = {warm / ours:.2f}x, plain (cold) / tandem = "
        f"{cold / ours:.2f}x; saved {warm - ours:.1f} s (warm), {cold - ours:.1f} s (cold) a server"
    )
    saved = statistics.median(exits["plain"]) - statistics.median(exits["tandem"])
    print(f"learner exit: saved {saved:.2f} s a process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
