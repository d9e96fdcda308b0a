"""The learner's HTTP client for the rollout server. Requests and responses are the models of
shared/protocol.py; any non-2xx answer raises ServerError with the server's message."""

from __future__ import annotations

import time
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


class RolloutClient:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 120.0):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

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
        r = self._http.post(path, content=content, headers={"content-type": "application/json"}, **kwargs)
        return out.model_validate_json(self._check(r, f"POST {path}").content)

    def health(self) -> P.Health:
        return P.Health.model_validate_json(self._check(self._http.get("/health"), "GET /health").content)

    def wait_ready(self, timeout_s: float, log=print) -> P.Health:
        """Poll /health with backoff until it answers, for at most timeout_s; check the protocol version."""
        deadline, delay, last = time.monotonic() + timeout_s, 0.5, "no answer"
        announced = False
        while True:
            try:
                health = self.health()
                break
            except (httpx.TransportError, ServerError) as e:
                last = str(e) or type(e).__name__
            if time.monotonic() + delay > deadline:
                raise ServerUnavailable(
                    f"rollout server at {self.url} did not become healthy within {timeout_s:.0f} s "
                    f"(last error: {last}). Is it running, and is learner.server_url right?"
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

    def pull(self, max_groups: int, wait_s: float) -> P.PullResponse:
        return self._post(
            "/v1/groups/pull",
            P.PullRequest(max_groups=max_groups, wait_s=wait_s),
            P.PullResponse,
            timeout=wait_s + 60.0,
        )

    def ack(self, lease_id: str) -> P.AckResponse:
        return self._post("/v1/groups/ack", P.AckRequest(lease_id=lease_id), P.AckResponse)

    def release(self, lease_id: str) -> P.ReleaseResponse:
        return self._post("/v1/groups/release", P.ReleaseRequest(lease_id=lease_id), P.ReleaseResponse)

    def publish(self, version: int, folder: str | Path) -> P.AdapterPublished:
        """Upload adapter_config.json + adapter_model.safetensors: no shared filesystem needed."""
        folder = Path(folder)
        with (
            (folder / "adapter_config.json").open("rb") as cfg,
            (folder / "adapter_model.safetensors").open("rb") as w,
        ):
            r = self._http.post(
                "/v1/adapters",
                data={"version": str(version)},
                files={
                    "adapter_config": ("adapter_config.json", cfg),
                    "adapter_model": ("adapter_model.safetensors", w),
                },
            )
        return P.AdapterPublished.model_validate_json(self._check(r, "POST /v1/adapters").content)

    def sleep(self) -> P.SleepState:
        return self._post("/v1/sleep", None, P.SleepState)

    def wake(self) -> P.SleepState:
        return self._post("/v1/wake", None, P.SleepState)

    def generate(self, request: P.GenerateRequest, timeout: float | None = None) -> P.GenerateResponse:
        return self._post("/v1/generate", request, P.GenerateResponse, timeout=timeout)

    def score(self, prompt: list[int], completion: list[int], version: int | None = None) -> P.ScoreResponse:
        req = P.ScoreRequest(prompt_token_ids=prompt, completion_token_ids=completion, version=version)
        return self._post("/v1/score", req, P.ScoreResponse)
