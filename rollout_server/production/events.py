"""The server's event log: append-only JSONL of what it did and when (groups, leases, acks, sleep, wake,
publish). Tests read it to check ordering (no group produced while asleep, each lease acked once)."""

from __future__ import annotations

import json
import time
from pathlib import Path


class EventLog:
    def __init__(self, path: Path):
        self.path = path

    def write(self, event: str, **fields) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")
