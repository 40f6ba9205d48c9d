"""The API keys in front of the HTTP endpoints: a refused request answers in OpenAI's error
shape (service.api.openai.errors), whatever endpoint it asked for."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from service.api.access.gate import Gate, Principal, bearer, client_address
from service.api.observability.metrics import Metrics
from service.api.openai.errors import OpenAIError, refusal_error
from service.api.refusal import Refusal

Endpoint = Callable[[Request], Awaitable[Response]]


class Guard:
    def __init__(self, gate: Gate, metrics: Metrics) -> None:
        self.gate = gate
        self.metrics = metrics  # counts each refusal under its reason

    def __call__(self, endpoint: Endpoint, *, admin: bool = False) -> Endpoint:
        """`endpoint` behind the API keys (an admin key if `admin`): 401 without a valid key,
        403 for a key that is not an admin's, 429 while the address is refused. The
        caller's principal is `principal_of(request)`."""

        async def guarded(request: Request) -> Response:
            try:
                principal = self.gate.authenticate(bearer(request.headers), client_address(request))
            except Refusal as refusal:
                self.metrics.errors.labels(refusal.reason.value).inc()
                return refusal_error(refusal).response()
            if admin and not principal.admin:
                error = OpenAIError(403, "this endpoint needs an admin key", "permission_denied")
                self.metrics.errors.labels(error.code).inc()
                return error.response()
            request.state.principal = principal
            return await endpoint(request)

        return guarded


def principal_of(request: Request) -> Principal:
    """Whom a guarded request speaks for."""
    principal: Principal = request.state.principal
    return principal
