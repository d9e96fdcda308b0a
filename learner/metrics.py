"""Where a step's flat metrics dict goes: JSONL always, TensorBoard and the experiment trackers of
learner.report_to (learner/trackers.py), one console line. Only rank 0 writes."""

from __future__ import annotations

import json
import time
from pathlib import Path

from learner.trackers import Trackers

# docs/design.md §5: every step's record carries at least these.
STEP_KEYS = (
    "reward/mean", "reward/std", "accuracy", "advantage/mean", "advantage/std", "groups/degenerate",
    "policy/entropy", "kl/ref", "ratio/clipfrac", "completion/length", "completion/truncated",
    "policy/version_lag", "sampler/logp_diff", "perf/rollout_tok_s", "perf/step_s", "server/queue_depth",
)  # fmt: skip


class MetricsSink:
    def __init__(
        self,
        out_dir: Path,
        total_steps: int,
        enabled: bool = True,
        tensorboard: bool = True,
        trackers: Trackers | None = None,
    ):
        self.enabled = enabled
        self.total = total_steps
        self.path = out_dir / "metrics.jsonl"
        self.trackers = trackers if enabled else None
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional; JSONL is the record
                self._tb = None

    def write(self, step: int, metrics: dict[str, float], groups=None, decode=None) -> None:
        """`groups` (the step's) and `decode` (token ids -> text): for the trackers' samples table."""
        if not self.enabled:
            return
        if self.trackers:
            metrics = metrics | self.trackers.metrics()
        missing = [k for k in STEP_KEYS if k not in metrics]
        if missing:
            raise KeyError(f"step {step} metrics lack {missing}")
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if v is not None:
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self.trackers:
            self.trackers.step(step, metrics, groups, decode)
        m = metrics
        kl = "-" if m["kl/ref"] is None else f"{m['kl/ref']:.4f}"  # None: beta = 0, no reference pass
        tis = ""  # truncated importance sampling, where it is on
        if "is/weight_mean" in m:
            tis = f"| IS w {m['is/weight_mean']:.3f} trunc {m['is/truncated']:.3f} "
        print(
            f"step {step:>4}/{self.total} v{int(m['policy/version'])} | reward {m['reward/mean']:.3f} "
            f"| degenerate {m['groups/degenerate']:.2f} | kl {kl} "
            f"| clip {m['ratio/clipfrac']:.3f} "
            f"| len {m['completion/length']:.0f} | |Δlogp| {m['sampler/logp_diff']:.3f} {tis}"
            f"| {m['perf/step_s']:.1f} s/step (pull {m['perf/pull_s']:.1f}, train {m['perf/train_s']:.1f})",
            flush=True,
        )

    def close(self, summary: dict | None = None) -> None:
        if self._tb is not None:
            self._tb.close()
        if self.trackers:
            self.trackers.close(summary or {})


NO_SIGNAL_STEPS = 3  # steps in a row without a learning signal before the learner says so


class SignalWatch:
    """Says, in one line, when the last NO_SIGNAL_STEPS steps had nothing to learn from, and why that
    usually is: every group's completions scored alike (GRPO's advantages are then all 0, only the KL term
    moves the policy), or the completions of each group are one and the same. Once per spell: a step with a
    signal re-arms it."""

    def __init__(self, log, steps: int = NO_SIGNAL_STEPS):
        self.log, self.steps, self.spell, self.told = log, steps, [], False

    def observe(self, m: dict[str, float]) -> None:
        flat = m["groups/degenerate"] >= 0.999 or m.get("groups/identical", 0.0) >= 0.9
        if not flat:
            self.spell, self.told = [], False
            return
        self.spell.append(m)
        if self.told or len(self.spell) < self.steps:
            return
        self.told = True
        self.log(self.message(self.spell[-self.steps :]))

    def message(self, spell: list[dict[str, float]]) -> str:
        head = f"no learning signal in the last {len(spell)} steps: "
        if all(x["reward/mean"] <= 0 and x["reward/std"] == 0 for x in spell):
            return head + (
                "every completion scored 0, so every advantage is 0. Likely: the model does not write its "
                "answer the way the reward function reads it (the task's answer format; for reasoning-gym, "
                "--data.reasoning_gym.shots=3 and answer_prefill=true), the wrong reward.functions, or "
                "completions cut before the answer (sampling.max_new_tokens; see completion/truncated)"
            )
        if all(x["reward/std"] == 0 for x in spell):
            return head + (
                f"every completion scored {spell[-1]['reward/mean']:g}. The task is solved, or the reward "
                "does not tell completions apart: a harder task (e.g. data.arith.difficulty), "
                "data.curriculum=skip_settled (problems every sample solves sit out epochs), or a reward "
                "that grades"
            )
        identical = sum(x.get("groups/identical", 0.0) for x in spell) / len(spell)
        return head + (
            f"(nearly) every group's completions scored alike, {100 * identical:.0f} % of groups one and the "
            "same completion: the policy answers each prompt one way. Options: a higher "
            "sampling.temperature, a larger sampling.group_size, learner.dynamic_sampling=true (pulls past "
            "such groups), data.curriculum=skip_settled (the server sits their problems out)"
        )
