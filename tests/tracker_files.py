"""Read back what the experiment trackers stored, from their own files: W&B's offline transaction logs
(run-<id>.wandb), Trackio's SQLite store, MLflow's file store. Each reader returns
{"config": dict, "history": [(step, {key: value})], "tables": {step: rows as dicts}, "summary": dict}."""

from __future__ import annotations

import json
import os
import sqlite3
import struct
from pathlib import Path

_BLOCK = 32 * 1024  # W&B's log: LevelDB's record format, 32 KiB blocks of 7-byte-headed chunks


def _wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (n == 0 and kind == 0):  # the block's zero padding
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a whole record, or its last chunk
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_run(wandb_dir: Path, run_id: str) -> dict:
    """Every offline run directory of `run_id` under `wandb_dir` (a resumed run writes a new one)."""
    config, history, tables, summary = {}, [], {}, {}
    runs = sorted(wandb_dir.glob(f"offline-run-*-{run_id}"))
    assert runs, f"no offline W&B run {run_id} under {wandb_dir}"
    for run in runs:
        for r in _wandb_records(run / f"run-{run_id}.wandb"):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                config |= {u.key: json.loads(u.value_json) for u in r.run.config.update if u.key != "_wandb"}
            elif kind == "config":
                config |= {u.key: json.loads(u.value_json) for u in r.config.update if u.key != "_wandb"}
            elif kind == "summary":
                summary |= {
                    u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in r.summary.update
                }
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                step = int(row["_step"])
                history.append((step, {k: v for k, v in row.items() if not k.startswith("_")}))
                if "samples/path" in row:
                    table = json.loads((run / "files" / row["samples/path"]).read_text())
                    tables[step] = [dict(zip(table["columns"], d, strict=True)) for d in table["data"]]
    return {"config": config, "history": history, "tables": tables, "summary": summary}


def trackio_run(store: Path, project: str, run_name: str) -> dict:
    db = sqlite3.connect(store / f"{project}.db")
    try:
        (config,) = db.execute("select config from configs where run_name = ?", (run_name,)).fetchone()
        rows = db.execute("select step, metrics from metrics where run_name = ? order by id", (run_name,))
        history, tables = [], {}
        for step, blob in rows:
            metrics = json.loads(blob)
            if isinstance(metrics.get("samples"), dict):
                tables[step] = metrics.pop("samples")["_value"]
            if metrics:
                history.append((step, metrics))
    finally:
        db.close()
    summary = {
        k.removeprefix("summary/"): v for _, m in history for k, v in m.items() if k.startswith("summary/")
    }
    return {"config": json.loads(config), "history": history, "tables": tables, "summary": summary}


def mlflow_run(tracking_uri: str, run_id: str) -> dict:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    by_step: dict[int, dict] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run_id, key):
            by_step.setdefault(m.step, {}).setdefault(key, []).append(m.value)
    # one (step, metrics) per logged value, so that a value logged twice shows as two rows
    history = []
    for step in sorted(by_step):
        depth = max(len(v) for v in by_step[step].values())
        for i in range(depth):
            history.append((step, {k: v[i] for k, v in by_step[step].items() if i < len(v)}))
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    config = json.loads((artifacts / "config.json").read_text())
    tables = {}
    for f in sorted((artifacts / "samples").glob("step_*.json")):
        table = json.loads(f.read_text())
        tables[int(f.stem.removeprefix("step_"))] = [
            dict(zip(table["columns"], d, strict=True)) for d in table["data"]
        ]
    done = artifacts / "run_summary.json"
    summary = json.loads(done.read_text()) if done.is_file() else {}
    return {
        "config": config,
        "history": history,
        "tables": tables,
        "summary": summary,
        "status": run.info.status,
    }


def per_step(history: list[tuple[int, dict]]) -> dict[str, list[int]]:
    """key -> the steps it was logged at, in order, every time (a duplicate shows twice)."""
    out: dict[str, list[int]] = {}
    for step, metrics in history:
        for k in metrics:
            out.setdefault(k, []).append(step)
    return out
