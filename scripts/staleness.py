"""Off-policy corrections under staleness: held-out accuracy after a fixed number of steps when every group
is exactly k versions old, for each correction, side by side.

    .venv/bin/python scripts/staleness.py [--ks 0,2,4] [--methods plain,tis,gspo] [--seeds 0,1]

Each run is `scripts/demo.py` (deploy/configs/cpu.toml, time-sliced, the demo's bf16 choices) with
`learner.lag_steps = k`: the learner trains step s on the groups it pulled k steps before, so they were
sampled by version max(0, s-1-k) — staleness fixed by construction, not by how fast either side runs
(split placement would give a mix of lags that depends on timing). Methods:

  plain   GRPO as time-sliced runs have it: π_old = the sampler's log-probs, PPO clip, dual clip 2
  tis     π_old recomputed by the learner, each token weighted by min(π_old / π_sampler, 2), no gradient.
          With one optimizer step per batch the proximal policy of AReaL's decoupled PPO *is* this π_old,
          so this row is decoupled PPO too (grpo.py says why). The default where groups are stale
  tis-seq the same with one weight per sequence (the product of its tokens' ratios, truncated at 2)
  gspo    GSPO's sequence ratio against the sampler's log-probs, clipped at GSPO's 3e-4 / 4e-4
  cispo   CISPO: the clipped ratio as a stop-gradient weight on log π

A run whose summary.json is there is not run again (the experiment resumes). Prints a table of held-out
accuracy (mean of the seeds, and each), the recompute's cost (training seconds a step against plain at the
same k), the IS weights' mean and the truncated fraction; writes results.json and a plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from demo import run_demo  # scripts/, this script's folder, is on the path

REPO = Path(__file__).resolve().parents[1]
RECOMPUTE_TIS = ["--grpo.old_logprobs=recompute", "--grpo.tis_cap=2"]
SAMPLER = ["--grpo.old_logprobs=sampler"]  # said outright: with lag_steps > 0, TIS is the default
METHODS = {
    "plain": SAMPLER,
    "tis": RECOMPUTE_TIS,
    "tis-seq": [*RECOMPUTE_TIS, "--grpo.tis_level=sequence"],
    "gspo": [*SAMPLER, "--grpo.ratio_level=sequence"],
    "cispo": [*SAMPLER, "--grpo.loss=cispo"],
}


def _mean(values: list[float]) -> float:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else float("nan")


def _row(method: str, k: int, runs: list[tuple[int, dict, list[dict]]]) -> dict:
    """One (method, k) cell from its runs: accuracy per seed and the step metrics' means (step 1 left out
    of the time: it builds the engine's caches, and pulls k + 1 batches)."""
    later = [m for _, _, metrics in runs for m in metrics if m["step"] > 1]
    return {
        "method": method,
        "k": k,
        "after": {seed: s["held_out_accuracy_after"] for seed, s, _ in runs},
        "before": {seed: s["held_out_accuracy_before"] for seed, s, _ in runs},
        "train_s": _mean([m["perf/train_s"] for m in later]),
        "version_lag": _mean([m["policy/version_lag"] for _, _, ms in runs for m in ms]),
        "clipfrac": _mean([m.get("ratio/clipfrac") for m in later]),
        "is_weight_mean": _mean([m.get("is/weight_mean") for m in later]),
        "is_truncated": _mean([m.get("is/truncated") for m in later]),
        "reward_last5": _mean([m["reward/mean"] for _, _, ms in runs for m in ms[-5:]]),
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    ks = sorted({r["k"] for r in rows})
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, method in enumerate(methods):
        for j, k in enumerate(ks):
            row = next((r for r in rows if r["method"] == method and r["k"] == k), None)
            if row is None:
                continue
            x = j + (i - (len(methods) - 1) / 2) * width
            accs = [100 * a for a in row["after"].values()]
            ax.bar(x, _mean(accs), width, color=f"C{i}", label=method if j == 0 else None)
            ax.plot([x] * len(accs), accs, "k.", ms=6)
    before = [100 * b for r in rows for b in r["before"].values()]
    ax.axhline(_mean(before), color="#999999", ls="--", lw=1, label="base model")
    ax.set_xticks(range(len(ks)), [f"k = {k}" for k in ks])
    ax.set(
        xlabel="versions stale (learner.lag_steps)",
        ylabel="held-out accuracy after training (%)",
        title="Off-policy corrections under staleness (bars: mean of seeds, dots: each)",
        ylim=(0, 100),
    )
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ks", default="0,2,4", help="staleness values, comma-separated")
    p.add_argument("--methods", default="plain,tis,gspo", help=f"any of {', '.join(METHODS)}")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=None, help="default: the demo's (24 in bf16)")
    p.add_argument("--out", default=str(REPO / "runs" / "staleness"), help="a folder per run goes here")
    p.add_argument("--plot", default=None, help="the plot's path (default: <out>/staleness.png)")
    p.add_argument("overrides", nargs="*", metavar="--section.key=value", help="for every run")
    args, extra = p.parse_known_args()
    methods = args.methods.split(",")
    if unknown := [m for m in methods if m not in METHODS]:
        p.error(f"--methods: unknown {', '.join(unknown)} (choose from {', '.join(METHODS)})")
    ks, seeds, out = (
        [int(k) for k in args.ks.split(",")],
        [int(s) for s in args.seeds.split(",")],
        Path(args.out),
    )

    rows = []
    for k in ks:
        for method in methods:
            runs = []
            for seed in seeds:
                run = out / f"k{k}-{method}-seed{seed}"
                if (run / "summary.json").is_file():
                    metrics = [
                        json.loads(x) for x in (run / "learner" / "metrics.jsonl").read_text().splitlines()
                    ]
                    done = json.loads((run / "summary.json").read_text()), metrics
                else:
                    print(f"== k={k} {method} seed {seed} -> {run}", flush=True)
                    cmd = [f"--learner.lag_steps={k}", *METHODS[method], *args.overrides, *extra]
                    done = run_demo(run, seed, cmd + (["--steps", str(args.steps)] if args.steps else []))
                    if done is None:
                        continue
                    print(f"   after {100 * done[0]['held_out_accuracy_after']:.0f} %", flush=True)
                runs.append((seed, *done))
            if runs:
                rows.append(_row(method, k, runs))

    print(
        f"\n{'k':>2} {'method':<8} {'held-out after':>15}  {'each seed':<14} {'lag':>4} {'train s':>8}"
        f" {'clipfrac':>8} {'IS w mean':>9} {'truncated':>9}"
    )
    for r in rows:
        plain = next((x for x in rows if x["method"] == "plain" and x["k"] == r["k"]), None)
        cost = f" ({r['train_s'] / plain['train_s']:.2f}x)" if plain and r is not plain else ""
        each = " ".join(f"{100 * a:.0f}" for a in r["after"].values())
        print(
            f"{r['k']:>2} {r['method']:<8} {100 * _mean(list(r['after'].values())):>14.1f}%  {each:<14}"
            f" {r['version_lag']:>4.2f} {r['train_s']:>8.2f}{cost} {r['clipfrac']:>8.3f}"
            f" {r['is_weight_mean']:>9.3f} {r['is_truncated']:>9.3f}"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    if rows:
        plot(rows, Path(args.plot) if args.plot else out / "staleness.png")
        print(f"\nresults: {out / 'results.json'}\nplot: {args.plot or out / 'staleness.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
