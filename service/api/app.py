"""The Starlette app: /v1/chat (WebSocket), /health, /v1/stats and /metrics."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import msgspec
import redis.exceptions
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from service.api import stats
from service.api.connection import ChatConnection
from service.api.service import ChatService

_json = msgspec.json.Encoder()


def create_app(service: ChatService) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    async def chat(websocket: WebSocket) -> None:
        await ChatConnection(websocket, service).serve()

    async def health(request: Request) -> Response:
        problems = []
        if service.draining:
            problems.append("shutting down")
        try:
            await service.store.ping()
        except redis.exceptions.RedisError as exc:
            problems.append(f"redis: {exc}")
        if problems:
            return JSONResponse({"status": "unavailable", "problems": problems}, status_code=503)
        return JSONResponse({"status": "ok", "model": service.model_id})

    async def stats_json(request: Request) -> Response:
        try:
            window = float(request.query_params.get("lag_window_s", "60"))
        except ValueError:
            return JSONResponse({"error": "lag_window_s must be a number"}, status_code=400)
        body = _json.encode(stats.collect(service, lag_window_s=window))
        return Response(body, media_type="application/json")

    async def metrics(request: Request) -> Response:
        return Response(
            service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    return Starlette(
        routes=[
            WebSocketRoute("/v1/chat", chat),
            Route("/health", health),
            Route("/v1/stats", stats_json),
            Route("/metrics", metrics),
        ],
        lifespan=lifespan,
    )
