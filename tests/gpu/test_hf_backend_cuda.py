"""The hf backend on a CUDA GPU: asleep, it holds no GPU memory (a time-sliced learner gets the GPU, as
with vLLM's sleep mode), and after the wake it answers exactly as before. Skipped without CUDA; run on a
GPU machine with `pytest -m gpu`."""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout_server.engines.base import Adapter
from rollout_server.engines.hf import HFBackend
from tests.fakes import tiny_adapter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _backend(merge: bool) -> HFBackend:
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=8,
        intermediate_size=4096,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )  # fmt: skip  (hidden 8: tiny_adapter's 8 x 8 q_proj; the MLP makes the weights worth measuring)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).to("cuda").eval()
    decode = lambda ids, **_: " ".join(map(str, ids))  # noqa: E731
    tokenizer = SimpleNamespace(eos_token_id=1, pad_token_id=0, decode=decode)
    return HFBackend(model, tokenizer, "cuda", merge=merge)


def _greedy(backend: HFBackend, adapter: Adapter | None) -> list[int]:
    groups = asyncio.run(
        backend.generate([[5, 6, 7]], n=1, temperature=0.0, max_tokens=16, adapter=adapter, logprobs=False)
    )
    return groups[0][0].token_ids


@pytest.mark.parametrize("merge", [True, False], ids=["merged copies", "peft adapters"])
def test_asleep_the_weights_leave_the_gpu_and_come_back_unchanged(tmp_path, merge):
    backend = _backend(merge)
    v1 = Adapter(1, str(tiny_adapter(tmp_path / "v1", value=0.5)))
    v2 = Adapter(2, str(tiny_adapter(tmp_path / "v2", value=-0.2)))
    before = {None: _greedy(backend, None), 1: _greedy(backend, v1)}
    awake = torch.cuda.memory_allocated()

    asyncio.run(backend.sleep())
    asleep = torch.cuda.memory_allocated()
    assert asleep < 0.02 * awake, f"{asleep} bytes still on the GPU while asleep (awake: {awake})"
    asyncio.run(backend.load_adapter(v2))  # the learner publishes while the server sleeps
    assert torch.cuda.memory_allocated() < 0.02 * awake

    asyncio.run(backend.wake())
    assert torch.cuda.memory_allocated() >= awake
    assert {None: _greedy(backend, None), 1: _greedy(backend, v1)} == before
    fresh = _backend(merge)  # v2 loaded while awake: what the one loaded while asleep must answer
    assert _greedy(backend, v2) == _greedy(fresh, v2)
