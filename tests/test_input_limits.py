"""Malformed input gets a 4xx JSON error (never a 500, never a job that fails later): lone
surrogates, JSON nested past the parser's bound, coerced types, OpenAI's metadata and batch-file
limits, prompts that cannot fit the served model's context. A stored record always reads back."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from flask.testing import FlaskClient
from pydantic import ValidationError

from pagedserve.batch_checks import count_lines
from pagedserve.batches import BatchStore
from pagedserve.params import SamplingParams
from pagedserve.schemas import MAX_PROMPT_CHARS, JobRequest
from pagedserve.store import JobStore
from tests.api_fixtures import heartbeat, make_app
from tests.test_api_errors import check_error

JSON = "application/json"


@pytest.fixture
def client(redis_url: str) -> FlaskClient:
    return make_app(redis_url).test_client()


def nested(depth: int, leaf: str = '"x"') -> str:
    return '{"a":' * depth + leaf + "}" * depth


def post_raw(client: FlaskClient, raw: str) -> Any:
    return client.post("/v1/jobs", data=raw, content_type=JSON)


def line(cid: str, body: dict[str, Any] | None = None, raw_body: str | None = None) -> str:
    b = json.dumps(body or {"model": "m", "prompt": "p"}) if raw_body is None else raw_body
    return f'{{"custom_id": "{cid}", "method": "POST", "url": "/v1/completions", "body": {b}}}'


def upload(client: FlaskClient, text: str) -> Any:
    data = {"purpose": "batch", "file": (io.BytesIO(text.encode()), "in.jsonl")}
    return client.post("/v1/files", data=data, content_type="multipart/form-data")


# ----------------------------------------------------------------------------- unicode, nesting
@pytest.mark.parametrize(
    "raw",
    [
        '{"prompt": "a\\ud800b"}',
        '{"prompt": "\\udc00"}',
        '{"messages": [{"role": "user", "content": "x\\ud83d"}]}',
        '{"prompt": "x", "metadata": {"k": "\\ud800"}}',
        '{"prompt": "x", "params": {"stop": ["\\ud800\\u0041"]}}',
    ],
)
def test_lone_surrogates_are_400(client: FlaskClient, raw: str) -> None:
    check_error(post_raw(client, raw), 400, "invalid_unicode", "Unicode")


def test_lone_surrogates_from_python_callers_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"(?i)unicode"):
        JobRequest(prompt="a\ud800b")
    with pytest.raises(ValidationError, match=r"(?i)unicode"):
        JobRequest(prompt="x", metadata={"k": "\udc00"})


def test_a_valid_surrogate_pair_is_fine(client: FlaskClient) -> None:
    assert post_raw(client, '{"prompt": "smile \\ud83d\\ude00"}').status_code == 202


@pytest.mark.parametrize("depth", [100_000, 300, 202])
def test_deep_json_body_is_400(client: FlaskClient, depth: int) -> None:
    check_error(post_raw(client, "[" * depth + "]" * depth), 400, "json_too_deep", "nested")
    raw = '{"prompt": "x", "metadata": ' + nested(depth) + "}"
    check_error(post_raw(client, raw), 400, "json_too_deep", "nested")


@pytest.mark.parametrize("depth", [2, 150, 196])
def test_nested_metadata_under_the_bound_is_422(client: FlaskClient, depth: int) -> None:
    raw = '{"prompt": "x", "metadata": {"k": ' + nested(depth) + "}}"
    check_error(post_raw(client, raw), 422, "validation_error", "metadata.k")


@pytest.mark.parametrize("depth", [100_000, 250])
def test_deep_json_in_a_jsonl_line_is_400_with_its_line(client: FlaskClient, depth: int) -> None:
    text = line("ok") + "\n" + line("deep", raw_body=nested(depth)) + "\n"
    check_error(upload(client, text), 400, "invalid_batch_file", "line 2", "json_too_deep")
    text = line("ok") + "\n" + line("bad", raw_body='{"model": "m", "prompt": "\\ud800"}')
    check_error(upload(client, text), 400, "invalid_batch_file", "line 2", "invalid_unicode")


def test_a_stored_record_always_reads_back(client: FlaskClient, redis_url: str) -> None:
    """A record whose request does not parse (as deeply nested metadata stored by an older
    version) answers 200 with the reason, not 422."""
    store = JobStore(redis_url)
    jid = store.enqueue("deadbeef01", JobRequest(prompt="x"))[0]
    bad = '{"prompt": "x", "metadata": {"k": ' + nested(230) + "}}"
    store.r.hset(store.keys.job(jid), mapping={"request": bad, "status": "failed"})
    resp = client.get(f"/v1/jobs/{jid}")
    assert resp.status_code == 200, resp.get_json()
    assert "invalid stored request" in resp.get_json()["error"]


# ----------------------------------------------------------------------------- strict types
@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_tokens": "16"}, "params.max_tokens"),
        ({"n": True}, "params.n"),
        ({"temperature": "0.5"}, "params.temperature"),
        ({"ignore_eos": 1}, "params.ignore_eos"),
        ({"seed": 1.0}, "params.seed"),
        ({"stop_token_ids": ["2"]}, "params.stop_token_ids.0"),
    ],
)
def test_coerced_types_are_refused(client: FlaskClient, params: dict, field: str) -> None:
    resp = client.post("/v1/jobs", json={"prompt": "x", "params": params})
    check_error(resp, 422, "validation_error", field)


def test_strict_prompt_ids_and_python_callers() -> None:
    with pytest.raises(ValidationError):
        JobRequest.model_validate_json('{"prompt": [1, "2"]}')
    with pytest.raises(ValidationError):
        JobRequest.model_validate_json('{"prompt": [1, true]}')
    assert SamplingParams(max_tokens=16).max_tokens == 16
    assert SamplingParams(temperature=0).temperature == 0.0  # an int where a float is expected
    assert SamplingParams(stop="x").stop == ["x"]
    # Integral numbers of other types (NumPy's) still work from Python; bools and strings do not.
    np = pytest.importorskip("numpy")
    got = SamplingParams(max_tokens=np.int64(5), stop_token_ids=[np.int32(2)])
    assert (got.max_tokens, got.stop_token_ids) == (5, [2]) and type(got.max_tokens) is int
    assert JobRequest(prompt=list(np.arange(3))).prompt == [0, 1, 2]
    assert JobRequest(prompt=(1, 2)).prompt == [1, 2]
    for bad in ({"max_tokens": True}, {"n": "2"}, {"stop_token_ids": [False]}):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)


# ----------------------------------------------------------------------------- metadata
@pytest.mark.parametrize(
    ("metadata", "word"),
    [
        ({f"k{i}": "v" for i in range(17)}, "at most 16"),
        ({"k" * 65: "v"}, "at most 64"),
        ({"k": "v" * 513}, "at most 512"),
        ({"k": {"nested": "v"}}, "metadata.k"),
        ({"k": 1}, "metadata.k"),
        ({"": "v"}, "at least 1"),
    ],
)
def test_metadata_limits(client: FlaskClient, metadata: dict, word: str) -> None:
    resp = client.post("/v1/jobs", json={"prompt": "x", "metadata": metadata})
    check_error(resp, 422, "validation_error", word)
    batch = {"input_file_id": "file-x", "endpoint": "/v1/completions", "metadata": metadata}
    check_error(client.post("/v1/batches", json=batch), 422, "validation_error", word)


def test_metadata_within_limits(client: FlaskClient) -> None:
    md = {f"k{i}" + "x" * 60: "v" * 512 for i in range(16)}
    assert client.post("/v1/jobs", json={"prompt": "x", "metadata": md}).status_code == 202


# ----------------------------------------------------------------------------- batch files
def test_batch_file_line_limit(redis_url: str) -> None:
    client = make_app(redis_url).test_client()
    text = "\n".join(line(f"c{i}") for i in range(50_001)) + "\n"
    check_error(upload(client, text), 400, "invalid_batch_file", "line 50001", "at most 50000")


def test_line_count_splits_on_newline_only() -> None:
    """The request count before parsing splits lines as the parser does (``\\n`` only): a
    U+2028 / U+2029 / U+0085 inside a JSON string does not count as another request."""
    text = json.dumps({"custom_id": "a\u2028b\u2029c\x85d"}, ensure_ascii=False) + "\r\n\n"
    assert count_lines(text) == 1


def test_one_model_per_batch(client: FlaskClient, redis_url: str) -> None:
    body = {"model": "other", "prompt": "p"}
    text = line("a") + "\n" + line("b") + "\n" + line("c", body) + "\n"
    check_error(upload(client, text), 400, "invalid_batch_file", "line 3", "mixed_models")
    # The same check when a batch is fanned out from a file stored by a Redis-side client.
    bs = BatchStore(redis_url)
    f = bs.files.create(text, "in.jsonl")
    b = bs.fan_out(bs.create(f.id, "/v1/completions").id)
    assert b is not None and b.status == "failed" and b.errors is not None
    assert [e["line"] for e in b.errors.data] == [3]
    assert b.errors.data[0]["code"] == "mixed_models"


# ----------------------------------------------------------------------------- context
@pytest.fixture
def served(redis_url: str) -> FlaskClient:
    """A worker heartbeat with a 64-token context and tokens of at most 8 bytes."""
    store = JobStore(redis_url)
    info = {**heartbeat().model_dump(), "max_model_len": 64, "max_token_bytes": 8}
    store.heartbeat("w1", info)
    return make_app(redis_url).test_client()


@pytest.mark.parametrize(
    ("body", "ok"),
    [
        ({"prompt": [1] * 48, "params": {"max_tokens": 16}}, True),
        ({"prompt": [1] * 49, "params": {"max_tokens": 16}}, False),
        ({"prompt": [1] * 3000}, False),
        ({"prompt": [1] * 64, "params": {"max_tokens": None}}, False),
        ({"prompt": [1] * 63, "params": {"max_tokens": None}}, True),
        ({"prompt": "x" * 8 * 48, "params": {"max_tokens": 16}}, True),
        ({"prompt": "x" * (8 * 48 + 1), "params": {"max_tokens": 16}}, False),
        ({"messages": [{"role": "user", "content": "é" * 300}]}, False),
        # Chat contents count stripped: a template may trim them.
        ({"messages": [{"role": "user", "content": " " * 600 + "hi"}]}, True),
    ],
)
def test_prompt_longer_than_the_context_is_400(served: FlaskClient, body: dict, ok: bool) -> None:
    resp = served.post("/v1/jobs", json=body)
    if ok:
        assert resp.status_code == 202, resp.get_json()
    else:
        check_error(resp, 400, "context_length_exceeded", "context length of 64")


def test_prompt_for_another_model_is_not_checked_against_this_one(served: FlaskClient) -> None:
    resp = served.post("/v1/jobs", json={"prompt": [1] * 100, "model": "unserved"})
    assert resp.status_code == 202


def test_prompt_text_is_capped_outright(redis_url: str) -> None:
    client = make_app(redis_url).test_client()  # default 1 MiB body limit
    resp = client.post("/v1/jobs", json={"prompt": "x" * 1_000_000})
    check_error(resp, 422, "validation_error", "prompt", str(MAX_PROMPT_CHARS))
    msgs = [{"role": "user", "content": "y" * (MAX_PROMPT_CHARS // 2 + 1)}] * 2
    check_error(client.post("/v1/jobs", json={"messages": msgs}), 422, "validation_error")
