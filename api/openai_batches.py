"""OpenAI-compatible files and batches (``/v1/files``, ``/v1/batches``) over
:mod:`pagedserve.batches`; creating a batch sends the ``batches.fan_out`` Celery task by name.

Uploads are checked line by line at once: a file whose lines are not batch requests at all
(invalid JSON, missing ``custom_id``, wrong ``method``/``url``, duplicate ids) is refused with
400; lines that are well formed but carry an invalid request (e.g. a bad ``temperature``) are
accepted and reported in the batch's error file, as OpenAI does.

Files can be listed (``GET /v1/files``: OpenAI's list shape, ``purpose``, ``limit``, ``after``)
and deleted; uploads expire after 30 days (or the form's ``expires_after[seconds]``), a batch's
output files and records after its ``output_expires_after`` (``{"anchor": "created_at",
"seconds": N}``, default 30 days).
"""

from __future__ import annotations

import re
import threading
from typing import Any, Literal

from flask import Blueprint, Response, request, stream_with_context
from pydantic import BaseModel, ConfigDict, Field

from api import auth
from api.errors import ApiError, json_body, quota_error
from api.state import AppState, get_state
from pagedserve.batch_checks import count_lines, limit_errors, too_many
from pagedserve.batches import MAX_TTL_S, MIN_TTL_S, BatchStore, FileObject, check_ttl, parse_window
from pagedserve.openai_format import ENDPOINTS, LineError, parse_file
from pagedserve.schemas import Metadata
from pagedserve.tenants import QuotaExceeded

bp = Blueprint("openai", __name__)

ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
#: Upload errors listed in a 400 answer (the rest are counted).
MAX_LISTED_ERRORS = 5

_celery_lock = threading.Lock()


class ExpiresAfter(BaseModel):
    """OpenAI's ``expires_after`` / ``output_expires_after``: seconds after creation."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"] = "created_at"
    seconds: int = Field(ge=MIN_TTL_S, le=MAX_TTL_S)


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str = "24h"
    metadata: Metadata | None = None
    output_expires_after: ExpiresAfter | None = None


def batches(state: AppState) -> BatchStore:
    store = state.extras.get("batches")
    if store is None:
        store = BatchStore(
            state.store, prefix=state.config.prefix, max_file_bytes=state.config.max_file_bytes
        )
        state.extras["batches"] = store
    return store


def send_fan_out(state: AppState, batch_id: str) -> None:
    """Send ``batches.fan_out`` by name (no running Celery worker needed to send)."""
    with _celery_lock:
        app = state.extras.get("celery")
        if app is None:
            from pagedserve.celery_client import make_sender

            app = make_sender(state.config.redis_url)
            state.extras["celery"] = app
    app.send_task("batches.fan_out", args=[batch_id])


def check_id(kind: str, value: str) -> str:
    if not ID_RE.match(value):
        raise ApiError(404, f"{kind} {value[:140]!r} not found", f"{kind}_not_found")
    return value


def file_json(f: FileObject | dict[str, Any]) -> dict[str, Any]:
    d = f.model_dump() if isinstance(f, FileObject) else f
    return {**d, "status": "processed", "status_details": None}


def _upload_ttl() -> int | None:
    """The upload form's ``expires_after[seconds]`` (anchor ``created_at``), if given."""
    anchor = request.form.get("expires_after[anchor]", "created_at")
    raw = request.form.get("expires_after[seconds]")
    if raw is None:
        return None
    if anchor != "created_at":
        raise ApiError(400, "expires_after[anchor] must be 'created_at'", param="expires_after")
    try:
        return check_ttl(int(raw))
    except ValueError as e:
        raise ApiError(400, f"invalid expires_after[seconds] {raw[:32]!r}: {e}",
                       param="expires_after") from None  # fmt: skip


# ----------------------------------------------------------------------------- files
def _refuse(errs: list[LineError]) -> None:
    listed = "; ".join(f"line {e.line}: {e.code}: {e.message}" for e in errs[:MAX_LISTED_ERRORS])
    more = f" (and {len(errs) - MAX_LISTED_ERRORS} more)" if len(errs) > MAX_LISTED_ERRORS else ""
    raise ApiError(400, f"invalid batch file: {listed}{more}", "invalid_batch_file", "file")


def _upload_errors(text: str, known_models: list[str]) -> None:
    """400 naming the lines at fault: too many requests (counted before parsing any), lines
    that are not batch requests, lines whose model differs from the first line's."""
    over = too_many(count_lines(text))
    if over is not None:
        _refuse([over])
    parsed = parse_file(text, known_models=known_models)
    errs = parsed.format_errors + limit_errors(parsed)
    if errs:
        _refuse(sorted(errs, key=lambda e: e.line))


def require_file(store: BatchStore, file_id: str) -> str:
    """404 unless the file exists and the caller may see it."""
    exists, tenant = store.files.owner(check_id("file", file_id))
    auth.require_visible(exists, tenant, "file", file_id)
    return file_id


def require_batch(store: BatchStore, batch_id: str) -> str:
    exists, tenant = store.owner(check_id("batch", batch_id))
    auth.require_visible(exists, tenant, "batch", batch_id)
    return batch_id


@bp.post("/v1/files")
def upload_file() -> dict[str, Any]:
    if request.mimetype != "multipart/form-data":
        raise ApiError(415, "upload a file as multipart/form-data with fields 'file' and 'purpose'")
    purpose = request.form.get("purpose")
    if purpose != "batch":
        raise ApiError(
            400, f"'purpose' must be 'batch', got {purpose!r}", "invalid_purpose", "purpose"
        )
    upload = request.files.get("file")
    if upload is None:
        raise ApiError(400, "missing the 'file' part", "missing_file", "file")
    data = upload.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(
            400, f"the file is not UTF-8 text: {e}", "invalid_batch_file", "file"
        ) from None
    state = get_state()
    store = batches(state)
    ttl = _upload_ttl()
    _upload_errors(text, store.known_models)
    name = upload.filename or "upload.jsonl"
    limit = state.config.tenant_max_file_bytes
    try:
        f = store.files.create(
            data,
            name,
            purpose="batch",
            expires_after_s=ttl,
            tenant=auth.owned_tenant(),
            tenant_max_bytes=limit,
        )
    except QuotaExceeded as e:
        msg = f"this file would bring the tenant's stored files to {e.used} bytes; the limit is"
        raise quota_error(f"{msg} {e.limit}", state.config.quota_retry_after_s) from None
    except ValueError as e:
        raise ApiError(400, str(e), "invalid_file", "file") from None
    return file_json(f)


@bp.get("/v1/files/<file_id>")
def get_file(file_id: str) -> dict[str, Any]:
    store = batches(get_state())
    f = store.files.get(require_file(store, file_id))
    if f is None:
        raise ApiError(404, f"file {file_id!r} not found", "file_not_found")
    return file_json(f)


@bp.get("/v1/files")
def list_files() -> dict[str, Any]:
    limit = _limit(default=10_000, most=10_000)
    after = request.args.get("after") or None
    purpose = request.args.get("purpose") or None
    files = batches(get_state()).files
    try:
        page = files.list(purpose=purpose, after=after, limit=limit, tenant=auth.list_scope())
    except KeyError:
        raise ApiError(
            404, f"file {after!r} (after) not found", "file_not_found", "after"
        ) from None
    page["data"] = [file_json(f) for f in page["data"]]
    return page


@bp.delete("/v1/files/<file_id>")
def delete_file(file_id: str) -> dict[str, Any]:
    store = batches(get_state())
    if not store.files.delete(require_file(store, file_id)):
        raise ApiError(404, f"file {file_id!r} not found", "file_not_found")
    return {"id": file_id, "object": "file", "deleted": True}


@bp.get("/v1/files/<file_id>/content")
def file_content(file_id: str) -> Response:
    store = batches(get_state())
    pieces = store.files.iter_content(require_file(store, file_id))
    if pieces is None:
        raise ApiError(404, f"file {file_id!r} not found", "file_not_found")
    return Response(stream_with_context(pieces), mimetype="application/jsonl")


# ----------------------------------------------------------------------------- batches
def batch_json(store: BatchStore, batch_id: str) -> dict[str, Any]:
    b = store.get(batch_id)
    if b is None:
        raise ApiError(404, f"batch {batch_id!r} not found", "batch_not_found")
    return b.model_dump(mode="json")


def _check_open_jobs(state: AppState, tenant: str | None) -> None:
    """A tenant at its open-jobs limit cannot start a batch either (429)."""
    limit = state.config.tenant_max_queued
    if tenant is None or limit <= 0:
        return
    n = state.store.tenants.open_jobs(tenant)
    if n >= limit:
        raise quota_error(
            f"tenant {tenant!r} has {n} open jobs; the limit is {limit}: retry later",
            state.config.quota_retry_after_s,
        )


@bp.post("/v1/batches")
def create_batch() -> dict[str, Any]:
    body = BatchCreate.model_validate(json_body(request))
    if body.endpoint not in ENDPOINTS:
        raise ApiError(
            400, f"'endpoint' must be one of {list(ENDPOINTS)}, got {body.endpoint!r}",
            "invalid_endpoint", "endpoint",
        )  # fmt: skip
    try:
        parse_window(body.completion_window)
    except ValueError as e:
        raise ApiError(400, str(e), "invalid_completion_window", "completion_window") from None
    state = get_state()
    store = batches(state)
    exists, owner = store.files.owner(check_id("file", body.input_file_id))
    if not exists or not auth.visible(owner, auth.caller()):
        raise ApiError(
            404, f"file {body.input_file_id!r} not found", "file_not_found", "input_file_id"
        )
    tenant = auth.owned_tenant()
    _check_open_jobs(state, tenant)
    ttl = body.output_expires_after.seconds if body.output_expires_after else None
    try:
        b = store.create(
            body.input_file_id,
            body.endpoint,
            body.completion_window,
            body.metadata,
            output_expires_after_s=ttl,
            tenant=tenant,
        )
    except KeyError:
        raise ApiError(
            404, f"file {body.input_file_id!r} not found", "file_not_found", "input_file_id"
        ) from None
    except ValueError as e:
        raise ApiError(400, str(e), "invalid_input_file", "input_file_id") from None
    send_fan_out(state, b.id)
    return b.model_dump(mode="json")


@bp.get("/v1/batches/<batch_id>")
def get_batch(batch_id: str) -> dict[str, Any]:
    store = batches(get_state())
    return batch_json(store, require_batch(store, batch_id))


def _limit(default: int = 20, most: int = 100) -> int:
    raw = request.args.get("limit", str(default))
    try:
        limit = int(raw)
    except ValueError:
        raise ApiError(400, f"'limit' must be an integer, got {raw!r}", param="limit") from None
    if not 1 <= limit <= most:
        raise ApiError(400, f"'limit' must be between 1 and {most}, got {limit}", param="limit")
    return limit


@bp.get("/v1/batches")
def list_batches() -> dict[str, Any]:
    limit = _limit()
    after = request.args.get("after") or None
    try:
        return batches(get_state()).list(after=after, limit=limit, tenant=auth.list_scope())
    except KeyError:
        raise ApiError(
            404, f"batch {after!r} (after) not found", "batch_not_found", "after"
        ) from None


@bp.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> dict[str, Any]:
    store = batches(get_state())
    b = store.cancel(require_batch(store, batch_id))
    if b is None:
        raise ApiError(404, f"batch {batch_id!r} not found", "batch_not_found")
    return b.model_dump(mode="json")
