"""Property-based fuzzing of the running server from its own OpenAPI schema (schemathesis): whatever the
generated request (valid, invalid, with and without the token), the answer is never a 5xx and never
hangs. A real server (HF backend) as a subprocess, on a tiny random model with SmolLM2's tokenizer: what is
fuzzed is the server's handling of requests, whatever the model answers, and SmolLM2's generation made
three quarters of this test's time (186 generating requests at ~0.5 s each). Limits kept small."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import TOKEN, non_finite_bodies, start_server, strict_json

pytestmark = pytest.mark.slow

SERVER = [
    "--server.backend=hf",
    "--sampling.group_size=2",
    "--sampling.max_new_tokens=8",
    "--server.prompts_per_batch=1",
    "--server.queue_size=2",
    "--server.lease_s=5",
    "--model.max_model_len=96",  # a generated prompt + completion stays short
    "--server.max_generate_sequences=4",
    "--server.max_adapter_mb=1",
    "--server.openai_wait_s=1",  # a generated /v1/sleep must not hold the OpenAI requests after it
]
EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "25"))  # per operation and phase


def test_no_request_gets_a_5xx_or_hangs(tmp_path, tiny_model_dir):
    proc, client = start_server(tmp_path, [*SERVER, f"--model.name={tiny_model_dir}"])
    report = tmp_path / "report.ndjson"
    try:
        cmd = [
            str(Path(sys.executable).with_name("st")),
            "run",
            f"{client.url}/openapi.json",
            "--checks=not_a_server_error",
            f"--max-examples={EXAMPLES}",
            "--phases=examples,coverage,fuzzing",
            "--request-timeout=120",
            "--workers=1",
            "--seed=1",
            "--no-color",
            "--generation-database=none",
            "--report=ndjson",
            f"--report-ndjson-path={report}",
            f"--header=Authorization: Bearer {TOKEN}",
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
        # Non-standard JSON, which schemathesis does not generate: NaN and Infinity in every numeric field.
        http = httpx.Client(base_url=client.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        odd = non_finite_bodies(http.get("/openapi.json").json())
        answers = [
            (p, raw, http.post(p, content=raw, headers={"content-type": "application/json"}))
            for p, raw in odd
        ]
        assert proc.alive(), proc.log()[-3000:]
        assert client.health().backend == "hf"
    finally:
        proc.stop()
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    # The NDJSON reports hold every request and response: count them, check no status was a 5xx, and
    # that every endpoint was exercised (a schema that stopped listing them cannot pass vacuously).
    text = report.read_text()
    statuses = [int(x) for x in re.findall(r'"status_code":(\d+)', text)]
    paths = set(re.findall(r'"path":"(/[^"]*)"', text))
    print(f"schemathesis: {len(statuses)} generated requests over {len(paths)} endpoints")
    assert statuses and max(statuses) < 500
    assert len(answers) >= 30
    for path, raw, r in answers:
        assert 400 <= r.status_code < 500, (path, raw, r.status_code, r.text)
        strict_json(r.text)
    assert len(statuses) >= 200
    assert paths >= {
        "/health",
        "/v1/groups/pull",
        "/v1/groups/ack",
        "/v1/adapters",
        "/v1/generate",
        "/v1/score",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/inference/v1/generate",
    }
