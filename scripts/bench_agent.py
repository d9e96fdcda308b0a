"""Does GRPO teach an agent to use its tool? The calculator task (examples/calculator.py) over several seeds:
held-out success before and after a short run, the training reward per step, and a plot.

    .venv/bin/python scripts/bench_agent.py [--seeds 0,1,2] [--steps 16] [--eval-problems 100]
    .venv/bin/python scripts/bench_agent.py --task two_turn_sums     # a `verifiers` environment instead
    .venv/bin/python scripts/bench_agent.py --task syllogism         # reasoning-gym (or number_format, ...)
    .venv/bin/python scripts/bench_agent.py --task one_digit_sums --shots 3 --steps 48  # 3 solved first

--task two_turn_sums trains on examples/two_turn_sums.py, a taskset of the `verifiers` library played by its
own harness (env.kind = "verifiers"), and evaluates on its 100 held-out tasks the same way: success is its
`correct` reward (the second answer right). --task basic_arithmetic / syllogism / number_format / ransom_note
/ chain_sum / products / simple_equations / lcm (and one_digit_sums: chain_sum of two one-digit terms) trains
on that reasoning-gym task (data.task = "reasoning_gym", small configs, data.reasoning_gym.answer_prefill:
SmolLM2 never writes the <answer> tag itself; --shots N shows N solved train problems before each question,
data.reasoning_gym.shots) and evaluates on its held-out split, scored by the task's own score_answer (correct:
a score of 1), next to what always giving the split's most common answer scores.

Each seed is `scripts/demo.py` (vLLM server with merged versions, DeepSpeed learner, deploy/configs/cpu.toml,
bf16 where the CPU computes in it) on the calculator task as tool-use episodes: the model may call
`multiply`, its result comes back as a tool message, and an episode is a success when its last turn ends
with the product. SmolLM2-135M cannot multiply 3-digit by 2-digit numbers in its head, so success is what
the tool's answers make of it. Runs one seed after another (each has the machine to itself); results in
runs/bench-agent/, the plot where --plot says (docs/benchmarks.md §10).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

import calculator  # noqa: E402  (examples/ is not a package)
from demo import run_demo  # noqa: E402  (scripts/, this script's folder, is on the path)

TASK = [
    "--data.task=custom",
    "--data.custom.messages_column=messages",
    "--data.custom.answer_column=answer",
    "--env.kind=tools",
    '--env.tools=["examples/calculator.py:multiply"]',
    "--env.max_turns=3",
    '--reward.functions=["examples/calculator.py:solved"]',
    "--sampling.max_new_tokens=48",  # a call is ~30 tokens
]


VERIFIERS = [
    "--env.kind=verifiers",
    '--env.verifiers={"taskset": {"id": "two_turn_sums"}}',
    "--env.verifiers_eval=100",
    "--sampling.max_new_tokens=24",
]


# reasoning-gym tasks whose groups carry a signal for SmolLM2-135M with the prefill (docs/benchmarks.md §13):
# the bench's name -> reasoning-gym's task, its config, the train split's size (basic_arithmetic's one-digit
# pairs are ~400 problems: a small train split leaves a held-out one).
REASONING_GYM = {
    "chain_sum": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}, 2000),
    # a + b or a - b, one digit each: at most 200 problems, so a train split of 100 leaves a held-out one
    "one_digit_sums": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, 100),
    "basic_arithmetic": (
        "basic_arithmetic",
        {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        200,
    ),
    # 40 of the 100 pairs
    "products": ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, 40),
    "simple_equations": (
        "simple_equations",
        {"min_terms": 2, "max_terms": 2, "min_value": 1, "max_value": 9},
        2000,
    ),
    "lcm": ("lcm", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 20}, 200),
    "syllogism": ("syllogism", {}, 2000),  # Yes / No
    "ransom_note": ("ransom_note", {}, 2000),  # True / False
    # the larger or the smaller of two
    "number_format": ("number_format", {"min_num_candidates": 2, "max_num_candidates": 2}, 2000),
}


# items generated for the held-out split: those the train split also has are removed, and a run scores the
# first --eval-problems of the rest (chain_sum's 2-digit sums kept 45 of 100)
EVAL_SIZE = 150


def rg_data(name: str, shots: int = 0) -> dict:
    """data.reasoning_gym for one of REASONING_GYM's tasks: what the run is given and the baseline reads."""
    task, config, size = REASONING_GYM[name]
    return {
        "task": task,
        "config": config,
        "size": size,
        "eval_size": EVAL_SIZE,
        "answer_prefill": True,
        "shots": shots,
    }


def reasoning_gym_task(name: str, shots: int) -> list[str]:
    return [
        "--data.task=reasoning_gym",
        *(
            f"--data.reasoning_gym.{k}={v if isinstance(v, str) else json.dumps(v)}"
            for k, v in rg_data(name, shots).items()
        ),
        "--sampling.max_new_tokens=16",  # the answer, and its closing tag
    ]


def majority_baseline(name: str, seed: int, problems: int) -> tuple[str, float]:
    """The held-out accuracy of always giving the most common answer, on the problems the run evaluates
    (a run that learns only the answer's form and the tasks' prior reaches it, not more)."""
    from collections import Counter

    from shared.datasets import load_problems
    from shared.task_config import DataConfig

    data = DataConfig(task="reasoning_gym", seed=seed, reasoning_gym=rg_data(name))
    answers = [p.answer for p in load_problems(data, "test")]
    answer, count = Counter(answers[:problems]).most_common(1)[0]
    return answer, count / len(answers[:problems])


def plot(runs: dict[int, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for seed, r in runs.items():
        steps = [m["step"] for m in r["metrics"]]
        left.plot(steps, [m["reward/mean"] for m in r["metrics"]], "-o", ms=3, label=f"seed {seed}")
        right.plot([0, steps[-1]], [100 * r["before"], 100 * r["after"]], "-o", label=f"seed {seed}")
    left.set(xlabel="optimizer step", ylabel="mean reward (episodes solved)", title="Training", ylim=(0, 1))
    right.set(
        xlabel="optimizer step",
        ylabel="held-out success, greedy (%)",
        title="Held-out problems (never trained on)",
        ylim=(0, 100),
    )
    for ax in (left, right):
        ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=["calculator", "two_turn_sums", *REASONING_GYM], default="calculator")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--eval-problems", type=int, default=100)
    p.add_argument(
        "--shots",
        type=int,
        default=0,
        help="reasoning-gym tasks: solved train problems shown before each question "
        "(data.reasoning_gym.shots; 0: none)",
    )
    p.add_argument(
        "--out", default=None, help="default: runs/bench-agent, bench-verifiers, bench-rg-<task>[-shots<n>]"
    )
    p.add_argument("--plot", default=None, help="PNG to write (default: <out>/agent.png)")
    p.add_argument("overrides", nargs="*", metavar="--section.key=value", help="more config overrides")
    args, extra = p.parse_known_args()
    if args.task == "two_turn_sums":
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO / "examples"), os.environ.get("PYTHONPATH")])
        )
        task, title = (
            VERIFIERS,
            "tandem: GRPO on a two-turn verifiers environment, SmolLM2-135M (CPU, 2 cores)",
        )
    if args.task in REASONING_GYM:
        task = reasoning_gym_task(args.task, args.shots)
        shown = f", {args.shots} solved problems shown" if args.shots else ""
        title = f"tandem: GRPO on reasoning-gym's {REASONING_GYM[args.task][0]}{shown}, SmolLM2-135M (CPU)"
    elif args.shots:
        p.error("--shots: reasoning-gym tasks only")
    folder = {"calculator": "bench-agent", "two_turn_sums": "bench-verifiers"}.get(
        args.task, f"bench-rg-{args.task}" + (f"-shots{args.shots}" if args.shots else "")
    )
    out = Path(args.out or REPO / "runs" / folder)
    out = out.resolve()
    if args.task == "calculator":
        task = [*TASK, f"--data.path={calculator.write(out / 'data')}"]
        title = "tandem: GRPO teaches SmolLM2-135M to call a calculator tool (CPU, 2 cores)"
    runs = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        run = out / f"seed{seed}"
        cmd = ["--steps", str(args.steps), "--eval-problems", str(args.eval_problems)]
        cmd += [*task, *args.overrides, *extra]
        print(f"== seed {seed} -> {run}", flush=True)
        if (done := run_demo(run, seed, cmd)) is None:
            continue
        summary, metrics = done
        runs[seed] = {
            "before": summary["held_out_accuracy_before"],
            "after": summary["held_out_accuracy_after"],
            "minutes": summary["wall_clock_s"] / 60,
            "metrics": metrics,
        }
        if args.task in REASONING_GYM:
            runs[seed]["majority"] = majority_baseline(args.task, seed, args.eval_problems)
        r = runs[seed]
        print(f"   {100 * r['before']:.0f}% -> {100 * r['after']:.0f}% in {r['minutes']:.1f} min", flush=True)
    if not runs:
        return 1
    print("\nseed  before  after   gain  wall clock  training reward: first 3 steps -> last 3")
    for seed, r in runs.items():
        rewards = [m["reward/mean"] for m in r["metrics"]]
        first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
        print(
            f"{seed:>4}  {100 * r['before']:5.1f}%  {100 * r['after']:5.1f}%  "
            f"{100 * (r['after'] - r['before']):+5.1f}  {r['minutes']:6.1f} min  {first:.2f} -> {last:.2f}"
        )
    for seed, r in runs.items():
        if "majority" in r:
            answer, share = r["majority"]
            print(
                f"seed {seed}: always answering {answer!r} scores {100 * share:.0f}% of the held-out problems"
            )
    gains = [100 * (r["after"] - r["before"]) for r in runs.values()]
    print(f"mean gain: {sum(gains) / len(gains):+.1f} points over {len(runs)} seed(s)")
    path = Path(args.plot) if args.plot else out / "agent.png"
    plot(runs, path, title)
    print(f"plot: {path}")
    return 0 if len(runs) == len(args.seeds.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
