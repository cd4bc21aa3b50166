"""Optional bearer-token authentication.

With no keys configured every endpoint is open. With keys (``api_keys`` in the config or
``PAGEDSERVE_API_KEYS``), every request needs ``Authorization: Bearer <key>`` except the health
checks (``/healthz``, ``/readyz``) and the dashboard's static page and assets (``/``,
``/dashboard``, ``/static/...``): the page holds no data, and its data calls (``/v1/pool``,
``/v1/workers``, ``/v1/queues``) send the key the user gives it (``?key=`` once; it is kept in the
browser's localStorage).
"""

from __future__ import annotations

import hmac

from flask import Flask, request

from api.errors import ApiError
from api.state import get_state

OPEN_ENDPOINTS = frozenset({"health.healthz", "health.readyz", "dashboard.page", "static"})


def _bearer() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_ok(token: str, keys: tuple[str, ...]) -> bool:
    """Constant-time comparison against every accepted key."""
    found = False
    for k in keys:
        found |= hmac.compare_digest(token.encode(), k.encode())
    return found


def register(app: Flask) -> None:
    @app.before_request
    def _check_key() -> None:
        keys = get_state().config.api_keys
        if not keys or request.endpoint in OPEN_ENDPOINTS or request.method == "OPTIONS":
            return
        token = _bearer()
        challenge = {"WWW-Authenticate": 'Bearer realm="pagedserve"'}
        if token is None:
            raise ApiError(
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                "missing_api_key",
                headers=challenge,
            )
        if not key_ok(token, keys):
            raise ApiError(401, "invalid API key", "invalid_api_key", headers=challenge)
