"""API keys, tenants, and who may see what.

With no keys configured every endpoint is open and nothing is filtered (a warning says so once at
start). With keys (``api_keys`` / ``PAGEDSERVE_API_KEYS``, ``api_keys_file`` /
``PAGEDSERVE_API_KEYS_FILE``), every request needs ``Authorization: Bearer <key>`` except the health
checks (``/healthz``, ``/readyz``) and the dashboard's static page and assets (``/``,
``/dashboard``, ``/static/...``): the page holds no data, and its data calls send the key the user
gives it (``?key=`` once; it is kept in the browser's localStorage).

Key entries (comma-separated in the variable, one per line in the file)::

    team-a:KEY                 key KEY belongs to tenant team-a
    team-a:sha256:<64 hex>     the same, given by the key's SHA-256 digest (no secret stored)
    ops:KEY:admin              an admin key (so is any key of the tenant named ``admin``)
    KEY                        a bare key (no ':'): tenant ``default`` (keys of earlier versions)

Only SHA-256 digests are kept in memory; a presented key is hashed and compared with every digest
in constant time. Jobs, files and batches record the tenant of the key that created them (a field
the server writes); another tenant gets 404 for them and never sees them in a list. Records
without a tenant (written while the API was open, or by a Redis-side client given none) belong to
``default``. An admin key sees and may act on every tenant's records.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from flask import Flask, g, request

from api.config import ApiConfig
from api.errors import ApiError
from pagedserve.tenants import ADMIN_TENANT, DEFAULT_TENANT, check_tenant

log = logging.getLogger(__name__)

OPEN_ENDPOINTS = frozenset({"health.healthz", "health.readyz", "dashboard.page", "static"})


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: a tenant, and whether it may see every tenant's records."""

    tenant: str
    admin: bool = False


@dataclass(frozen=True)
class KeyRing:
    """Accepted keys as (SHA-256 digest, principal) pairs."""

    entries: tuple[tuple[bytes, Principal], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)

    def lookup(self, token: str) -> Principal | None:
        """The key's principal; compares with every digest (constant time, no early exit)."""
        digest = hashlib.sha256(token.encode()).digest()
        found: Principal | None = None
        for d, principal in self.entries:
            if hmac.compare_digest(d, digest):
                found = principal
        return found

    @classmethod
    def parse(cls, entries: Iterable[str]) -> KeyRing:
        return cls(tuple(parse_entry(e) for e in entries))


def parse_entry(entry: str) -> tuple[bytes, Principal]:
    """One key entry (see the module docstring) -> (digest, principal); ``ValueError`` if bad."""
    parts = entry.strip().split(":")
    admin = len(parts) > 2 and parts[-1] == "admin"
    if admin:
        parts = parts[:-1]
    if len(parts) == 1:
        tenant, secret, hashed = DEFAULT_TENANT, parts[0], False
    elif len(parts) == 2:
        tenant, secret, hashed = parts[0], parts[1], False
    elif len(parts) == 3 and parts[1] == "sha256":
        tenant, secret, hashed = parts[0], parts[2], True
    else:
        raise ValueError("an API key entry is 'tenant:key', 'tenant:sha256:<hex>' or 'key'")
    check_tenant(tenant)
    if not secret:
        raise ValueError(f"empty API key for tenant {tenant!r}")
    if hashed:
        try:
            digest = bytes.fromhex(secret)
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"tenant {tenant!r}: sha256 needs 64 hex digits")
    else:
        digest = hashlib.sha256(secret.encode()).digest()
    return digest, Principal(tenant, admin=admin or tenant == ADMIN_TENANT)


def read_key_file(path: str) -> list[str]:
    lines = Path(path).read_text().splitlines()
    return [x.strip() for x in lines if x.strip() and not x.strip().startswith("#")]


def key_ring(config: ApiConfig) -> KeyRing:
    entries = list(config.api_keys)
    if config.api_keys_file:
        entries += read_key_file(config.api_keys_file)
    return KeyRing.parse(entries)


# ----------------------------------------------------------------------------- per request
def caller() -> Principal | None:
    """The request's principal; ``None`` when the API is open (no keys configured)."""
    principal: Principal | None = g.get("principal")
    return principal


def visible(record_tenant: str | None, who: Principal | None) -> bool:
    """Whether ``who`` may see (and act on) a record of ``record_tenant``."""
    if who is None or who.admin:
        return True
    return (record_tenant or DEFAULT_TENANT) == who.tenant


def owned_tenant() -> str | None:
    """The tenant to write on a record the request creates (``None`` when open)."""
    who = caller()
    return who.tenant if who is not None else None


def list_scope() -> str | None:
    """The tenant a listing is restricted to; ``None``: everything (open, or an admin)."""
    who = caller()
    return None if who is None or who.admin else who.tenant


def require_visible(exists: bool, record_tenant: str | None, kind: str, ident: str) -> None:
    """404 (never 403) for a record that is missing or belongs to another tenant."""
    if not exists or not visible(record_tenant, caller()):
        raise ApiError(404, f"{kind} {ident[:140]!r} not found", f"{kind}_not_found")


def _bearer() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def register(app: Flask, config: ApiConfig) -> KeyRing:
    ring = key_ring(config)
    if not ring:
        log.warning(
            "no API keys configured (PAGEDSERVE_API_KEYS / PAGEDSERVE_API_KEYS_FILE): the API is "
            "open to anyone who can reach it, with no tenants"
        )

    @app.before_request
    def _check_key() -> None:
        if not ring or request.endpoint in OPEN_ENDPOINTS or request.method == "OPTIONS":
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
        principal = ring.lookup(token)
        if principal is None:
            raise ApiError(401, "invalid API key", "invalid_api_key", headers=challenge)
        g.principal = principal

    return ring
