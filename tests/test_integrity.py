"""Batch and job integrity against a real redis-server (no model): server-owned batch membership,
reserved namespaces, batch edge cases, file listing and expiry, restart events on reclaim."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

import pagedserve.batches as batches_mod
from pagedserve.batches import BatchStore
from pagedserve.client import Client, accumulate, new_job_id
from pagedserve.openai_format import COMPLETIONS_URL, parse_file
from pagedserve.schemas import Completion, JobRequest, JobResult
from pagedserve.store import Finish, JobStore
from tests.api_fixtures import make_app
from tests.raw_records import inject

MODEL = "tiny"


def line(cid: str, prompt: str = "hi") -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    return json.dumps({"custom_id": cid, "method": "POST", "url": COMPLETIONS_URL, "body": body})


def result(text: str = "out") -> JobResult:
    comp = Completion(index=0, text=text, token_ids=[5], finish_reason="stop")
    return JobResult(completions=[comp], prompt_tokens=3, completion_tokens=1)


@pytest.fixture
def bs(redis_url: str) -> BatchStore:
    return BatchStore(JobStore(redis_url, lease_ms=60_000), known_models=[MODEL])


def new_batch(bs: BatchStore, cids: list[str], **kw: Any) -> str:
    f = bs.files.create("".join(line(c) + "\n" for c in cids), "in.jsonl")
    return bs.create(f.id, COMPLETIONS_URL, **kw).id


def counts(bs: BatchStore, bid: str) -> dict[str, int]:
    b = bs.get(bid)
    assert b is not None
    return b.request_counts.model_dump()


def file_lines(bs: BatchStore, file_id: str | None) -> list[dict[str, Any]]:
    text = bs.files.content(file_id) if file_id else ""
    return [json.loads(x) for x in (text or "").split("\n") if x]


# ----------------------------------------------------------------------------- reserved names
@pytest.mark.parametrize("meta", [{"batch_id": "batch_x"}, {"custom_id": "evil"}])
def test_reserved_metadata_refused(redis_url: str, meta: dict[str, str]) -> None:
    client = Client(redis_url)
    with pytest.raises(ValueError, match="reserved"):
        client.submit("hi", metadata={"ok": "1", **meta})  # flat strings (tenants)
    resp = (
        make_app(redis_url).test_client().post("/v1/jobs", json={"prompt": "x", "metadata": meta})
    )
    assert resp.status_code == 400, resp.get_json()
    assert "reserved" in resp.get_json()["error"]["message"]
    assert client.store.queue_lengths() == {"interactive": 0, "bulk": 0}


def test_fan_out_idempotency_namespace_is_reserved(bs: BatchStore, redis_url: str) -> None:
    """A job submitted between batch creation and fan-out with the key the fan-out would use
    for one request must not take that request's slot."""
    bid = new_batch(bs, ["a", "b"])
    digest = hashlib.sha256(b"a").hexdigest()[:32]
    client = Client(redis_url)
    with pytest.raises(ValueError, match="reserved"):
        client.submit("stolen", idempotency_key=f"batch:{bid}:{digest}")
    api = make_app(redis_url).test_client()
    resp = api.post("/v1/jobs", json={"prompt": "x", "idempotency_key": f"batch:{bid}:{digest}"})
    assert resp.status_code == 400
    assert client.submit("fine", idempotency_key="batch-like but not reserved")
    b = bs.fan_out(bid)
    assert b is not None and b.status == "in_progress"
    recs = bs.jobs.get_many(bs.job_ids(bid))
    assert sorted(r.request.metadata["custom_id"] for r in recs if r) == ["a", "b"]


# ----------------------------------------------------------------------------- spoofed lines
def test_spoofed_metadata_never_touches_a_batch(bs: BatchStore, redis_url: str) -> None:
    """Stored requests whose metadata name a real batch (and its job list) run as plain jobs:
    no line, no count; cancelling one answers 200 and leaves the batch alone."""
    bid = new_batch(bs, ["a", "b"])
    bs.fan_out(bid)
    spoof = [
        json.dumps({"prompt": "x", "metadata": {"batch_id": bid, "custom_id": "evil"}}),
        json.dumps({"prompt": "x", "metadata": {"batch_id": f"{bid}:jobs", "custom_id": "e2"}}),
        json.dumps({"prompt": "x", "metadata": {"batch_id": f"{bid}:counted", "custom_id": 1}}),
    ]
    js = bs.jobs
    spoofed = [inject(js, raw) for raw in spoof]
    to_cancel = inject(js, spoof[1])
    api = make_app(redis_url).test_client()
    resp = api.delete(f"/v1/jobs/{to_cancel}")
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json()["status"] == "cancelled"
    leases = {x.job_id: x for x in js.claim("w", 10)}
    # The record whose metadata is not flat strings (custom_id 1) no longer parses (strict
    # metadata): it is leased apart, to be failed, as the worker does with it.
    malformed = {lease.job_id: lease for lease, _ in js.take_malformed()}
    assert set(malformed) == {spoofed[2]}
    assert set(spoofed) <= set(leases) | set(malformed)
    for jid in spoofed:
        if jid in malformed:
            assert js.fail(malformed[jid], "invalid request")
        else:
            assert js.complete(leases[jid], result("evil"))
    for lease in leases.values():
        if lease.job_id not in spoofed:
            assert js.complete(lease, result())
    assert counts(bs, bid) == {"total": 2, "completed": 2, "failed": 0}
    assert bs.finalize_ready() == [bid]
    done = bs.get(bid)
    assert done is not None and done.status == "completed"
    assert sorted(x["custom_id"] for x in file_lines(bs, done.output_file_id)) == ["a", "b"]
    assert done.error_file_id is None


def test_plain_finish_with_forged_batch_fields_is_refused(bs: BatchStore) -> None:
    """Membership is checked in Redis against the batch's own set: a lease of a job that is not
    a member cannot add a line even if its caller claims a batch."""
    bid = new_batch(bs, ["a"])
    bs.fan_out(bid)
    plain = bs.jobs.enqueue(new_job_id(), JobRequest(prompt="p"))[0]
    leases = {x.job_id: x for x in bs.jobs.claim("w", 5)}
    member = next(j for j in leases if j != plain)
    forged = dataclasses.replace(leases[plain], batch=leases[member].batch)
    assert bs.jobs.commit_step(finished=[Finish(forged, "succeeded", result=result())]).lost == []
    assert counts(bs, bid) == {"total": 1, "completed": 0, "failed": 0}
    assert bs.jobs.complete(leases[member], result())
    assert counts(bs, bid) == {"total": 1, "completed": 1, "failed": 0}


# ----------------------------------------------------------------------------- batch edges
def test_jsonl_split_on_newline_only() -> None:
    odd = "one\u2028two\u2029three\x85four"
    first = line("a").replace('"hi"', json.dumps(odd, ensure_ascii=False))
    assert "\u2028" in first
    text = first + "\r\n" + line("b") + "\n"
    parsed = parse_file(text, known_models=[MODEL])
    assert not parsed.format_errors and not parsed.request_errors
    assert [x.custom_id for x in parsed.lines] == ["a", "b"]
    assert parsed.lines[0].request.prompt == "one\u2028two\u2029three\x85four"


def test_output_larger_than_upload_cap_finalizes(redis_url: str) -> None:
    bs = BatchStore(JobStore(redis_url), known_models=[MODEL], max_file_bytes=600)
    bid = new_batch(bs, [f"c{i}" for i in range(4)])
    bs.fan_out(bid)
    for lease in bs.jobs.claim("w", 10):
        assert bs.jobs.complete(lease, result("x" * 300))
    assert bs.finalize_ready() == [bid]
    done = bs.get(bid)
    assert done is not None and done.status == "completed"
    out = file_lines(bs, done.output_file_id)
    assert len(out) == 4 and bs.files.get(done.output_file_id).bytes > 600  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="limit"):
        bs.files.create(b"x" * 601, "upload.jsonl")


def test_one_broken_batch_never_blocks_another(bs: BatchStore) -> None:
    good, bad = new_batch(bs, ["g"]), new_batch(bs, ["b"])
    for bid in (good, bad):
        bs.fan_out(bid)
    for lease in bs.jobs.claim("w", 5):
        assert bs.jobs.complete(lease, result())
    out_key = bs.keys.batch_output(bad)
    bs.r.delete(out_key)
    bs.r.set(out_key, "not a list")  # tampered: finalizing this batch raises WRONGTYPE
    bs.finalize_backoff_s = 0.0
    assert bs.finalize_ready() == [good]
    assert bs.get(good).status == "completed"  # type: ignore[union-attr]
    for _ in range(bs.finalize_attempts):
        bs.finalize_ready()
    failed = bs.get(bad)
    assert failed is not None and failed.status == "failed"
    assert failed.errors is not None and "WRONGTYPE" in failed.errors.data[0]["message"]
    assert bs.active() == []


def test_a_batch_that_cannot_expire_fails_in_the_end(bs: BatchStore) -> None:
    late, other = new_batch(bs, ["a"], completion_window="1h"), new_batch(bs, ["b"])
    for bid in (late, other):
        bs.fan_out(bid)
    bs.r.delete(bs.keys.batch_errors(late))
    bs.r.set(bs.keys.batch_errors(late), "not a list")
    b = bs.get(late)
    assert b is not None
    bs.finalize_backoff_s = 0.0
    for _ in range(bs.finalize_attempts):
        assert bs.expire(now=b.expires_at) == []
    failed = bs.get(late)
    assert failed is not None and failed.status == "failed"
    assert bs.active() == [other] and bs.get(other).status == "in_progress"  # type: ignore[union-attr]


def test_cancel_during_fan_out_cancels_every_job(
    bs: BatchStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batches_mod, "ENQUEUE_CHUNK", 2)
    bid = new_batch(bs, [f"c{i}" for i in range(6)])
    real = bs.jobs.enqueue_many
    calls = []

    def enqueue_then_cancel(jobs, **kw):  # type: ignore[no-untyped-def]
        out = real(jobs, **kw)
        calls.append(len(jobs))
        if len(calls) == 1:  # a client's cancel lands after the first chunk
            assert bs.cancel(bid).status in ("cancelling", "cancelled")  # type: ignore[union-attr]
        return out

    monkeypatch.setattr(bs.jobs, "enqueue_many", enqueue_then_cancel)
    b = bs.fan_out(bid)
    assert calls == [2]  # enqueueing stops at the cancel
    assert b is not None and b.status == "cancelled"
    ids = bs.job_ids(bid)
    assert len(ids) == 2 and set(bs.jobs.statuses(ids)) == {"cancelled"}
    assert sorted(bs.r.keys(bs.keys.job("*"))) == sorted(bs.keys.job(j) for j in ids)
    assert bs.jobs.claim("w", 10) == []
    assert counts(bs, bid) == {"total": 6, "completed": 0, "failed": 2}
    assert len(file_lines(bs, b.error_file_id)) == 2


def test_counts_equal_lines_after_every_path(bs: BatchStore) -> None:
    bid = new_batch(bs, ["ok", "fail", "cancel_q", "cancel_r", "dead"])
    bs.fan_out(bid)
    js = bs.jobs
    by = {x.batch.custom_id: x for x in js.claim("w", 3)}  # type: ignore[union-attr]
    queued = [j for j in bs.job_ids(bid) if j not in {x.job_id for x in by.values()}]
    assert js.cancel(queued[0]) == "cancelled"
    first = next(iter(by))
    assert js.complete(by[first], result())
    rest = [x for c, x in by.items() if c != first]
    assert js.fail(rest[0], "boom")
    assert js.cancel(rest[1].job_id) == "cancelling"
    assert js.finish_cancelled(rest[1])
    (last,) = js.claim("w", 5)
    assert js.complete(last, result())
    c = counts(bs, bid)
    assert c["completed"] + c["failed"] == c["total"] == 5
    assert bs.r.llen(bs.keys.batch_output(bid)) == c["completed"] == 2
    assert bs.r.llen(bs.keys.batch_errors(bid)) == c["failed"] == 3


# ----------------------------------------------------------------------------- expiry, listing
def upload(client: FlaskClient, text: str) -> dict[str, Any]:
    data = {"purpose": "batch", "file": (io.BytesIO(text.encode()), "in.jsonl")}
    resp = client.post("/v1/files", data=data, content_type="multipart/form-data")
    assert resp.status_code == 200, resp.get_json()
    return resp.get_json()


@pytest.fixture
def app(redis_url: str) -> Flask:
    return make_app(redis_url)


def test_files_list_and_delete(app: Flask, redis_url: str) -> None:
    client = app.test_client()
    ids = [upload(client, line(f"x{i}") + "\n")["id"] for i in range(3)]
    got = client.get("/v1/files").get_json()
    assert got["object"] == "list" and [f["id"] for f in got["data"]] == ids[::-1]
    assert got["first_id"] == ids[2] and got["last_id"] == ids[0] and not got["has_more"]
    assert all(f["expires_at"] == f["created_at"] + 30 * 86400 for f in got["data"])
    page = client.get("/v1/files?limit=2").get_json()
    assert [f["id"] for f in page["data"]] == ids[:0:-1] and page["has_more"]
    page2 = client.get(f"/v1/files?limit=2&after={page['last_id']}").get_json()
    assert [f["id"] for f in page2["data"]] == ids[:1] and not page2["has_more"]
    assert client.get("/v1/files?purpose=batch_output").get_json()["data"] == []
    assert client.get("/v1/files?limit=0").status_code == 400
    resp = client.delete(f"/v1/files/{ids[1]}")
    assert resp.status_code == 200
    assert resp.get_json() == {"id": ids[1], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{ids[1]}").status_code == 404
    assert client.delete(f"/v1/files/{ids[1]}").status_code == 404
    assert [f["id"] for f in client.get("/v1/files").get_json()["data"]] == [ids[2], ids[0]]
    r = JobStore(redis_url).r
    assert 0 < r.ttl(JobStore(redis_url).keys.file(ids[0])) <= 30 * 86400


def test_batch_output_expires_after(app: Flask, redis_url: str) -> None:
    client = app.test_client()
    fid = upload(client, line("a") + "\n")["id"]
    body: dict[str, Any] = {"input_file_id": fid, "endpoint": COMPLETIONS_URL}
    bad = {**body, "output_expires_after": {"anchor": "created_at", "seconds": 10}}
    assert client.post("/v1/batches", json=bad).status_code in (400, 422)
    body["output_expires_after"] = {"anchor": "created_at", "seconds": 7200}
    resp = client.post("/v1/batches", json=body)
    assert resp.status_code == 200, resp.get_json()
    bid = resp.get_json()["id"]
    bs = BatchStore(JobStore(redis_url))
    bs.fan_out(bid)
    (lease,) = bs.jobs.claim("w", 5)
    assert bs.jobs.complete(lease, result())
    assert bs.finalize_ready() == [bid]
    done = client.get(f"/v1/batches/{bid}").get_json()
    out = client.get(f"/v1/files/{done['output_file_id']}").get_json()
    assert out["purpose"] == "batch_output"
    assert out["expires_at"] == out["created_at"] + 7200
    assert 0 < bs.r.ttl(bs.keys.file(out["id"])) <= 7200
    assert 0 < bs.r.ttl(bs.keys.batch(bid)) <= 7200
    assert 0 < bs.r.ttl(bs.keys.batch_output(bid)) <= 7200
    listed = client.get("/v1/files?purpose=batch_output").get_json()["data"]
    assert [f["id"] for f in listed] == [out["id"]]


# ----------------------------------------------------------------------------- restart events
def test_reclaimed_lease_appends_restart_and_drops_old_deltas(redis_url: str) -> None:
    js = JobStore(redis_url)
    client = Client(redis_url)
    jid = client.submit("p", {"max_tokens": 4})
    (a,) = js.claim("a", 1)
    assert js.progress(a, 2, "xy", [7, 8])
    (b,) = js.reclaim("b", 0, 1)
    assert b.deliveries == 2 and not js.progress(a, 3, "z", [9])
    assert js.progress(b, 1, "q", [4])
    assert js.complete(b, JobResult(
        completions=[Completion(index=0, text="q", token_ids=[4], finish_reason="stop")],
        prompt_tokens=1, completion_tokens=1,
    ))  # fmt: skip
    events = list(client.stream(jid, timeout=5))
    assert [e.type for e in events] == ["restart", "delta", "end"]
    acc = accumulate(events)
    assert acc.token_ids == {0: [4]} and acc.texts == {0: "q"} and acc.restarts == 1
    sse = make_app(redis_url).test_client().get(f"/v1/jobs/{jid}/events").get_data(as_text=True)
    assert "event: restart" in sse and '"token_ids":[7,8]' not in sse


def test_broken_batch_key_fails_nothing_but_its_line(bs: BatchStore, redis_url: str) -> None:
    """A batch key of the wrong type: a job cancel still answers (its line is logged as lost);
    a worker's final write that would append there is refused whole (nothing written), so the
    worker can write the job without its line."""
    bid = new_batch(bs, ["a", "b"])
    bs.fan_out(bid)
    ja, jb = bs.job_ids(bid)
    bs.r.delete(bs.keys.batch_errors(bid))
    bs.r.set(bs.keys.batch_errors(bid), "not a list")
    resp = make_app(redis_url).test_client().delete(f"/v1/jobs/{ja}")
    assert resp.status_code == 200 and resp.get_json()["status"] == "cancelled"
    (lease,) = bs.jobs.claim("w", 5)
    assert lease.job_id == jb and lease.batch is not None
    step = bs.jobs.commit_step(finished=[Finish(lease, "failed", error="boom")])
    assert [(e.job_id, e.finish is not None) for e in step.errors] == [(jb, True)]
    assert "WRONGTYPE" in step.errors[0].message
    assert bs.jobs.status(jb) == "running" and counts(bs, bid)["failed"] == 0
    plain = dataclasses.replace(lease, batch=None)
    assert bs.jobs.commit_step(finished=[Finish(plain, "failed", error="boom")]).errors == []
    assert bs.jobs.get(jb).error == "boom"  # type: ignore[union-attr]


def test_upload_expires_after(app: Flask, redis_url: str) -> None:
    client = app.test_client()

    def up(seconds: str) -> Any:
        data = {
            "purpose": "batch",
            "expires_after[anchor]": "created_at",
            "expires_after[seconds]": seconds,
            "file": (io.BytesIO((line("a") + "\n").encode()), "in.jsonl"),
        }
        return client.post("/v1/files", data=data, content_type="multipart/form-data")

    f = up("3600").get_json()
    assert f["expires_at"] == f["created_at"] + 3600
    assert 0 < JobStore(redis_url).r.ttl(JobStore(redis_url).keys.file(f["id"])) <= 3600
    assert up("59").status_code == 400 and up("soon").status_code == 400
