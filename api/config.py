"""API settings: from a mapping given to :func:`api.create_app`, else the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pagedserve.keys import DEFAULT_PREFIX, env_prefix
from pagedserve.redis_util import URL_ENV, default_url

#: Comma-separated API keys, each ``tenant:key``, ``tenant:sha256:<hex>`` (optionally ending in
#: ``:admin``) or a bare ``key`` (tenant ``default``); see :mod:`api.auth`. When set, every endpoint
#: but the health checks and the dashboard's static page needs ``Authorization: Bearer <key>``.
API_KEYS_ENV = "PAGEDSERVE_API_KEYS"
#: A file of API keys, one entry per line in the same forms (``#`` comments, blank lines).
API_KEYS_FILE_ENV = "PAGEDSERVE_API_KEYS_FILE"
#: Most open (queued or running) jobs per tenant; 0 or unset: no limit.
TENANT_MAX_QUEUED_ENV = "PAGEDSERVE_TENANT_MAX_QUEUED"
#: Most bytes of stored files per tenant; 0 or unset: no limit.
TENANT_MAX_FILE_BYTES_ENV = "PAGEDSERVE_TENANT_MAX_FILE_BYTES"

MIB = 1024 * 1024


def parse_keys(value: str | None) -> tuple[str, ...]:
    """``"a, b,,c"`` -> ``("a", "b", "c")``."""
    return tuple(k.strip() for k in (value or "").split(",") if k.strip())


@dataclass(frozen=True)
class ApiConfig:
    redis_url: str = field(default_factory=default_url)
    prefix: str = DEFAULT_PREFIX
    #: API key entries (see :data:`API_KEYS_ENV`); empty, with no keys file: no authentication.
    api_keys: tuple[str, ...] = ()
    #: A file of more key entries, read once at start.
    api_keys_file: str | None = None
    #: Per-tenant limits (0: none); over them, 429 with ``Retry-After``.
    tenant_max_queued: int = 0
    tenant_max_file_bytes: int = 0
    #: ``Retry-After`` (seconds) of a 429 for a tenant limit.
    quota_retry_after_s: int = 2
    #: How long the workers' context lengths (from their heartbeats) are cached per process.
    context_cache_s: float = 2.0
    #: Largest request body (file uploads, with multipart overhead); Flask answers 413 above it.
    max_content_length: int = 65 * MIB
    #: Largest uploaded batch file (files live in Redis memory).
    max_file_bytes: int = 64 * MIB
    #: Largest body of every endpoint other than file uploads.
    max_json_bytes: int = 1 * MIB
    #: A heartbeat older than this (Redis clock) does not count for /readyz.
    heartbeat_fresh_s: float = 10.0
    #: A busy worker whose step counter has not moved for this long does not count for /readyz.
    stall_s: float = 15.0
    #: How long one server-sent events response may stay open.
    sse_max_s: float = 3600.0
    #: Blocking read slice of the events stream; a keep-alive comment is sent after each empty one.
    sse_block_ms: int = 1000
    #: Online requests (``/v1/completions``, ``/v1/chat/completions``) one API process serves at
    #: once ("seats"): each holds a server thread while it waits or streams, so this stays below
    #: the thread count and status endpoints always find a thread (``pagedserve api`` sets it to
    #: ``--threads`` minus :data:`api.server.STATUS_THREADS`).
    online_seats: int = 60
    #: How long an online request waits for a seat before a 429 with ``Retry-After``.
    online_seat_wait_s: float = 2.0
    #: ``Retry-After`` (seconds) of that 429.
    online_retry_after_s: int = 1
    #: Longest an online request waits for its job to end; then the job is cancelled (504).
    online_timeout_s: float = 600.0

    @classmethod
    def from_env(cls, **overrides: Any) -> ApiConfig:
        base = cls(
            redis_url=os.environ.get(URL_ENV) or default_url(),
            prefix=env_prefix(),
            api_keys=parse_keys(os.environ.get(API_KEYS_ENV)),
            api_keys_file=os.environ.get(API_KEYS_FILE_ENV) or None,
            tenant_max_queued=int(os.environ.get(TENANT_MAX_QUEUED_ENV) or 0),
            tenant_max_file_bytes=int(os.environ.get(TENANT_MAX_FILE_BYTES_ENV) or 0),
        )
        return base.with_overrides(overrides)

    def with_overrides(self, overrides: Mapping[str, Any]) -> ApiConfig:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown API config keys: {unknown}; known: {sorted(known)}")
        values = dict(overrides)
        if isinstance(values.get("api_keys"), str):
            values["api_keys"] = parse_keys(values["api_keys"])
        elif values.get("api_keys") is not None:
            values["api_keys"] = tuple(values["api_keys"])
        return replace(self, **values)


def as_config(config: ApiConfig | Mapping[str, Any] | None) -> ApiConfig:
    if isinstance(config, ApiConfig):
        return config
    return ApiConfig.from_env(**dict(config or {}))
