"""The learner's frozen weights leave the GPU while the server generates (time-sliced on one GPU) and come
back for training. On CPU there is no second device, so the move is swapped for a change of dtype (fp32 <->
fp64, which `.to()` takes the same way and which round-trips exactly): the test sees which tensors move,
that the Parameter objects (which DeepSpeed's optimizer holds) and the embedding/LM-head tie survive,
and that the model computes the same after the round trip."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from learner.engine import move_frozen


@pytest.fixture
def model():
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_frozen_weights_move_and_trainable_ones_stay(model):
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    params = dict(model.named_parameters())
    assert move_frozen(model, torch.float64) == frozen_bytes  # the tied embedding counted once
    for n, p in model.named_parameters():
        assert p.dtype == (torch.float32 if n in trainable else torch.float64), n
        assert p is params[n]  # moved in place: the same Parameter objects
    base = model.base_model.model
    assert base.lm_head.weight is base.model.embed_tokens.weight  # still tied
    assert move_frozen(model, torch.float64) == 0  # nothing left to move


def test_a_round_trip_leaves_the_outputs_bit_identical(model):
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    move_frozen(model, torch.float64)  # away (host RAM on a GPU machine) ...
    move_frozen(model, torch.float32)  # ... and back for the training phase
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


class _Recorder:
    def __init__(self):
        self.calls = []

    def sleep(self):
        self.calls.append("server sleeps")


def test_on_a_shared_gpu_the_learner_builds_while_the_server_sleeps(model, monkeypatch):
    """The order of start-up on one GPU (time-sliced), with the GPU swapped for the CPU: the server is
    asleep before the learner's weights arrive, and they leave again before anything wakes it."""
    import learner.engine as engine_module
    from learner.engine import build_beside_server
    from shared.config import TandemConfig

    monkeypatch.setattr(engine_module, "broadcast_object", lambda x: x)  # one process
    moves = []
    monkeypatch.setattr(engine_module, "move_frozen", lambda module, device: moves.append(device) or 0)
    server = _Recorder()

    def build():
        server.calls.append("learner builds")
        return type("Engine", (), {"module": model})()

    engine, offload = build_beside_server(server, TandemConfig(), True, build, log=lambda *a: None)
    assert server.calls == ["server sleeps", "learner builds"] and moves == ["cpu"] and offload
    # Not shared (split placement, or CPU): no sleep, no move.
    server.calls, moves[:] = [], []
    _, offload = build_beside_server(server, TandemConfig(), False, build, log=lambda *a: None)
    assert server.calls == ["learner builds"] and moves == [] and not offload
    # Shared, with the offload turned off: still built while the server sleeps.
    server.calls = []
    cfg = TandemConfig.model_validate({"learner": {"offload_weights_while_generating": False}})
    _, offload = build_beside_server(server, cfg, True, build, log=lambda *a: None)
    assert server.calls == ["server sleeps", "learner builds"] and not offload
