"""A reward worker: `python -m shared.reward_worker '["spec", ...]'` loads the reward functions, then
answers one JSON line per call on stdout, `{"id", "value"}` or `{"id", "error", "detail"}`, for each
`{"id", "fn", "args"}` line on stdin: a number (a reward function's), or with `"any": true` any JSON value
(an environment step's or a tool's); args that are a JSON object are keyword arguments
(a tool call's). The parent (shared/rewards.py) kills it when a call overruns.

Functions print to stderr: stdout carries only the protocol, so the process's file descriptor 1 is
pointed at stderr once the protocol's own copy of it is taken.
"""

from __future__ import annotations

import json
import numbers
import os
import sys
import traceback


def main(argv: list[str]) -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")

    from shared.rewards import call_function, load_function

    try:
        functions = [load_function(spec, args=None) for spec in json.loads(argv[0])]  # checked by the parent
    except BaseException:
        send({"fatal": traceback.format_exc()})
        return 1
    send({"ready": True})
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            value = call_function(functions[msg["fn"]], msg["args"])
        except BaseException:  # SystemExit and KeyboardInterrupt from user code included
            send({"id": msg["id"], "error": "raised", "detail": traceback.format_exc()})
            continue
        if msg.get("any"):  # an environment step or a tool: any JSON value, the parent checks it
            try:
                send({"id": msg["id"], "value": json.loads(json.dumps(value, allow_nan=False))})
            except (TypeError, ValueError) as e:
                send({"id": msg["id"], "error": "bad_type", "detail": f"it returned {value!r:.200} ({e})"})
        elif isinstance(value, numbers.Real):
            send({"id": msg["id"], "value": float(value)})
        else:
            send({"id": msg["id"], "error": "bad_type", "detail": f"it returned {type(value).__name__}"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
