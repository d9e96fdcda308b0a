"""What every request passes before the app reads a byte of its body: the bearer token, and a size limit.

FastAPI parses a route's body (spooling uploads to temp files) before it runs the route's dependencies,
so a check there comes too late: a 400 MB upload without a token was written to disk before its 401.
This is plain ASGI middleware instead. For a POST it checks `Authorization` first (401/403), then
`Content-Length` against the path's limit (413 without reading the body), and counts the bytes of a body
sent without a length (chunked), answering 413 once it passes the limit. GET and HEAD stay open.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable

from rollout_server.serving.openai_schema import error_body, is_openai_path


def _answer(status: int, detail: str, extra_headers: list[tuple[bytes, bytes]] = (), path: str = ""):
    """A refusal: tandem's {"detail": ...}, or OpenAI's error schema on the OpenAI-compatible paths (the
    `openai` SDK reads the message from there)."""
    body = json.dumps(error_body(status, detail) if is_openai_path(path) else {"detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),  # the rest of a refused body is not read: end the connection
        *extra_headers,
    ]
    return [
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": body},
    ]


class RequestGuard:
    def __init__(self, app, token: str | None, limit_for: Callable[[str], int]):
        self.app = app
        self.token = token.encode() if token else None
        self.limit_for = limit_for  # path -> the most body bytes a request to it may carry

    def _refusal(self, headers: dict[bytes, bytes], limit: int, path: str):
        if self.token is not None:
            auth = headers.get(b"authorization", b"")
            if not auth.lower().startswith(b"bearer "):
                return _answer(
                    401, "missing 'Authorization: Bearer <token>'", [(b"www-authenticate", b"Bearer")], path
                )
            if not hmac.compare_digest(auth[7:].strip(), self.token):
                return _answer(403, "wrong bearer token", path=path)
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit() or len(length) > 18:
                return _answer(400, "invalid Content-Length", path=path)
            if int(length) > limit:
                return _answer(
                    413, f"request body of {int(length)} bytes exceeds this endpoint's {limit}", path=path
                )
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrived"] = time.perf_counter()  # request.state.arrived: timings
        limit = self.limit_for(scope["path"])
        refusal = self._refusal(dict(scope["headers"]), limit, scope["path"])
        if refusal is not None:
            for message in refusal:
                await send(message)
            return None

        seen, over = 0, False

        async def counted_receive():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked body past the limit: stop reading, the app sees a disconnect
                    over = True
                    return {"type": "http.disconnect"}
            return message

        started = False

        async def guarded_send(message):
            nonlocal started
            if over:  # whatever the app answers to the cut-off body, the answer is 413
                if not started:
                    started = True
                    for m in _answer(
                        413, f"request body exceeds this endpoint's {limit} bytes", path=scope["path"]
                    ):
                        await send(m)
                return
            await send(message)

        await self.app(scope, counted_receive, guarded_send)
