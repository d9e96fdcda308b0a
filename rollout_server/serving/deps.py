"""What every router's handlers depend on: the app's Server (serving/app.py), built in its lifespan."""

from __future__ import annotations

from fastapi import Request


def server_of(request: Request):
    return request.app.state.server
