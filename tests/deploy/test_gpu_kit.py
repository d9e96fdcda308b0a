"""The GPU proof kit (scripts/gpu_kit.py): the image's packages plus the kit's are everything the hf-backend
server, the DeepSpeed learner and tests/gpu import, and its check names each way a kit folder can be wrong."""

import importlib.util
import os
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_kit", REPO / "scripts/gpu_kit.py")
kit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kit)


def test_the_image_and_the_kit_hold_every_module_the_server_the_learner_and_the_gpu_tests_import(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    allowed = kit.allowed_distributions()
    python, left_out = kit.view_venv(tmp_path / "view", allowed)
    assert left_out > 0  # this machine has more (vLLM, ...): the view really leaves things out
    assert kit.check_imports(python, env) == {}
    # Without one of the kit's packages, the import that needs it fails, and says which.
    python, _ = kit.view_venv(tmp_path / "no-hjson", allowed - {"hjson"})
    assert kit.check_imports(python, env) == {"deepspeed": "ModuleNotFoundError: No module named 'hjson'"}


def test_the_kit_pins_what_the_suite_runs_and_the_image_plus_the_kit_meet_its_needs():
    pinned = kit.kit_packages()
    assert {"deepspeed", "fastapi", "uvicorn", "pydantic", "pydantic-core"} <= set(pinned)
    assert {n: metadata.version(n) for n in pinned} == pinned
    assert not {"torch", "transformers", "peft", "vllm"} & set(pinned)  # the image's, or not carried
    assert kit.unmet(kit.installed_requires(pinned), {**kit.image_packages(), **pinned}) == []


def test_requirements_are_read_as_the_image_reads_them():
    needs = {
        "a": ["hjson", "numpy>=3", "torch>=2.0", "colorama; sys_platform == 'win32'", "x; extra == 'dev'"]
    }
    assert kit.unmet(needs, {"torch": "2.11.0", "numpy": "2.5.2"}) == [
        "a needs hjson (neither on the image nor in the kit)",
        "a needs numpy>=3, but numpy is 2.5.2",
    ]


def _wheel(folder: Path, filename: str, requires=(), size=0) -> None:
    name, version = filename.split("-")[:2]
    with zipfile.ZipFile(folder / filename, "w") as z:
        meta = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
        z.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(meta) + "\n")
        z.writestr(f"{name}/blob.bin", os.urandom(size))


@pytest.fixture
def lists(tmp_path, monkeypatch):
    (tmp_path / "kit.txt").write_text("# the kit\nalpha==1.0\nbeta_core==2.0\n")
    (tmp_path / "image.txt").write_text("python==3.12.3\nnumpy==2.5.2\ntorch\n")
    monkeypatch.setattr(kit, "LISTS", tmp_path)
    folder = tmp_path / "wheels"
    folder.mkdir()
    return folder


def test_a_kit_that_matches_its_lists_passes(lists):
    _wheel(lists, "alpha-1.0-py3-none-any.whl", ["beta-core>=2", "numpy>=2", "torch"])
    _wheel(lists, "beta_core-2.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    problems, size = kit.check_kit(lists)
    assert problems == [] and 0 < size < 0.01


def test_the_check_names_each_way_a_kit_can_be_wrong(lists, monkeypatch):
    _wheel(lists, "alpha-0.9-py3-none-any.whl", ["gamma", "numpy>=3"])  # old version, unmet needs
    _wheel(lists, "delta-1.0-py3-none-any.whl")  # not in kit.txt
    _wheel(lists, "zeta-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", size=300_000)  # another Python
    monkeypatch.setattr(kit, "MAX_MIB", 0.2)
    problems, _ = kit.check_kit(lists)
    assert problems == [
        "missing: beta-core==2.0 (run: python scripts/gpu_kit.py build)",
        "alpha is 0.9 in the folder, kit.txt pins 1.0",
        "not in kit.txt: delta-1.0-py3-none-any.whl",
        "not in kit.txt: zeta-1.0-cp311-cp311-manylinux_2_17_x86_64.whl",
        "zeta-1.0-cp311-cp311-manylinux_2_17_x86_64.whl does not install on the image's Python 3.12 "
        "(x86-64 Linux)",
        "alpha needs gamma (neither on the image nor in the kit)",
        "alpha needs numpy>=3, but numpy is 2.5.2",
        "the kit is 0.3 MiB, over its 0.2 MiB budget",
    ]
