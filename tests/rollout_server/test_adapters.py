"""Adapter checks that need no engine: the files a publish is refused for, and the adapter root."""

import json
import struct

import pytest

from rollout_server.adapters import (
    STANDARD_TARGETS,
    AdapterRejected,
    AdapterStore,
    resolve_under,
    validate_adapter,
)


def _safetensors(tensors: dict[str, list[int]]) -> bytes:
    header, offset = {}, 0
    for name, shape in tensors.items():
        n = 4 * shape[0] * shape[1]
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + b"\0" * offset


CONFIG = json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}).encode()
WEIGHTS = _safetensors({
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": [8, 576],
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": [576, 8],
})  # fmt: skip


def check(config=CONFIG, weights=WEIGHTS, max_rank=16):
    return validate_adapter(config, weights, max_rank=max_rank, allowed_targets=STANDARD_TARGETS)


def test_a_good_adapter_passes():
    assert check()["r"] == 8


@pytest.mark.parametrize(
    ("config", "weights", "message"),
    [
        (b"{oops", WEIGHTS, "not valid JSON"),
        (b"[1]", WEIGHTS, "must be a JSON object"),
        (json.dumps({"r": 32, "target_modules": ["q_proj"]}).encode(), WEIGHTS, "r=32 exceeds"),
        (json.dumps({"r": 0, "target_modules": ["q_proj"]}).encode(), WEIGHTS, "positive integer"),
        (json.dumps({"r": 8, "target_modules": ["lm_head_magic"]}).encode(), WEIGHTS, "not linear layers"),
        (json.dumps({"r": 8, "target_modules": []}).encode(), WEIGHTS, "non-empty list"),
        (
            json.dumps({"peft_type": "IA3", "r": 8, "target_modules": ["q_proj"]}).encode(),
            WEIGHTS,
            "not LORA",
        ),
        (CONFIG, b"PK\x03\x04 zip file", "header length"),
        (CONFIG, b"\x01", "too short"),
        (CONFIG, struct.pack("<Q", 5) + b"nope!", "header is not JSON"),
        (CONFIG, _safetensors({}), "holds no tensors"),
        (CONFIG, _safetensors({"model.layers.0.mlp.up_proj.weight": [8, 8]}), "not a LoRA A/B matrix"),
        (
            CONFIG,
            _safetensors({"x.layers.0.self_attn.k_proj.lora_A.weight": [8, 576]}),
            "not in target_modules",
        ),
        (
            CONFIG,
            _safetensors({"x.layers.0.self_attn.q_proj.lora_A.weight": [4, 576]}),
            "inconsistent with r=8",
        ),
    ],
)
def test_malformed_adapters_are_refused_with_a_reason(config, weights, message):
    with pytest.raises(AdapterRejected, match=message):
        check(config, weights)


def test_adapter_root_refuses_escapes(tmp_path):
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside", target_is_directory=True)
    assert resolve_under(str(root), "ok") == (root / "ok").resolve()
    for bad in ["../outside", str(tmp_path / "outside"), "link", "ok/../../outside"]:
        with pytest.raises(AdapterRejected) as e:
            resolve_under(str(root), bad)
        assert e.value.status == 403, bad
    with pytest.raises(AdapterRejected) as e:
        resolve_under(None, "ok")
    assert e.value.status == 403


def test_store_writes_atomically_and_lists_versions(tmp_path):
    store = AdapterStore(tmp_path / "adapters")
    store.write(2, CONFIG, WEIGHTS)
    store.write(1, CONFIG, WEIGHTS)
    (tmp_path / "adapters" / ".incoming-v3").mkdir()  # a crash mid-write leaves no version behind
    assert store.versions() == [1, 2]
    store.remove(2)
    assert store.versions() == [1]
