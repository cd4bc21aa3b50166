"""Malformed requests: each gets its 4xx with a JSON error and a clear message, and the app keeps
serving afterwards."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from tests.api_fixtures import make_app

KEY = "sekrit-key-1"


@pytest.fixture
def app(redis_url: str) -> Flask:
    return make_app(redis_url, max_json_bytes=4096, max_content_length=64 * 1024)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def check_error(resp: Any, status: int, code: str | None, *words: str) -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.get_data(as_text=True))
    assert resp.mimetype == "application/json"
    err = resp.get_json()["error"]
    assert set(err) >= {"code", "message", "type"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err


def fresh(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Request kwargs with upload parts (``(bytes, filename)``) as new file objects."""
    kw = dict(kwargs)
    data = kw.get("data")
    if isinstance(data, dict) and "file" in data:
        content, fname = data["file"]
        kw["data"] = {**data, "file": (io.BytesIO(content), fname)}
    return kw


def still_serving(client: FlaskClient) -> None:
    assert client.get("/healthz").status_code == 200
    resp = client.post("/v1/jobs", json={"prompt": "ok"})
    assert resp.status_code == 202


JSON = "application/json"

#: (name, method, path, kwargs, status, code, words in the message)
CASES: list[tuple[str, str, str, dict[str, Any], int, str, tuple[str, ...]]] = [
    ("bad json", "POST", "/v1/jobs", {"data": "{nope", "content_type": JSON},
     400, "invalid_json", ("not valid JSON",)),
    ("empty body", "POST", "/v1/jobs", {"data": "", "content_type": JSON},
     400, "invalid_json", ("empty",)),
    ("json array", "POST", "/v1/jobs", {"json": ["prompt"]},
     400, "invalid_json", ("JSON object", "list")),
    ("not utf-8", "POST", "/v1/jobs", {"data": b"\xff\xfe{", "content_type": JSON},
     400, "invalid_json", ()),
    ("form body", "POST", "/v1/jobs", {"data": {"prompt": "x"}},
     415, "unsupported_media_type", ("application/json",)),
    ("wrong type", "POST", "/v1/jobs", {"json": {"prompt": "x", "params": {"max_tokens": "many"}}},
     422, "validation_error", ("params.max_tokens",)),
    ("unknown field", "POST", "/v1/jobs", {"json": {"prompt": "x", "temperature": 0.5}},
     422, "validation_error", ("temperature", "unknown field")),
    ("unknown param", "POST", "/v1/jobs", {"json": {"prompt": "x", "params": {"beam": 2}}},
     422, "validation_error", ("params.beam", "unknown field")),
    ("no prompt", "POST", "/v1/jobs", {"json": {"params": {}}},
     422, "validation_error", ("exactly one of 'prompt' or 'messages'",)),
    ("both inputs", "POST", "/v1/jobs",
     {"json": {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}},
     422, "validation_error", ("exactly one",)),
    ("bad role", "POST", "/v1/jobs", {"json": {"messages": [{"role": "wizard", "content": "y"}]}},
     422, "validation_error", ("messages.0.role",)),
    ("bad priority", "POST", "/v1/jobs", {"json": {"prompt": "x", "priority": "urgent"}},
     422, "validation_error", ("priority",)),
    ("min > max", "POST", "/v1/jobs",
     {"json": {"prompt": "x", "params": {"min_tokens": 9, "max_tokens": 2}}},
     422, "validation_error", ("min_tokens",)),
    ("negative ids", "POST", "/v1/jobs", {"json": {"prompt": [1, -2]}},
     422, "validation_error", ("non-negative",)),
    ("pickle body", "POST", "/v1/jobs",
     {"data": b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00}\x94.", "content_type":
      "application/python-pickle"},
     415, "unsupported_media_type", ()),
    ("oversize json", "POST", "/v1/jobs",
     {"json": {"prompt": "x" * 10_000}}, 413, "payload_too_large", ("too large",)),
    ("oversize upload", "POST", "/v1/files",
     {"data": {"purpose": "batch", "file": (b"x" * 100_000, "big.jsonl")},
      "content_type": "multipart/form-data"}, 413, "payload_too_large", ()),
    ("unknown job", "GET", "/v1/jobs/0123abcd", {}, 404, "job_not_found", ("not found",)),
    ("odd job id", "GET", "/v1/jobs/" + "z" * 300, {}, 404, "job_not_found", ()),
    ("cancel unknown", "DELETE", "/v1/jobs/0123abcd", {}, 404, "job_not_found", ()),
    ("bad event id", "GET", "/v1/jobs/{job}/events", {"headers": {"Last-Event-ID": "x"}},
     400, "bad_request", ("Last-Event-ID",)),
    ("unknown route", "GET", "/v1/nothing", {}, 404, "not_found", ()),
    ("wrong method", "PUT", "/v1/jobs", {}, 405, "method_not_allowed", ()),
    ("wrong method 2", "POST", "/v1/pool", {}, 405, "method_not_allowed", ()),
    ("bad purpose", "POST", "/v1/files",
     {"data": {"purpose": "fine-tune", "file": (b"{}", "a.jsonl")},
      "content_type": "multipart/form-data"}, 400, "invalid_purpose", ("'batch'", "fine-tune")),
    ("no file part", "POST", "/v1/files",
     {"data": {"purpose": "batch"}, "content_type": "multipart/form-data"},
     400, "missing_file", ("'file'",)),
    ("upload as json", "POST", "/v1/files", {"json": {"purpose": "batch"}},
     415, "unsupported_media_type", ("multipart/form-data",)),
    ("bad batch lines", "POST", "/v1/files",
     {"data": {"purpose": "batch", "file": (b'{"custom_id": "a"}\nnot json\n',
                                              "a.jsonl")},
      "content_type": "multipart/form-data"},
     400, "invalid_batch_file", ("line 1", "line 2", "invalid_json")),
    ("empty batch file", "POST", "/v1/files",
     {"data": {"purpose": "batch", "file": (b"\n", "a.jsonl")},
      "content_type": "multipart/form-data"}, 400, "invalid_batch_file", ("no requests",)),
    ("binary file", "POST", "/v1/files",
     {"data": {"purpose": "batch", "file": (b"\xff\xfe", "a.jsonl")},
      "content_type": "multipart/form-data"}, 400, "invalid_batch_file", ("UTF-8",)),
    ("unknown file", "GET", "/v1/files/file-nope", {}, 404, "file_not_found", ()),
    ("unknown file content", "GET", "/v1/files/file-nope/content", {}, 404, "file_not_found", ()),
    ("batch unknown file", "POST", "/v1/batches",
     {"json": {"input_file_id": "file-nope", "endpoint": "/v1/chat/completions",
               "completion_window": "24h"}}, 404, "file_not_found", ("file-nope",)),
    ("batch bad endpoint", "POST", "/v1/batches",
     {"json": {"input_file_id": "file-x", "endpoint": "/v1/embeddings",
               "completion_window": "24h"}}, 400, "invalid_endpoint", ("/v1/embeddings",)),
    ("batch bad window", "POST", "/v1/batches",
     {"json": {"input_file_id": "file-x", "endpoint": "/v1/completions",
               "completion_window": "forever"}}, 400, "invalid_completion_window", ("24h",)),
    ("batch unknown field", "POST", "/v1/batches",
     {"json": {"input_file_id": "f", "endpoint": "/v1/completions", "extra": 1}},
     422, "validation_error", ("extra", "unknown field")),
    ("batch metadata type", "POST", "/v1/batches",
     {"json": {"input_file_id": "f", "endpoint": "/v1/completions", "metadata": {"a": 1}}},
     422, "validation_error", ("metadata.a",)),
    ("unknown batch", "GET", "/v1/batches/batch_nope", {}, 404, "batch_not_found", ()),
    ("cancel unknown batch", "POST", "/v1/batches/batch_nope/cancel", {}, 404,
     "batch_not_found", ()),
    ("list bad limit", "GET", "/v1/batches?limit=abc", {}, 400, "bad_request", ("limit",)),
    ("list limit range", "GET", "/v1/batches?limit=1000", {}, 400, "bad_request", ("100",)),
    ("list unknown after", "GET", "/v1/batches?after=batch_nope", {}, 404, "batch_not_found", ()),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_request(client: FlaskClient, case: tuple) -> None:
    _name, method, path, kwargs, status, code, words = case
    if "{job}" in path:
        path = path.replace("{job}", client.post("/v1/jobs", json={"prompt": "p"}).get_json()["id"])
    resp = client.open(path, method=method, **fresh(kwargs))
    check_error(resp, status, code, *words)
    still_serving(client)


def test_whole_corpus_in_one_app(client: FlaskClient) -> None:
    """Every malformed request against one app, then it still serves normally."""
    for _name, method, path, kwargs, status, _code, _words in CASES:
        if "{job}" in path:
            continue
        assert client.open(path, method=method, **fresh(kwargs)).status_code == status, path
    still_serving(client)


def test_405_lists_allowed_methods(client: FlaskClient) -> None:
    resp = client.put("/v1/jobs/abc")
    err = check_error(resp, 405, "method_not_allowed")
    assert "DELETE" in resp.headers["Allow"] and "GET" in resp.headers["Allow"]
    assert err["type"] == "invalid_request_error"


# ----------------------------------------------------------------------------- API keys
@pytest.fixture
def keyed(redis_url: str) -> FlaskClient:
    return make_app(redis_url, api_keys=f"{KEY}, other-key").test_client()


@pytest.mark.parametrize(
    "path",
    ["/v1/jobs/abc", "/v1/pool", "/v1/workers", "/v1/queues", "/metrics", "/openapi.json",
     "/v1/batches", "/v1/files/file-x", "/v1/nothing"],
)  # fmt: skip
def test_missing_and_wrong_key(keyed: FlaskClient, path: str) -> None:
    err = check_error(keyed.get(path), 401, "missing_api_key", "Authorization: Bearer")
    assert err["type"] == "authentication_error"
    resp = keyed.get(path, headers={"Authorization": "Bearer wrong"})
    check_error(resp, 401, "invalid_api_key")
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    check_error(keyed.get(path, headers={"Authorization": f"Basic {KEY}"}), 401, "missing_api_key")


def test_right_key_and_open_endpoints(keyed: FlaskClient) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    resp = keyed.post("/v1/jobs", json={"prompt": "x"}, headers=auth)
    assert resp.status_code == 202
    job = keyed.get(resp.headers["Location"], headers={"Authorization": "Bearer other-key"})
    assert job.status_code == 200
    assert keyed.get("/v1/pool", headers=auth).status_code == 200
    # Health checks and the dashboard's static page stay open; the page's data calls do not.
    assert keyed.get("/healthz").status_code == 200
    assert keyed.get("/readyz").status_code == 503  # open, and no worker yet
    assert keyed.get("/").status_code == 200
    assert keyed.get("/static/dashboard.js").status_code == 200
    # A bad request with a good key is still a 4xx JSON error, not an auth error.
    check_error(
        keyed.post("/v1/jobs", data=json.dumps([1]), content_type=JSON, headers=auth),
        400,
        "invalid_json",
    )


def test_unexpected_server_error_is_json(redis_url: str) -> None:
    app = make_app(redis_url)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("kaput")

    client = app.test_client()
    err = check_error(client.get("/boom"), 500, "internal_error", "RuntimeError")
    assert err["type"] == "server_error" and "kaput" not in err["message"]
    still_serving(client)
