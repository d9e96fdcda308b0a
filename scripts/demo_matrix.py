"""The demo over several seeds and backends, side by side: held-out gain, wall clock, and the fraction of
each step's completions truncated at max_new_tokens.

    .venv/bin/python scripts/demo_matrix.py [--seeds 0,1,2] [--backends vllm,hf] [--steps 12]

Runs `scripts/demo.py --seed S --server.backend=B` one after another (each has the machine to itself) and
prints one row per run, then the truncation curves. With the vLLM backend the config's adapter mode is used
(deploy/configs/cpu.toml: merge).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from demo import run_demo  # scripts/, this script's folder, is on the path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--backends", default="vllm,hf")
    p.add_argument("--steps", type=int, default=None, help="default: the config's")
    p.add_argument("--out", default=str(REPO / "runs" / "demo-matrix"), help="a folder per run goes here")
    p.add_argument("overrides", nargs="*", metavar="--section.key=value")
    args, extra = p.parse_known_args()
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for backend in args.backends.split(","):
            run = Path(args.out) / f"{backend}-seed{seed}"
            cmd = [f"--server.backend={backend}", *args.overrides, *extra]
            if args.steps:
                cmd += ["--steps", str(args.steps)]
            print(f"== {backend}, seed {seed} -> {run}", flush=True)
            if (done := run_demo(run, seed, cmd)) is None:
                continue
            summary, metrics = done
            rows.append((backend, seed, summary, [m["completion/truncated"] for m in metrics]))
            gain = 100 * (summary["held_out_accuracy_after"] - summary["held_out_accuracy_before"])
            print(f"   {gain:+.0f} points in {summary['wall_clock_s'] / 60:.1f} min", flush=True)
    print("\nbackend  seed  before  after   gain  wall clock  truncated: first step -> last step")
    for backend, seed, s, trunc in rows:
        before, after = 100 * s["held_out_accuracy_before"], 100 * s["held_out_accuracy_after"]
        print(
            f"{backend:<8} {seed:>4}  {before:5.1f}%  {after:5.1f}%  {after - before:+5.1f}  "
            f"{s['wall_clock_s'] / 60:6.1f} min  {trunc[0]:.2f} -> {trunc[-1]:.2f}"
        )
    print("\ntruncated fraction per step:")
    for backend, seed, _, trunc in rows:
        print(f"{backend:<8} {seed:>4}  " + " ".join(f"{t:.2f}" for t in trunc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
