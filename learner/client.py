"""The learner's HTTP client for the rollout server. Requests and responses are the models of
shared/protocol.py; any non-2xx answer raises ServerError with the server's message."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import TypeVar

import httpx
from pydantic import BaseModel

from shared import protocol as P

M = TypeVar("M", bound=BaseModel)


class ServerError(RuntimeError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerUnavailable(ServerError):
    pass


class ServedPolicyError(ServerError):
    """The server's samples of a version are not that version's: it does not serve what was published
    (learner/train.py, the served-policy check)."""


class Interrupted(RuntimeError):
    """A stop was requested (SIGTERM) while waiting for an unreachable server."""


# Answers that mean "not there right now" rather than "no": a proxy in front of a restarting server, and
# the server's own 503 (shutting down, or its engine failed: either way it is being restarted).
_TRANSIENT_STATUS = (502, 503, 504)


class RolloutClient:
    """`retry_s` > 0: a request the server cannot take (connection refused or reset, timeout, 502-504)
    is retried with exponential backoff for up to `retry_s` seconds, each failure logged, before
    ServerUnavailable is raised; `should_stop` (polled between tries) ends the wait early with
    Interrupted. 4xx answers are never retried. `retry_s` = 0 (the default) fails at once."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 120.0,
        retry_s: float = 0.0,
        log=print,
        should_stop=lambda: False,
    ):
        self.url, self.token = url.rstrip("/"), token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)
        self.retry_s, self._log, self._should_stop = retry_s, log, should_stop
        self.retries = 0  # failed tries that were retried, over the client's life

    def _send(self, what: str, make_request) -> httpx.Response:
        """Send with the retry policy above; return the final response (any status)."""
        deadline, delay, down_since = time.monotonic() + self.retry_s, 1.0, None
        while True:
            try:
                r = make_request()
                if r.status_code not in _TRANSIENT_STATUS:
                    if down_since is not None:
                        self._log(f"rollout server back after {time.monotonic() - down_since:.0f} s")
                    return r
                error = f"HTTP {r.status_code}"
            except httpx.TransportError as e:
                error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if self.retry_s <= 0:
                raise ServerUnavailable(f"{what} at {self.url}: {error}")
            now = time.monotonic()
            down_since = down_since if down_since is not None else now
            if now + delay > deadline:
                raise ServerUnavailable(
                    f"{what} at {self.url}: no answer for {now - down_since:.0f} s ({error}); gave up "
                    f"after learner.server_retry_s={self.retry_s:.0f}. Is the rollout server running?"
                )
            if self._should_stop():
                raise Interrupted(f"stop requested while the rollout server was unreachable ({what})")
            self.retries += 1
            self._log(f"WARNING: {what} at {self.url} failed ({error}); retrying in {delay:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 30.0)

    def close(self) -> None:
        self._http.close()

    def _check(self, r: httpx.Response, what: str) -> httpx.Response:
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ServerError(f"{what} at {self.url}: HTTP {r.status_code}: {detail}", r.status_code)
        return r

    def _post(self, path: str, body: BaseModel | None, out: type[M], timeout: float | None = None) -> M:
        kwargs = {"timeout": timeout} if timeout is not None else {}
        content = body.model_dump_json() if body is not None else None
        r = self._send(
            f"POST {path}",
            lambda: self._http.post(
                path, content=content, headers={"content-type": "application/json"}, **kwargs
            ),
        )
        return out.model_validate_json(self._check(r, f"POST {path}").content)

    def metrics(self) -> dict[str, float]:
        """Per-server figures for the step's metrics: none for one server (ServerPool has them)."""
        return {}

    def health(self) -> P.Health:
        r = self._send("GET /health", lambda: self._http.get("/health"))
        return P.Health.model_validate_json(self._check(r, "GET /health").content)

    def wait_ready(self, timeout_s: float, log=print) -> P.Health:
        """Poll /health with backoff until it answers, for at most timeout_s; check the protocol version."""
        deadline, delay, last = time.monotonic() + timeout_s, 0.5, "no answer"
        announced = False
        while True:
            try:  # one try per round: this loop is the backoff
                r = self._http.get("/health")
                health = P.Health.model_validate_json(self._check(r, "GET /health").content)
                break
            except (httpx.TransportError, ServerError) as e:
                last = str(e) or type(e).__name__
            if time.monotonic() + delay > deadline:
                raise ServerUnavailable(
                    f"rollout server at {self.url} did not become healthy within {timeout_s:.0f} s "
                    f"(last error: {last}). Is it running, and is learner.server_urls right?"
                )
            if not announced:
                log(f"waiting for the rollout server at {self.url} (up to {timeout_s:.0f} s) ...")
                announced = True
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
        if health.protocol_version != P.PROTOCOL_VERSION:
            raise ServerError(
                f"protocol mismatch: server at {self.url} speaks v{health.protocol_version}, "
                f"this learner v{P.PROTOCOL_VERSION}; run the same tandem version on both sides"
            )
        return health

    def pull(self, max_groups: int, wait_s: float, request_id: str | None = None) -> P.PullResponse:
        """`request_id` (default: a new one) is sent again on each retry: a retry whose first answer was lost
        gets the same lease back."""
        body = P.PullRequest(max_groups=max_groups, wait_s=wait_s, request_id=request_id or uuid.uuid4().hex)
        return self._post("/v1/groups/pull", body, P.PullResponse, timeout=wait_s + 60.0)

    def ack(self, lease_id: str) -> P.AckResponse:
        return self._post("/v1/groups/ack", P.AckRequest(lease_id=lease_id), P.AckResponse)

    def release(self, lease_id: str) -> P.ReleaseResponse:
        return self._post("/v1/groups/release", P.ReleaseRequest(lease_id=lease_id), P.ReleaseResponse)

    def release_pull(self, request_id: str) -> P.ReleaseResponse:
        """Release whatever lease a pull of `request_id` got (0 groups when it got none)."""
        return self._post("/v1/groups/release", P.ReleaseRequest(request_id=request_id), P.ReleaseResponse)

    def publish(self, version: int, folder: str | Path) -> P.AdapterPublished:
        """Upload adapter_config.json + adapter_model.safetensors: no shared filesystem needed."""
        folder = Path(folder)
        config = (folder / P.ADAPTER_CONFIG_FILE).read_bytes()
        weights = (folder / P.ADAPTER_WEIGHTS_FILE).read_bytes()
        tries = 0

        def post() -> httpx.Response:
            nonlocal tries
            tries += 1
            return self._http.post(
                "/v1/adapters",
                data={P.UPLOAD_VERSION_FIELD: str(version)},
                files={
                    P.UPLOAD_CONFIG_FIELD: (P.ADAPTER_CONFIG_FILE, config),
                    P.UPLOAD_WEIGHTS_FIELD: (P.ADAPTER_WEIGHTS_FILE, weights),
                },
            )

        r = self._send("POST /v1/adapters", post)
        if r.status_code == 409 and tries > 1 and self.health().policy_version == version:
            # A retried upload whose first try went through before the connection dropped.
            return P.AdapterPublished(version=version, name=P.adapter_name(version))
        return P.AdapterPublished.model_validate_json(self._check(r, "POST /v1/adapters").content)

    def sleep(self) -> P.SleepState:
        return self._post("/v1/sleep", None, P.SleepState)

    def wake(self) -> P.SleepState:
        return self._post("/v1/wake", None, P.SleepState)

    def pause_production(self) -> P.ProductionState:
        """No new generation on the server until resume_production (what is in flight is queued)."""
        return self._post("/v1/production/pause", None, P.ProductionState)

    def resume_production(self) -> P.ProductionState:
        return self._post("/v1/production/resume", None, P.ProductionState)

    def generate(self, request: P.GenerateRequest, timeout: float | None = None) -> P.GenerateResponse:
        return self._post("/v1/generate", request, P.GenerateResponse, timeout=timeout)

    def score(self, prompt: list[int], completion: list[int], version: int | None = None) -> P.ScoreResponse:
        req = P.ScoreRequest(prompt_token_ids=prompt, completion_token_ids=completion, version=version)
        return self._post("/v1/score", req, P.ScoreResponse)
