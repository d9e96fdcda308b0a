"""Checking and storing published LoRA adapters, before any engine sees them.

An adapter is a folder with `adapter_config.json` and `adapter_model.safetensors` (peft's format). It is
refused (AdapterRejected -> HTTP 4xx) when a file is missing, over the size limit, not JSON / not
safetensors, of a rank above the server's max, aimed at modules the base model does not have, shaped
unlike those modules, missing the A or B half of a pair, or holding a non-finite value (a NaN adapter
makes the sampler fail at its first token). The same checks run on every stored adapter a restarted
server considers. Accepted adapters are kept under `<state_dir>/adapters/v<N>/`, so a restarted server
serves the latest version again without the learner.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

from shared.protocol import ADAPTER_CONFIG_FILE as CONFIG
from shared.protocol import ADAPTER_WEIGHTS_FILE as WEIGHTS
from shared.protocol import MAX_VERSION

# Linear layers of Llama/Qwen-style decoders: the fallback when the base model's files are not local.
STANDARD_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


class AdapterRejected(ValueError):
    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


def linear_modules(model_path: str) -> dict[str, tuple[int, int]]:
    """Every 2-D weight inside the decoder layers: module path ('model.layers.0.self_attn.q_proj') ->
    (out_features, in_features), read from the model's safetensors headers; empty when the model is a
    hub id not yet on disk."""
    shapes = {}
    for f in Path(model_path).glob("*.safetensors"):
        with f.open("rb") as fh:  # only the header: the tensors can be gigabytes
            prefix = fh.read(8)
            head = prefix + fh.read(struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0)
        for key, meta in safetensors_header(head, str(f)).items():
            if re.search(r"\.layers\.\d+\..+\.weight$", key) and len(meta["shape"]) == 2:
                shapes[key.removesuffix(".weight")] = tuple(meta["shape"])
    return shapes


def target_names(shapes: dict[str, tuple[int, int]]) -> frozenset[str]:
    """Short names of those modules (q_proj, ...); the standard set when the model is not on disk."""
    return frozenset(m.rsplit(".", 1)[-1] for m in shapes) or STANDARD_TARGETS


def safetensors_header(data: bytes, what: str = WEIGHTS) -> dict[str, dict]:
    """The tensor table of a safetensors blob, checked for internal consistency."""
    if len(data) < 8:
        raise AdapterRejected(f"{what}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8 or n > 100_000_000:
        raise AdapterRejected(f"{what}: not a safetensors file (header length {n} exceeds the file)")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterRejected(f"{what}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterRejected(f"{what}: not a safetensors file (header is not a table)")
    header.pop("__metadata__", None)
    for key, meta in header.items():
        ok = (
            isinstance(meta, dict)
            and isinstance(meta.get("shape"), list)
            and isinstance(meta.get("data_offsets"), list)
            and len(meta["data_offsets"]) == 2
        )
        if not ok:
            raise AdapterRejected(f"{what}: malformed entry for tensor '{key}'")
    return header


def validate_adapter(
    config_bytes: bytes,
    weights_bytes: bytes,
    *,
    max_rank: int,
    allowed_targets: frozenset[str],
    shapes: dict[str, tuple[int, int]] | None = None,
) -> dict:
    """Check an adapter's two files; returns the parsed adapter_config.json. `shapes` (linear_modules of
    the served model) also checks that every tensor belongs to one of its modules, with its shape."""
    try:
        config = json.loads(config_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterRejected(f"{CONFIG}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterRejected(f"{CONFIG}: must be a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterRejected(f"{CONFIG}: peft_type {config.get('peft_type')!r} is not LORA")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterRejected(f"{CONFIG}: 'r' must be a positive integer, got {r!r}")
    if r > max_rank:
        raise AdapterRejected(f"{CONFIG}: rank r={r} exceeds the server's max_lora_rank={max_rank}")
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterRejected(f"{CONFIG}: 'target_modules' must be a non-empty list of module names")
    unknown = sorted(set(targets) - allowed_targets)
    if unknown:
        raise AdapterRejected(
            f"{CONFIG}: target_modules {unknown} are not linear layers of the base model "
            f"(it has {sorted(allowed_targets)})"
        )
    tensors = safetensors_header(weights_bytes)
    if not tensors:
        raise AdapterRejected(f"{WEIGHTS}: holds no tensors")
    halves: dict[str, set[str]] = {}
    for key, meta in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?((?:[\w.]+\.)?(\w+))\.lora_([AB])(?:\.weight)?", key)
        if m is None:
            raise AdapterRejected(f"{WEIGHTS}: tensor '{key}' is not a LoRA A/B matrix")
        module, short, half = m.groups()
        if short not in targets:
            raise AdapterRejected(f"{WEIGHTS}: tensor '{key}' targets '{short}', not in target_modules")
        if meta.get("dtype") not in _FLOAT_DTYPES:
            raise AdapterRejected(f"{WEIGHTS}: tensor '{key}' has dtype {meta.get('dtype')!r}, not a float")
        shape = meta["shape"]
        rank_dim = shape[0] if half == "A" else shape[-1]
        if len(shape) != 2 or rank_dim != r:
            raise AdapterRejected(f"{WEIGHTS}: tensor '{key}' has shape {shape}, inconsistent with r={r}")
        if shapes:
            if module not in shapes:
                raise AdapterRejected(f"{WEIGHTS}: tensor '{key}': the served model has no module '{module}'")
            out_f, in_f = shapes[module]
            want = [r, in_f] if half == "A" else [out_f, r]
            if shape != want:
                raise AdapterRejected(
                    f"{WEIGHTS}: tensor '{key}' has shape {shape}; '{module}' is {out_f}x{in_f}, so "
                    f"lora_{half} must be {want}"
                )
        halves.setdefault(module, set()).add(half)
    lone = sorted(m for m, h in halves.items() if h != {"A", "B"})
    if lone:
        raise AdapterRejected(f"{WEIGHTS}: module '{lone[0]}' has only one of lora_A / lora_B")
    _check_values(weights_bytes)
    return config


_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


def _check_values(weights_bytes: bytes) -> None:
    """Every value finite. Reads the tensors (a few MB for LoRA), so it runs after the cheap checks."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(weights_bytes)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise AdapterRejected(f"{WEIGHTS}: unreadable tensor data ({e})") from None
    for key, t in tensors.items():
        if not t.isfinite().all():
            bad = int((~t.isfinite()).sum())
            raise AdapterRejected(f"{WEIGHTS}: tensor '{key}' holds {bad} non-finite value(s) (NaN/inf)")


def validate_folder(folder: Path, **checks) -> dict:
    """validate_adapter on a stored adapter folder (restore at start-up)."""
    try:
        config, weights = (folder / CONFIG).read_bytes(), (folder / WEIGHTS).read_bytes()
    except OSError as e:
        raise AdapterRejected(f"{folder}: {e.strerror or e}") from None
    return validate_adapter(config, weights, **checks)


class AdapterStore:
    """Published adapters on disk, one folder per version."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def versions(self) -> list[int]:
        found = [
            int(p.name[1:])
            for p in self.root.glob("v*")
            if p.name[1:].isdigit() and len(p.name) <= 11 and (p / WEIGHTS).is_file()
        ]
        return sorted(v for v in found if v <= MAX_VERSION)

    def write(self, version: int, config_bytes: bytes, weights_bytes: bytes) -> Path:
        final = self.path(version)
        tmp = self.root / f".incoming-v{version}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        (tmp / CONFIG).write_bytes(config_bytes)
        (tmp / WEIGHTS).write_bytes(weights_bytes)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # a crash mid-write never leaves a half adapter under a version's name
        return final

    def remove(self, version: int) -> None:
        shutil.rmtree(self.path(version), ignore_errors=True)


def resolve_under(root: str | None, relative: str) -> Path:
    """`relative` inside `root`, refusing absolute paths, `..` and symlinks that lead outside."""
    if root is None:
        raise AdapterRejected("publishing by path is disabled: the server has no adapter_root", status=403)
    if Path(relative).is_absolute():
        raise AdapterRejected(f"adapter path '{relative}' must be relative to the adapter root", status=403)
    base = Path(root).resolve()
    target = (base / relative).resolve()  # follows symlinks: a link pointing outside is caught here
    if not target.is_relative_to(base):
        raise AdapterRejected(f"adapter path '{relative}' leaves the adapter root", status=403)
    if not target.is_dir():
        raise AdapterRejected(f"adapter path '{relative}' is not a folder under the adapter root", status=404)
    return target
