"""``GET /openapi.json``: a hand-written OpenAPI 3.1 document of this API."""

from __future__ import annotations

from typing import Any

from flask import Blueprint

from pagedserve.schemas import JobRecord, JobRequest

bp = Blueprint("openapi", __name__)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ERR = {"$ref": "#/components/responses/Error"}
ID = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
OBJ = {"type": "object"}


def _op(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"summary": summary, "responses": {**responses, "4XX": ERR, "5XX": ERR}}
    out.update(extra)
    return out


def _body(schema: dict[str, Any], media: str = "application/json") -> dict[str, Any]:
    return {"required": True, "content": {media: {"schema": schema}}}


def paths() -> dict[str, Any]:
    open_ = {"security": []}
    return {
        "/healthz": {"get": _op("The process is up", {"200": _json(OBJ)}, **open_)},
        "/readyz": {
            "get": _op(
                "Redis reachable and a worker fresh and advancing (or idle)",
                {"200": _json(OBJ), "503": _json(OBJ, "Not ready")},
                **open_,
            )
        },
        "/v1/jobs": {
            "post": _op(
                "Queue a generation job",
                {"202": _json(_ref("JobAccepted"), "Queued")},
                requestBody=_body(_ref("JobRequest")),
            )
        },
        "/v1/jobs/{id}": {
            "parameters": ID,
            "get": _op("A job's status, progress, result or error", {"200": _json(_ref("Job"))}),
            "delete": _op("Cancel a job", {"200": _json(_ref("JobAccepted"))}),
        },
        "/v1/jobs/{id}/events": {
            "parameters": ID,
            "get": _op(
                "Server-sent events (delta, restart, end) until the job ends; resumes after "
                "Last-Event-ID",
                {
                    "200": {
                        "description": "event stream; each data line is a DeltaEvent",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}},
                    }
                },
            ),
        },
        "/v1/pool": {"get": _op("KV pool occupancy per live worker", {"200": _json(OBJ)})},
        "/v1/workers": {"get": _op("Live workers and their running jobs", {"200": _json(OBJ)})},
        "/v1/queues": {"get": _op("Queue depth per priority", {"200": _json(OBJ)})},
        "/v1/tenants": {
            "get": _op(
                "Queue depth, tokens and file bytes per tenant (own; all for an admin)",
                {"200": _json(OBJ)},
            )
        },
        "/metrics": {
            "get": _op(
                "Prometheus text exposition",
                {"200": {"description": "metrics", "content": {"text/plain": {}}}},
            )
        },
        "/v1/files": {
            "post": _op(
                "Upload a batch input file (OpenAI files API, purpose=batch)",
                {"200": _json(_ref("File"))},
                requestBody=_body(
                    {
                        "type": "object",
                        "required": ["file", "purpose"],
                        "properties": {
                            "file": {"type": "string", "contentMediaType": "application/jsonl"},
                            "purpose": {"type": "string", "enum": ["batch"]},
                        },
                    },
                    "multipart/form-data",
                ),
            ),
            "get": _op(
                "List files, newest first (OpenAI list shape)",
                {"200": _json(OBJ)},
                parameters=[
                    {"name": "purpose", "in": "query", "schema": {"type": "string"}},
                    {"name": "after", "in": "query", "schema": {"type": "string"}},
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 10000},
                    },
                ],
            ),
        },
        "/v1/files/{id}": {
            "parameters": ID,
            "get": _op("A file", {"200": _json(_ref("File"))}),
            "delete": _op("Delete a file", {"200": _json(OBJ)}),
        },
        "/v1/files/{id}/content": {
            "parameters": ID,
            "get": _op(
                "A file's content (JSONL)",
                {"200": {"description": "JSONL", "content": {"application/jsonl": {}}}},
            ),
        },
        "/v1/batches": {
            "post": _op(
                "Create a batch from an uploaded file",
                {"200": _json(_ref("Batch"))},
                requestBody=_body(_ref("BatchCreate")),
            ),
            "get": _op(
                "List batches, newest first",
                {"200": _json(_ref("BatchList"))},
                parameters=[
                    {"name": "after", "in": "query", "schema": {"type": "string"}},
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100},
                    },
                ],
            ),
        },
        "/v1/batches/{id}": {
            "parameters": ID,
            "get": _op("A batch", {"200": _json(_ref("Batch"))}),
        },
        "/v1/batches/{id}/cancel": {
            "parameters": ID,
            "post": _op("Cancel a batch", {"200": _json(_ref("Batch"))}),
        },
        **online_paths(),
        "/openapi.json": {"get": _op("This document", {"200": _json(OBJ)})},
    }


def online_paths() -> dict[str, Any]:
    """OpenAI's online endpoints (``api.openai_online``, ``api.models_route``)."""
    answer = {
        "description": "The completion, or with stream: true server-sent chunks",
        "content": {"application/json": {"schema": OBJ}, "text/event-stream": {"schema": OBJ}},
    }
    return {
        "/v1/chat/completions": {
            "post": _op(
                "OpenAI chat completion (queued as an interactive job)",
                {"200": answer},
                requestBody=_body(OBJ),
            )
        },
        "/v1/completions": {
            "post": _op(
                "OpenAI completion (queued as an interactive job)",
                {"200": answer},
                requestBody=_body(OBJ),
            )
        },
        "/v1/models": {"get": _op("Models live workers serve", {"200": _json(OBJ)})},
        "/v1/models/{id}": {"parameters": ID, "get": _op("One served model", {"200": _json(OBJ)})},
    }


def _error_schema() -> dict[str, Any]:
    inner = {
        "type": "object",
        "required": ["code", "message", "type"],
        "properties": {
            "code": {"type": "string"},
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
        },
    }
    return {"type": "object", "required": ["error"], "properties": {"error": inner}}


def schemas() -> dict[str, Any]:
    job_request = JobRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    job = JobRecord.model_json_schema(ref_template="#/components/schemas/{model}")
    defs: dict[str, Any] = {}
    for s in (job_request, job):
        defs.update(s.pop("$defs", {}))
    job["properties"]["progress"] = {
        "type": "object",
        "properties": {
            "tokens_generated": {"type": "integer"},
            "max_tokens": {"type": ["integer", "null"]},
            "fraction": {"type": ["number", "null"]},
        },
    }
    accepted = {
        "type": "object",
        "required": ["id", "status"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "job"},
            "status": {"type": "string"},
            "created": {"type": "boolean"},
        },
    }
    file_ = {
        "type": "object",
        "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "file"},
            "bytes": {"type": "integer"},
            "created_at": {"type": "integer"},
            "filename": {"type": "string"},
            "purpose": {"type": "string"},
        },
    }
    batch_create = {
        "type": "object",
        "required": ["input_file_id", "endpoint", "completion_window"],
        "properties": {
            "input_file_id": {"type": "string"},
            "endpoint": {"type": "string", "enum": ["/v1/chat/completions", "/v1/completions"]},
            "completion_window": {"type": "string", "const": "24h"},
            "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
        },
        "additionalProperties": False,
    }
    batch = {"type": "object", "required": ["id", "object", "status"], "properties": {
        "id": {"type": "string"}, "object": {"const": "batch"}, "status": {"type": "string"},
        "endpoint": {"type": "string"}, "input_file_id": {"type": "string"},
        "output_file_id": {"type": ["string", "null"]},
        "error_file_id": {"type": ["string", "null"]},
        "request_counts": {"type": "object"}, "created_at": {"type": "integer"},
    }}  # fmt: skip
    batch_list = {
        "type": "object",
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _ref("Batch")},
            "first_id": {"type": ["string", "null"]},
            "last_id": {"type": ["string", "null"]},
            "has_more": {"type": "boolean"},
        },
    }
    return {
        **defs,
        "JobRequest": job_request,
        "Job": job,
        "JobAccepted": accepted,
        "File": file_,
        "BatchCreate": batch_create,
        "Batch": batch,
        "BatchList": batch_list,
        "Error": _error_schema(),
    }


def document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pagedserve API",
            "version": "0.1.0",
            "description": "Jobs over a Redis queue served by paged-KV workers; OpenAI-compatible "
            "files and batches; pool occupancy, health and metrics. Errors are "
            '{"error": {"code", "message", "type", "param"}}.',
        },
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": paths(),
        "components": {
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Needed only when the server has PAGEDSERVE_API_KEYS set",
                }
            },
            "schemas": schemas(),
            "responses": {"Error": _json(_ref("Error"), "Error")},
        },
    }


@bp.get("/openapi.json")
def openapi_json() -> dict[str, Any]:
    return document()
