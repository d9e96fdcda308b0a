"""lm-evaluation-harness against the rollout server's OpenAI API, next to learner.evaluate, same problems.

    .venv/bin/python scripts/lm_eval_check.py --adapter runs/demo-<time>/learner/adapters/v12 [--limit 50]

Starts a rollout server from the config, publishes the adapter (a trained version, e.g. the demo's last)
as version N (its folder's vN, else 1), and scores the base model and that version on the first --limit
held-out problems twice: `learner.evaluate` (tandem's /v1/generate) and lm_eval's `tandem_eval` task
(`local-chat-completions`, eval/lm_eval). Then the log-likelihood task `tandem_eval_mc` (`local-completions`,
echo + logprobs) for both. Prints a table: the two greedy accuracies must agree within one problem.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.net import free_port
from harness.procs import start_server, tandem_env
from learner.client import RolloutClient
from learner.evaluate import evaluate
from shared.config import load_config
from shared.models import resolve_model

REPO = Path(__file__).resolve().parents[1]


def harness(
    url: str, task: str, model: str, config: str, limit: int, max_tokens: int, work: Path, token: str
):
    chat = task == "tandem_eval"
    api = "local-chat-completions" if chat else "local-completions"
    args = f"base_url={url}/v1/{'chat/' if chat else ''}completions,model={model},num_concurrent=4"
    if not chat:
        args += f",tokenizer={resolve_model('smollm2-135m')}"
    out = work / f"{task}-{model}"
    cmd = [sys.executable, "-m", "lm_eval", "--include_path", str(REPO / "eval/lm_eval"), "--tasks", task,
           "--model", api, "--model_args", args, "--metadata", json.dumps({"config": config}),
           "--limit", str(limit), "--output_path", str(out), "--gen_kwargs", f"max_gen_toks={max_tokens}",
           *(["--apply_chat_template"] if chat else [])]  # fmt: skip
    print("$ " + " ".join(cmd[1:]), flush=True)
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OPENAI_API_KEY": token})
    if run.returncode != 0:
        sys.exit(f"lm_eval failed:\n{run.stderr[-4000:]}")
    (result,) = out.rglob("results_*.json")
    metrics = json.loads(result.read_text())["results"][task]
    return metrics["exact_match,none" if chat else "acc,none"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="deploy/configs/cpu.toml")
    p.add_argument("--adapter", required=True, help="a trained adapter folder (peft format)")
    p.add_argument("--limit", type=int, default=50, help="held-out problems")
    args = p.parse_args()
    folder = Path(args.adapter)
    m = re.fullmatch(r"v(\d+)", folder.name)
    version = int(m.group(1)) if m else 1
    cfg = load_config(args.config)
    config = str(Path(args.config).resolve())
    work = Path(tempfile.mkdtemp(prefix="tandem-lm-eval-"))
    port, token = free_port(), secrets.token_hex(8)
    print("starting the server ...", flush=True)
    state = [f"--server.state_dir={work / 'server'}"]
    server, url = start_server(args.config, state, port, work / "server.log", tandem_env(token))
    rows = []
    try:
        client = RolloutClient(url, token=token, timeout_s=3600)
        client.publish(version, folder)
        for model, v in (("base", 0), (f"policy-v{version}", version)):
            ours = evaluate(client, cfg, v, args.limit)["pass@1_greedy"]
            theirs = harness(
                url, "tandem_eval", model, config, args.limit, cfg.sampling.max_new_tokens, work, token
            )
            mc = harness(
                url, "tandem_eval_mc", model, config, args.limit, cfg.sampling.max_new_tokens, work, token
            )
            rows.append((model, ours, theirs, mc))
    finally:
        server.stop(timeout=60)
    print(
        f"\n{args.limit} held-out problems ({cfg.data.task}), greedy, {cfg.sampling.max_new_tokens} tokens:"
    )
    print(
        f"{'model':>12} | learner.evaluate | lm_eval tandem_eval | difference | lm_eval tandem_eval_mc (acc)"
    )
    for model, ours, theirs, mc in rows:
        diff = round(abs(ours - theirs) * args.limit)
        print(f"{model:>12} | {ours:16.2f} | {theirs:19.2f} | {diff:2d} problem(s) | {mc:.2f}")
    return 0 if all(round(abs(o - t) * args.limit) <= 1 for _, o, t, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
