"""Adapter checks that need no engine: the files a publish is refused for, and the adapter root."""

import json
import struct

import pytest

from rollout_server.production.adapters import (
    STANDARD_TARGETS,
    AdapterRejected,
    AdapterStore,
    resolve_under,
    validate_adapter,
    validate_folder,
)


def _safetensors(tensors: dict[str, list[int]], fill: float = 0.0, dtype: str = "F32") -> bytes:
    header, offset = {}, 0
    for name, shape in tensors.items():
        n = 4 * shape[0] * shape[1]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + struct.pack("<f", fill) * (offset // 4)


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


# The served model's q_proj of layer 0 (SmolLM2-135M: 576 x 576), as linear_modules reads it.
SHAPES = {"model.layers.0.self_attn.q_proj": (576, 576)}
A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def check_content(weights):
    return validate_adapter(CONFIG, weights, max_rank=16, allowed_targets=STANDARD_TARGETS, shapes=SHAPES)


def test_a_good_adapter_passes_the_content_checks():
    assert check_content(WEIGHTS)["r"] == 8


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        # All-NaN B: the adapter that made the sampler fail at its first token.
        (_safetensors({A: [8, 576], B: [576, 8]}, fill=float("nan")), "holds 4608 non-finite value"),
        (_safetensors({A: [8, 576], B: [576, 8]}, fill=float("inf")), "non-finite"),
        (_safetensors({A: [8, 576], B: [576, 8]}, dtype="I32"), "not a float"),
        (_safetensors({A: [8, 576]}), "has only one of lora_A / lora_B"),
        (_safetensors({A: [8, 999], B: [576, 8]}), r"lora_A must be \[8, 576\]"),
        (_safetensors({A: [8, 576], B: [100, 8]}), r"lora_B must be \[576, 8\]"),
        (
            _safetensors({A.replace(".0.", ".99."): [8, 576], B.replace(".0.", ".99."): [576, 8]}),
            "the served model has no module 'model.layers.99.self_attn.q_proj'",
        ),
    ],
)  # fmt: skip
def test_an_adapter_is_refused_for_what_it_holds(weights, message):
    with pytest.raises(AdapterRejected, match=message):
        check_content(weights)


def test_validate_folder_reads_a_stored_adapter(tmp_path):
    store = AdapterStore(tmp_path / "adapters")
    folder = store.write(1, CONFIG, _safetensors({A: [8, 576], B: [576, 8]}, fill=float("nan")))
    checks = {"max_rank": 16, "allowed_targets": STANDARD_TARGETS, "shapes": SHAPES}
    with pytest.raises(AdapterRejected, match="non-finite"):
        validate_folder(folder, **checks)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterRejected, match="No such file"):
        validate_folder(folder, **checks)


def test_store_ignores_versions_beyond_the_protocols_bound(tmp_path):
    store = AdapterStore(tmp_path / "adapters")
    store.write(3, CONFIG, WEIGHTS)
    store.write(2**31, CONFIG, WEIGHTS)  # a planted name no publish could have made
    assert store.versions() == [3]
