"""vLLM's tensor parallelism inside one tandem server on CPU (server.vllm.tensor_parallel_size): a merged
version's log-probs equal the single-rank engine's, so each rank merged its own shard of every layer.
SmolLM2-135M has 9 attention heads (3 KV heads): vLLM refuses 2 ranks ("Total number of attention heads (9)
must be divisible by tensor parallel size (2)"), so the test runs 3 ranks on this machine's cores (2 in CI:
two ranks share one, which costs time, not correctness). The engines run one after the other in a process
of their own (this module, run as a script), as vLLM's workers start by spawn."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, make_adapter, proc_env

pytestmark = pytest.mark.slow

TEXT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May."


def test_a_merged_version_scores_the_same_on_three_tensor_parallel_ranks(tmp_path, model_dir):
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter = str(make_adapter(model_dir, tmp_path / "v1", seed=1, r=16, targets=targets))
    out = subprocess.run(
        [sys.executable, "-m", "tests.rollout_server.test_vllm_tensor_parallel", adapter],
        cwd=REPO,
        env=proc_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    one, three = (json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"ranks"'))
    assert (one["ranks"], three["ranks"]) == (1, 3)
    for key in ("base", "merged"):
        assert max(abs(a - b) for a, b in zip(one[key], three[key], strict=True)) < 2e-3, key
    # the version changed the model: the agreement above is about the merged weights, not the base's
    assert max(abs(a - b) for a, b in zip(one["base"], one["merged"], strict=True)) > 0.1


async def _scores(tp: int, bind: str, adapter: str) -> None:
    """One engine of `tp` ranks on the cores `bind` names: the base model's and the merged version's
    log-probs of TEXT, printed as a line of JSON."""
    from rollout_server.engines.base import Adapter
    from rollout_server.serving.serve import make_backend
    from shared.config import load_config
    from shared.models import resolve_model

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind  # read by the engine's processes, started below
    cfg = load_config(
        REPO / "deploy/configs/cpu.toml",
        [f"server.vllm.tensor_parallel_size={tp}", "server.adapter_mode=merge"],
    )
    backend = await make_backend(cfg, resolve_model(cfg.model.name))
    try:
        ids = backend.tokenizer.encode(TEXT)
        base = await backend.score(ids[:5], ids[5:], None)
        version = Adapter(1, adapter)
        await backend.load_adapter(version)
        merged = await backend.score(ids[:5], ids[5:], version)
        ranks = backend.engine.vllm_config.parallel_config.tensor_parallel_size
    finally:
        await backend.close()
    print(json.dumps({"ranks": ranks, "base": base, "merged": merged}), flush=True)


if __name__ == "__main__":  # vLLM spawns its workers: the guard is required
    asyncio.run(_scores(1, "0,1", sys.argv[1]))  # one after the other in this process: one start-up
    asyncio.run(_scores(3, "0|1|1", sys.argv[1]))
