"""API settings: from a mapping given to :func:`api.create_app`, else the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pagedserve import settings
from pagedserve.settings import opt

MIB = 1024 * 1024


def parse_keys(value: str | None) -> tuple[str, ...]:
    """``"a, b,,c"`` -> ``("a", "b", "c")``."""
    return tuple(k.strip() for k in (value or "").split(",") if k.strip())


@dataclass(frozen=True)
class ApiConfig:
    """The API's options; those with :func:`~pagedserve.settings.opt` are ``pagedserve api``
    flags, and the ones naming a variable also come from the environment."""

    redis_url: str = settings.redis_url_field()
    prefix: str = settings.prefix_field()
    #: API key entries (see :mod:`api.auth`); empty, with no keys file: no authentication. When
    #: set, every endpoint but the health checks and the dashboard's static page needs
    #: ``Authorization: Bearer <key>``.
    api_keys: tuple[str, ...] = field(
        default=(),
        metadata=opt("comma-separated API keys", env=settings.API_KEYS, parse=parse_keys),
    )
    #: A file of more key entries, read once at start.
    api_keys_file: str | None = field(
        default=None, metadata=opt("file of API keys", env=settings.API_KEYS_FILE)
    )
    #: Per-tenant limits (0: none); over them, 429 with ``Retry-After``.
    tenant_max_queued: int = field(
        default=0, metadata=opt("most open jobs per tenant", env=settings.TENANT_MAX_QUEUED)
    )
    tenant_max_file_bytes: int = field(
        default=0,
        metadata=opt("most stored file bytes per tenant", env=settings.TENANT_MAX_FILE_BYTES),
    )
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
    sse_max_s: float = field(
        default=3600.0, metadata=opt("longest a server-sent events response stays open (s)")
    )
    #: Blocking read slice of the events stream; a keep-alive comment is sent after each empty one.
    sse_block_ms: int = 1000
    #: Online requests (``/v1/completions``, ``/v1/chat/completions``) one API process serves at
    #: once ("seats"): each holds a server thread while it waits or streams, so this stays below
    #: the thread count and status endpoints always find a thread (``pagedserve api`` sets it to
    #: ``--threads`` minus :data:`api.server.STATUS_THREADS`).
    online_seats: int = 60
    #: How long an online request waits for a seat before a 429 with ``Retry-After``.
    online_seat_wait_s: float = field(
        default=2.0, metadata=opt("longest an online request waits for a seat (s), then 429")
    )
    #: ``Retry-After`` (seconds) of that 429.
    online_retry_after_s: int = 1
    #: Longest an online request waits for its job to end; then the job is cancelled (504).
    online_timeout_s: float = field(
        default=600.0, metadata=opt("longest an online request waits for its job (s), then 504")
    )

    @classmethod
    def from_env(cls, **overrides: Any) -> ApiConfig:
        """The environment's values (see :mod:`pagedserve.settings`), then ``overrides``."""
        return cls(**settings.values(cls)).with_overrides(overrides)

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
