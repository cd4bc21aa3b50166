"""One JSON error shape for every 4xx/5xx: ``{"error": {"code", "message", "type", "param"}}``.

The shape is OpenAI's, so its client raises the right exception classes with our message.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from flask import Flask, Request, Response, jsonify
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

from pagedserve import jsonsafe

log = logging.getLogger(__name__)

#: Status -> (code, type) for errors raised by Flask/Werkzeug itself.
_HTTP_CODES: dict[int, tuple[str, str]] = {
    400: ("bad_request", "invalid_request_error"),
    401: ("unauthorized", "authentication_error"),
    403: ("forbidden", "permission_error"),
    404: ("not_found", "not_found_error"),
    405: ("method_not_allowed", "invalid_request_error"),
    409: ("conflict", "invalid_request_error"),
    413: ("payload_too_large", "invalid_request_error"),
    415: ("unsupported_media_type", "invalid_request_error"),
    422: ("validation_error", "invalid_request_error"),
    429: ("rate_limited", "rate_limit_error"),
    500: ("internal_error", "server_error"),
    503: ("unavailable", "server_error"),
}


class ApiError(Exception):
    """Raised by views; rendered as the JSON error with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or _HTTP_CODES.get(status, ("error", "api_error"))[0]
        self.param = param
        self.headers = headers or {}


def quota_error(message: str, retry_after_s: int, code: str = "tenant_limit") -> ApiError:
    """429 with ``Retry-After`` for a tenant limit."""
    return ApiError(429, message, code, headers={"Retry-After": str(max(1, retry_after_s))})


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    default_code, kind = _HTTP_CODES.get(
        status, ("error", "invalid_request_error" if status < 500 else "server_error")
    )
    return {
        "error": {"code": code or default_code, "message": message, "type": kind, "param": param}
    }


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    resp = jsonify(error_body(status, message, code, param))
    resp.status_code = status
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


def describe_validation(e: ValidationError) -> tuple[str, str | None]:
    """A readable one-line message for pydantic errors, and the first offending field."""
    parts: list[str] = []
    first: str | None = None
    for err in e.errors(include_url=False)[:10]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        first = first or (loc or None)
        msg = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{loc}: {msg}" if loc else msg)
    more = len(e.errors()) - len(parts)
    if more > 0:
        parts.append(f"... and {more} more")
    return "invalid request: " + "; ".join(parts), first


def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object, or an :class:`ApiError` that says what is wrong with it."""
    if not request.mimetype or request.mimetype != "application/json":
        raise ApiError(
            415,
            f"expected a JSON body with Content-Type application/json, got "
            f"{request.mimetype or 'no content type'!r}",
        )
    raw = request.get_data(cache=True)
    if not raw:
        raise ApiError(400, "the request body is empty; expected a JSON object", "invalid_json")
    try:
        body = jsonsafe.loads(raw)  # bounded nesting, no lone surrogates (pagedserve.jsonsafe)
    except jsonsafe.JsonInputError as e:
        verb = "is" if e.code == "invalid_json" else "has"
        raise ApiError(400, f"the request body {verb} {e.message}", e.code) from None
    if not isinstance(body, dict):
        raise ApiError(400, f"expected a JSON object, got {type(body).__name__}", "invalid_json")
    return body


def _http_error(e: HTTPException) -> Response:
    status = e.code or 500
    message = e.description or e.name
    if status == 413:
        message = "the request body is too large"
        limit = getattr(e, "limit", None)
        if limit:
            message += f" (limit {limit} bytes)"
    headers = {k: v for k, v in e.get_headers() if k.lower() in ("allow", "www-authenticate")}
    return error_response(status, message, headers=headers)


def count_rejected(code: str) -> None:
    """Count a 429 by code in Redis (``pagedserve:api_rejected_requests`` in ``/metrics``, summed
    over every API process); a Redis error here only loses the count."""
    from api.state import get_state

    state = get_state()
    try:
        state.r.hincrby(state.store.keys.api_rejected, code, 1)
    except redis.RedisError as exc:
        log.warning("could not count a 429: %s", exc)


def register(app: Flask) -> None:
    """Install the handlers that turn every error into the JSON shape."""

    @app.errorhandler(ApiError)
    def _api_error(e: ApiError) -> Response:
        if e.status == 429:
            count_rejected(e.code)
        return error_response(e.status, e.message, e.code, e.param, e.headers)

    @app.errorhandler(ValidationError)
    def _validation(e: ValidationError) -> Response:
        message, param = describe_validation(e)
        return error_response(422, message, "validation_error", param)

    @app.errorhandler(HTTPException)
    def _http(e: HTTPException) -> Response:
        return _http_error(e)

    @app.errorhandler(redis.RedisError)
    def _redis(e: redis.RedisError) -> Response:
        log.warning("redis error: %s", e)
        return error_response(503, f"Redis is unavailable: {type(e).__name__}", "redis_unavailable")

    @app.errorhandler(Exception)
    def _unexpected(e: Exception) -> Response:
        log.exception("unhandled error")
        return error_response(500, f"internal error ({type(e).__name__})")
