"""The Starlette app: /v1/chat (WebSocket), the OpenAI-compatible /v1/chat/completions and
/v1/models (and vLLM's /tokenize and /detokenize), /health, /v1/stats, /v1/kv and /metrics;
the browser chat page at / and the live view of the KV pools at /kv, and their icon at
/favicon.ico."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import redis.exceptions
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from service.api.access.guard import Guard
from service.api.observability import kv_view, stats
from service.api.openai.routes import OpenAIRoutes, http_error
from service.api.ws.connection import ChatConnection
from service.engine.values import EngineDeadError
from service.server.hub import Hub

_json = msgspec.json.Encoder()
WEB = Path(__file__).with_name("web")
# A KV snapshot waits for the step in flight to end; a step takes well under this.
KV_SNAPSHOT_TIMEOUT_S = 10.0
MAX_LAG_WINDOW_S = 600.0  # the loop-lag monitor keeps this long (LoopLagMonitor.keep_s)
# The pages' icon, a speech bubble: without one every page view logs a 404 for /favicon.ico.
FAVICON_SVG = (
    b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
    b'<rect width="32" height="32" rx="7" fill="#2563eb"/>'
    b'<path d="M8 9h16a2 2 0 0 1 2 2v8a2 2 0 0 1-2 2h-9l-5 4v-4H8a2 2 0 0 1-2-2v-8a2 2 0 0 1 2-2z"'
    b' fill="#fff"/></svg>'
)


def create_app(hub: Hub) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await hub.start()
        try:
            yield
        finally:
            await hub.stop()

    async def chat(websocket: WebSocket) -> None:
        await ChatConnection(websocket, hub.chat_parts()).serve()

    async def health(request: Request) -> Response:
        problems = []
        if hub.engine_failure is not None:
            problems.append(f"engine failed: {hub.engine_failure!r}")
        if hub.admission.draining:
            problems.append("shutting down")
        try:
            await hub.store.check_writes()
        except redis.exceptions.RedisError as exc:
            problems.append(f"redis: {exc}")
        if problems:
            return JSONResponse({"status": "unavailable", "problems": problems}, status_code=503)
        return JSONResponse({"status": "ok", "model": hub.engine.model_id})

    async def stats_json(request: Request) -> Response:
        try:
            window = float(request.query_params.get("lag_window_s", "60"))
        except ValueError:
            window = math.nan
        if not 0 < window <= MAX_LAG_WINDOW_S:  # refuses nan and inf too
            return JSONResponse(
                {"error": f"lag_window_s must be a number of seconds in (0, {MAX_LAG_WINDOW_S:g}]"},
                status_code=400,
            )
        body = _json.encode(stats.collect(hub.engine, hub.admission, hub.lag, lag_window_s=window))
        return Response(body, media_type="application/json")

    async def kv_json(request: Request) -> Response:
        try:
            max_sequences = int(request.query_params.get("max_sequences", "256"))
        except ValueError:
            max_sequences = -1
        if not 0 <= max_sequences <= 10_000:
            return JSONResponse(
                {"error": "max_sequences must be an integer in 0..10000"}, status_code=400
            )
        try:
            snapshot = await asyncio.wait_for(
                hub.engine.kv_snapshot(max_sequences), KV_SNAPSHOT_TIMEOUT_S
            )
        except (EngineDeadError, TimeoutError) as exc:
            return JSONResponse({"error": f"no KV snapshot: {exc!r}"}, status_code=503)
        body = _json.encode(kv_view.view(snapshot, hub.engine.stats().kv_tier))
        return Response(body, media_type="application/json")

    openai = OpenAIRoutes(hub.openai_parts)
    guarded = Guard(hub.gate, hub.metrics)
    chat_page = (WEB / "chat.html").read_text()
    kv_page = (WEB / "kv.html").read_text()

    async def index(request: Request) -> Response:
        return HTMLResponse(chat_page)

    async def kv_page_view(request: Request) -> Response:
        return HTMLResponse(kv_page)

    # The pages' scripts, read once: the theme, and the vendored markdown renderer and
    # sanitizer (web/vendor/README.md). Only these names are served; nothing else of the tree.
    scripts = {
        name: (WEB / name).read_bytes()
        for name in ("theme.js", "vendor/markdown-it.min.js", "vendor/purify.min.js")
    }

    async def script(request: Request) -> Response:
        body = scripts.get(request.url.path.removeprefix("/"))
        if body is None:
            raise HTTPException(404)
        return Response(
            body, media_type="text/javascript", headers={"Cache-Control": "max-age=3600"}
        )

    async def favicon(request: Request) -> Response:
        # An SVG under the name browsers ask for by themselves (they go by the media type).
        return Response(
            FAVICON_SVG, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"}
        )

    async def metrics(request: Request) -> Response:
        return Response(hub.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return Starlette(
        routes=[
            WebSocketRoute("/v1/chat", chat),
            Route("/health", health),
            # API keys, when on (service.api.access.gate): an admin's for the server's insides, any
            # for the model; /health and /metrics stay open (probes and scrapers).
            Route("/v1/stats", guarded(stats_json, admin=True)),
            Route("/v1/kv", guarded(kv_json, admin=True)),
            Route("/v1/chat/completions", guarded(openai.create), methods=["POST"]),
            Route("/v1/completions", guarded(openai.create_text), methods=["POST"]),
            Route("/v1/responses", guarded(openai.create_response), methods=["POST"]),
            Route("/v1/responses/{response_id}", guarded(openai.get_response)),
            Route(
                "/v1/responses/{response_id}",
                guarded(openai.delete_response),
                methods=["DELETE"],
            ),
            Route("/v1/models", guarded(openai.models)),
            Route("/v1/models/{name:path}", guarded(openai.model)),
            Route("/tokenize", guarded(openai.tokenize), methods=["POST"]),  # vLLM's
            Route("/detokenize", guarded(openai.detokenize), methods=["POST"]),
            Route("/metrics", metrics),
            Route("/", index),
            Route("/kv", kv_page_view),
            Route("/theme.js", script),
            Route("/vendor/{name}", script),
            Route("/favicon.ico", favicon),
        ],
        lifespan=lifespan,
        # Unknown routes and methods, and errors no endpoint caught, answer in OpenAI's
        # error shape under /v1/.
        exception_handlers={404: http_error, 405: http_error, Exception: http_error},
        middleware=_cors(hub.config.cors_allowed_origins),
    )


def _cors(origins: tuple[str, ...]) -> list[Middleware]:
    """Browsers' cross-origin calls to the HTTP API from `origins` (preflights answered);
    none: no CORS headers at all, so a page elsewhere cannot read the API's answers."""
    if not origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],  # the SDKs send headers of their own (x-stainless-*)
            max_age=600,
        )
    ]
