"""Structured outputs through every entry point: Client.submit and a real worker process,
POST /v1/jobs (422 with the grammar engine's message), OpenAI ``response_format`` in batch
lines, and the CLI's submit flags; a stored constraint the worker refuses fails only its job."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from bench.structured_schemas import SCHEMAS
from pagedserve.client import Client
from pagedserve.openai_input import LineInvalid, parse_line
from pagedserve.schemas import JobStatus
from pagedserve.store import JobStore
from tests.api_fixtures import make_app
from tests.fixtures.workers import StartWorker
from tests.raw_records import inject
from tests.test_batches import MODEL, line
from tests.test_cli import cli


@pytest.fixture
def model_dir(make_tiny_model) -> Path:  # type: ignore[no-untyped-def]
    return make_tiny_model("llama")


def test_worker_serves_constraints_and_fails_a_refused_one(
    redis_url: str, model_dir: Path, start_worker: StartWorker
) -> None:
    start_worker(redis_url, model_dir, "w1")
    client = Client(redis_url)
    base = {"max_tokens": 256, "temperature": 1.0}
    jobs = {
        client.submit(f"text {i}", {**base, "seed": i, "structured_outputs": {"json": SCHEMAS[i]}})
        : ("json", SCHEMAS[i])
        for i in range(4)
    }  # fmt: skip
    jobs[client.submit([5, 6, 7], {**base, "structured_outputs": {"regex": "[a-c]{2,5}!"}})] = (
        "regex", "[a-c]{2,5}!",
    )  # fmt: skip
    jobs[client.submit("pick", {**base, "n": 3, "seed": 1,
                                "structured_outputs": {"choice": ["red", "green"]}})] = (
        "choice", ["red", "green"],
    )  # fmt: skip
    # A stored request whose regex the worker's engine refuses (written past the client).
    bad = {"prompt": "x", "params": {"structured_outputs": {"regex": "(a|b"}}}
    bad_id = inject(client.store, json.dumps(bad))
    recs = {r.id: r for r in client.wait_many([*jobs, bad_id], timeout=120)}
    for jid, (kind, spec) in jobs.items():
        rec = recs[jid]
        assert rec.status == JobStatus.SUCCEEDED and rec.result is not None, rec.error
        for c in rec.result.completions:
            assert c.finish_reason == "stop", c
            if kind == "json":
                jsonschema.validate(json.loads(c.text), spec)
            elif kind == "regex":
                assert re.fullmatch(spec, c.text)  # type: ignore[arg-type]
            else:
                assert c.text in spec
    assert recs[bad_id].status == JobStatus.FAILED
    assert "unclosed group" in (recs[bad_id].error or "")


def test_api_refuses_invalid_constraint_with_the_engine_message(redis_url: str) -> None:
    api = make_app(redis_url).test_client()
    for so, words in (
        ({"regex": "[a-"}, "unclosed character class"),
        ({"json": {"type": "object", "uniqueItems": True}}, "Unimplemented keys"),
        ({"json": {"minimum": 3, "maximum": 1, "type": "number"}}, "greater than maximum"),
        ({"choice": ["a"], "regex": "b"}, "exactly one of"),
    ):
        resp = api.post("/v1/jobs", json={"prompt": "hi", "params": {"structured_outputs": so}})
        # The API answers every parameter validation error with 422 (its validation_error).
        assert resp.status_code == 422, resp.get_json()
        err = resp.get_json()["error"]
        assert err["param"] == "params.structured_outputs" and words in err["message"], err
    ok = {"prompt": "hi", "params": {"structured_outputs": {"json": SCHEMAS[9]}}}
    resp = api.post("/v1/jobs", json=ok)
    assert resp.status_code == 202
    rec = JobStore(redis_url).get(resp.get_json()["id"])
    assert rec is not None and rec.request.params.structured_outputs is not None
    assert rec.request.params.structured_outputs.json_ == SCHEMAS[9]


CHAT = "/v1/chat/completions"


def chat_line(response_format: object) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return line("c", {**body, "response_format": response_format}, url=CHAT)


def test_batch_line_response_format() -> None:
    schema = SCHEMAS[0]
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    so = parse_line(chat_line(rf), 1).request.params.structured_outputs
    assert so is not None and so.json_ == schema
    so = parse_line(chat_line({"type": "json_object"}), 1).request.params.structured_outputs
    assert so is not None and so.json_ is True
    assert parse_line(chat_line({"type": "text"}), 1).request.params.structured_outputs is None
    vllm = line("c", {"model": MODEL, "prompt": "x", "structured_outputs": {"choice": ["a"]}})
    so = parse_line(vllm, 1).request.params.structured_outputs
    assert so is not None and so.choice == ["a"]
    for rf, words in (
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema must be a JSON schema"),
        ({"type": "xml"}, "response_format.type must be one of"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, "Invalid type"),
    ):
        with pytest.raises(LineInvalid) as ei:
            parse_line(chat_line(rf), 3)
        assert not ei.value.error.fatal and words in ei.value.error.message


def test_cli_submit_constraint_flags(redis_url: str, tmp_path: Path) -> None:
    schema_file = tmp_path / "s.json"
    schema_file.write_text(json.dumps(SCHEMAS[1]))
    store = JobStore(redis_url)
    for flags, check in (
        (["--json-schema", str(schema_file)], lambda so: so.json_ == SCHEMAS[1]),
        (["--json-object"], lambda so: so.json_ is True),
        (["--regex", "[0-9]+"], lambda so: so.regex == "[0-9]+"),
        (["--choice", "yes", "--choice", "no"], lambda so: so.choice == ["yes", "no"]),
    ):
        rc, out = cli(redis_url, "submit", "hi", *flags)
        assert rc == 0, out
        rec = store.get(out["id"])
        assert rec is not None and check(rec.request.params.structured_outputs), flags
    rc, out = cli(redis_url, "submit", "hi", "--regex", "(a|b")
    assert rc == 2 and "unclosed group" in out["detail"]
