"""Fixtures shared by the whole suite. GSM8K comes from $TANDEM_GSM8K (default: ../shared/data/gsm8k
beside the repo); the embedded model is prepared (or found) in $TANDEM_CACHE once per session."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    path = Path(os.environ.get("TANDEM_GSM8K", REPO.parent / "shared" / "data" / "gsm8k"))
    if not (path / "test.jsonl").is_file():
        pytest.fail(
            f"GSM8K not found at {path}: set TANDEM_GSM8K to a folder with train.jsonl and test.jsonl"
        )
    return path


@pytest.fixture(scope="session")
def model_dir() -> str:
    from shared.models import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture
def procs():
    """Processes a test starts (harness.procs.Proc): each stopped when the test ends, however it ends."""
    started = []
    yield started
    for p in started:
        p.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, model_dir) -> str:
    """A two-layer Llama of width 32 with SmolLM2's tokenizer (tests.helpers.make_tiny_model): for tests
    of what surrounds a real engine, where the model's answers do not matter and its cost should not."""
    from tests.helpers import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny", model_dir))
