"""The request guard, driven as plain ASGI: a refused request is answered from its headers alone, before
the app (which would spool the body) is called or a byte of the body is read."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollout_server.serving.guard import RequestGuard

LIMIT = 1000


class Recorder:
    """An inner app that reads the whole body, as FastAPI does before it runs a route."""

    def __init__(self):
        self.called = False
        self.body = b""

    async def __call__(self, scope, receive, send):
        self.called = True
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                status = 400  # what FastAPI answers to a body it could not finish reading
                break
            self.body += m.get("body", b"")
            if not m.get("more_body"):
                status = 200
                break
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _run(headers: dict[str, str], chunks: list[bytes], method="POST", token="secret"):
    inner = Recorder()
    guard = RequestGuard(inner, token=token, limit_for=lambda path: LIMIT)
    scope = {
        "type": "http",
        "method": method,
        "path": "/v1/generate",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    pending = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    reads, sent = [0], []

    async def receive():
        reads[0] += 1
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, body, inner, reads[0]


AUTH = {"Authorization": "Bearer secret"}


@pytest.mark.parametrize(
    ("headers", "status", "detail"),
    [
        ({"Content-Length": "400000000"}, 401, "missing 'Authorization: Bearer <token>'"),
        ({"Authorization": "Bearer wrong", "Content-Length": "10"}, 403, "wrong bearer token"),
        ({**AUTH, "Content-Length": "400000000"}, 413, "request body of 400000000 bytes exceeds"),
        ({**AUTH, "Content-Length": "12abc"}, 400, "invalid Content-Length"),
    ],
)
def test_refused_from_the_headers_without_reading_the_body(headers, status, detail):
    got, body, inner, reads = _run(headers, [b"x" * 10])
    assert got == status and detail in json.loads(body)["detail"]
    assert not inner.called and reads == 0


def test_a_chunked_body_past_the_limit_is_cut_off_with_413():
    got, body, inner, reads = _run(AUTH, [b"x" * 600, b"x" * 600, b"x" * 600])
    assert got == 413 and "exceeds this endpoint's 1000 bytes" in json.loads(body)["detail"]
    assert reads == 2  # the third chunk was never asked for
    assert len(inner.body) == 600  # the app saw no byte past the limit


def test_a_good_request_passes_whole():
    got, body, inner, _ = _run({**AUTH, "Content-Length": "700"}, [b"x" * 300, b"x" * 400])
    assert (got, body, inner.body) == (200, b"ok", b"x" * 700)


def test_gets_stay_open_and_no_token_means_no_auth():
    assert _run({}, [b""], method="GET")[0] == 200
    assert _run({"Content-Length": "5"}, [b"hello"], token=None)[0] == 200
    assert _run({"Content-Length": "5000"}, [b"hello"], token=None)[0] == 413  # limits hold without a token
