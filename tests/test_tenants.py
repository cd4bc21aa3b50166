"""Tenants: each API key belongs to a tenant; another tenant's jobs, files and batches are 404 and
never listed; an admin key sees all; per-tenant limits answer 429 with Retry-After."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from prometheus_client.parser import text_string_to_metric_families

from api.auth import KeyRing, Principal, key_ring, parse_entry, visible
from api.config import ApiConfig
from bench import auth_cost
from pagedserve.batches import BatchStore
from pagedserve.client import Client
from pagedserve.redis_util import connect
from pagedserve.schemas import Completion, JobResult
from pagedserve.store import Finish, JobStore
from pagedserve.telemetry import RunningJob
from pagedserve.tenants import PRUNE_EVERY_MS, TenantBook
from tests.api_fixtures import heartbeat, make_app, publish
from tests.test_cli import cli

KEY_A, KEY_B, KEY_ADMIN, KEY_OLD = "key-a-123", "key-b-456", "key-root-789", "legacy-key"
KEYS = f"team-a:{KEY_A}, team-b:{KEY_B}, ops:{KEY_ADMIN}:admin, {KEY_OLD}"


def hdr(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


A, B, ADMIN, OLD = hdr(KEY_A), hdr(KEY_B), hdr(KEY_ADMIN), hdr(KEY_OLD)


@pytest.fixture
def client(redis_url: str) -> FlaskClient:
    return make_app(redis_url, api_keys=KEYS).test_client()


def submit(client: FlaskClient, who: dict[str, str], body: dict[str, Any] | None = None) -> str:
    resp = client.post("/v1/jobs", json=body or {"prompt": "hello"}, headers=who)
    assert resp.status_code == 202, resp.get_json()
    return str(resp.get_json()["id"])


def assert_404(resp: Any, code: str) -> None:
    assert resp.status_code == 404, (resp.status_code, resp.get_data(as_text=True))
    assert resp.get_json()["error"]["code"] == code


def result(tokens: int) -> JobResult:
    comp = Completion(index=0, text="t", token_ids=[1] * tokens, finish_reason="length")
    return JobResult(completions=[comp], prompt_tokens=1, completion_tokens=tokens)


def line(cid: str, model: str = "tiny") -> str:
    body = {"model": model, "prompt": f"p {cid}", "max_tokens": 2}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body})


def upload(client: FlaskClient, who: dict[str, str], text: str) -> Any:
    data = {"purpose": "batch", "file": (io.BytesIO(text.encode()), "in.jsonl")}
    return client.post("/v1/files", data=data, content_type="multipart/form-data", headers=who)


def make_batch(client: FlaskClient, who: dict[str, str]) -> tuple[str, str]:
    resp = upload(client, who, line("a") + "\n" + line("b") + "\n")
    assert resp.status_code == 200, resp.get_json()
    fid = resp.get_json()["id"]
    body = {"input_file_id": fid, "endpoint": "/v1/completions"}
    resp = client.post("/v1/batches", json=body, headers=who)
    assert resp.status_code == 200, resp.get_json()
    return fid, resp.get_json()["id"]


# ----------------------------------------------------------------------------- jobs
def test_other_tenant_gets_404_for_a_job(client: FlaskClient, redis_url: str) -> None:
    jid = submit(client, A)
    got = client.get(f"/v1/jobs/{jid}", headers=A)
    assert got.status_code == 200 and got.get_json()["tenant"] == "team-a"
    assert_404(client.get(f"/v1/jobs/{jid}", headers=B), "job_not_found")
    assert_404(client.get(f"/v1/jobs/{jid}/events", headers=B), "job_not_found")
    assert_404(client.delete(f"/v1/jobs/{jid}", headers=B), "job_not_found")
    # B's cancel did nothing; the same answer as for an id that does not exist at all.
    assert JobStore(redis_url).status(jid) == "queued"
    assert_404(client.get("/v1/jobs/0123456789abcdef", headers=B), "job_not_found")
    # The admin sees and cancels it; the owner sees the result.
    assert client.get(f"/v1/jobs/{jid}", headers=ADMIN).status_code == 200
    assert client.delete(f"/v1/jobs/{jid}", headers=ADMIN).get_json()["status"] == "cancelled"
    assert client.get(f"/v1/jobs/{jid}", headers=A).get_json()["status"] == "cancelled"


def test_tenant_is_server_written_not_from_metadata(client: FlaskClient, redis_url: str) -> None:
    jid = submit(client, B, {"prompt": "x", "metadata": {"tenant": "team-a"}})
    assert JobStore(redis_url).get(jid).tenant == "team-b"  # type: ignore[union-attr]
    assert_404(client.get(f"/v1/jobs/{jid}", headers=A), "job_not_found")


def test_idempotency_keys_are_per_tenant(client: FlaskClient, redis_url: str) -> None:
    body = {"prompt": "x", "idempotency_key": "order-1"}
    a1, a2, b1 = submit(client, A, body), submit(client, A, body), submit(client, B, body)
    assert a1 == a2 and b1 != a1
    got = client.get(f"/v1/jobs/{b1}", headers=B).get_json()
    assert got["request"]["idempotency_key"] == "order-1"  # shown as the client sent it
    # The stored key carries the tenant and still fits the request's limit (workers parse it).
    long = {"prompt": "x", "idempotency_key": "k" * 256}
    err = client.post("/v1/jobs", json=long, headers=A).get_json()["error"]
    assert err["code"] == "validation_error" and "at most 249" in err["message"]
    fits = submit(client, A, {**long, "idempotency_key": "k" * 249})
    rec = JobStore(redis_url).get(fits)
    assert rec is not None and rec.error is None and len(rec.request.idempotency_key or "") == 256


def test_bare_key_and_untagged_records_are_the_default_tenant(
    client: FlaskClient, redis_url: str
) -> None:
    legacy = Client(redis_url).submit("written by a Redis-side client without a tenant")
    assert client.get(f"/v1/jobs/{legacy}", headers=OLD).status_code == 200
    assert_404(client.get(f"/v1/jobs/{legacy}", headers=A), "job_not_found")
    mine = submit(client, OLD)
    assert JobStore(redis_url).get(mine).tenant == "default"  # type: ignore[union-attr]
    tagged = Client(redis_url, tenant="team-a").submit("trusted Redis-side client")
    assert client.get(f"/v1/jobs/{tagged}", headers=A).status_code == 200
    assert_404(client.get(f"/v1/jobs/{tagged}", headers=OLD), "job_not_found")


# ----------------------------------------------------------------------------- files, batches
def test_other_tenant_gets_404_for_files_and_batches(client: FlaskClient) -> None:
    fid, bid = make_batch(client, A)
    assert client.get(f"/v1/files/{fid}/content", headers=A).status_code == 200
    assert_404(client.get(f"/v1/files/{fid}", headers=B), "file_not_found")
    assert_404(client.get(f"/v1/files/{fid}/content", headers=B), "file_not_found")
    body = {"input_file_id": fid, "endpoint": "/v1/completions"}
    assert_404(client.post("/v1/batches", json=body, headers=B), "file_not_found")
    assert_404(client.get(f"/v1/batches/{bid}", headers=B), "batch_not_found")
    assert_404(client.post(f"/v1/batches/{bid}/cancel", headers=B), "batch_not_found")
    assert client.get(f"/v1/batches/{bid}", headers=A).get_json()["status"] == "validating"
    assert client.get(f"/v1/files/{fid}/content", headers=ADMIN).status_code == 200


def test_batch_lists_are_per_tenant(client: FlaskClient) -> None:
    a_ids = [make_batch(client, A)[1] for _ in range(3)]
    b_ids = [make_batch(client, B)[1]]
    page = client.get("/v1/batches?limit=2", headers=A).get_json()
    assert [x["id"] for x in page["data"]] == a_ids[::-1][:2] and page["has_more"]
    nxt = client.get(f"/v1/batches?limit=2&after={page['last_id']}", headers=A).get_json()
    assert [x["id"] for x in nxt["data"]] == [a_ids[0]] and not nxt["has_more"]
    assert [x["id"] for x in client.get("/v1/batches", headers=B).get_json()["data"]] == b_ids
    # Another tenant's batch id as the cursor is "not found", as any unknown id.
    assert_404(client.get(f"/v1/batches?after={a_ids[0]}", headers=B), "batch_not_found")
    every = client.get("/v1/batches", headers=ADMIN).get_json()["data"]
    assert {x["id"] for x in every} == set(a_ids + b_ids)


def test_fan_out_copies_the_batch_tenant(client: FlaskClient, redis_url: str) -> None:
    _fid, bid = make_batch(client, A)
    bs = BatchStore(redis_url)
    bs.fan_out(bid)
    jobs = bs.jobs.get_many(bs.job_ids(bid))
    assert len(jobs) == 2 and {j.tenant for j in jobs if j} == {"team-a"}
    jid = bs.job_ids(bid)[0]
    assert client.get(f"/v1/jobs/{jid}", headers=A).status_code == 200
    assert_404(client.get(f"/v1/jobs/{jid}", headers=B), "job_not_found")
    # Output and error files are the tenant's too.
    client.post(f"/v1/batches/{bid}/cancel", headers=A)
    done = client.get(f"/v1/batches/{bid}", headers=A).get_json()
    assert done["status"] == "cancelled" and done["error_file_id"]
    err_file = done["error_file_id"]
    assert client.get(f"/v1/files/{err_file}/content", headers=A).status_code == 200
    assert_404(client.get(f"/v1/files/{err_file}/content", headers=B), "file_not_found")


def test_file_list_and_delete_are_per_tenant(client: FlaskClient, redis_url: str) -> None:
    """``GET /v1/files`` lists only the caller's files (an untagged file is the default
    tenant's); another tenant's id is 404 as a cursor and for ``DELETE``; an admin sees all."""
    a_ids = [upload(client, A, line(c) + "\n").get_json()["id"] for c in ("a", "b")]
    b_id = upload(client, B, line("a") + "\n").get_json()["id"]
    legacy = BatchStore(redis_url).files.create(line("a") + "\n", "old.jsonl").id

    def listed(who: dict[str, str], query: str = "") -> list[str]:
        resp = client.get(f"/v1/files{query}", headers=who)
        assert resp.status_code == 200, resp.get_json()
        return [f["id"] for f in resp.get_json()["data"]]

    assert listed(A) == a_ids[::-1] and listed(B) == [b_id] and listed(OLD) == [legacy]
    assert listed(A, "?limit=1") == [a_ids[1]] and listed(A, f"?after={a_ids[1]}") == [a_ids[0]]
    assert set(listed(ADMIN)) == {*a_ids, b_id, legacy}
    assert_404(client.get(f"/v1/files?after={a_ids[1]}", headers=B), "file_not_found")
    assert_404(client.delete(f"/v1/files/{a_ids[0]}", headers=B), "file_not_found")
    assert client.get(f"/v1/files/{a_ids[0]}", headers=A).status_code == 200  # still there
    assert client.delete(f"/v1/files/{a_ids[0]}", headers=A).get_json()["deleted"] is True
    assert listed(A) == [a_ids[1]] and listed(ADMIN).count(a_ids[0]) == 0


def test_generated_files_are_the_tenants_and_count_unrefused(redis_url: str) -> None:
    """A batch's output and error files carry the batch's tenant and count among its file
    bytes, never refused by the limit (a batch's results are not lost); uploads then are."""
    text = line("a") + "\n" + line("b") + "\n"
    limit = len(text.encode())
    client = make_app(redis_url, api_keys=KEYS, tenant_max_file_bytes=limit).test_client()
    _fid, bid = make_batch(client, A)
    bs = BatchStore(redis_url)
    bs.fan_out(bid)
    client.post(f"/v1/batches/{bid}/cancel", headers=A)
    done = client.get(f"/v1/batches/{bid}", headers=A).get_json()
    err_file = done["error_file_id"]
    assert done["status"] == "cancelled" and err_file
    assert bs.files.owner(err_file) == (True, "team-a")
    size = client.get(f"/v1/files/{err_file}", headers=A).get_json()["bytes"]
    assert bs.jobs.tenants.file_bytes("team-a", bs.files.key("")) == limit + size
    assert [f["id"] for f in client.get("/v1/files?purpose=batch_output", headers=A).get_json()[
        "data"]] == [err_file]  # fmt: skip
    assert client.get("/v1/files?purpose=batch_output", headers=B).get_json()["data"] == []
    check_429(upload(client, A, line("c") + "\n"))
    assert upload(client, B, line("c") + "\n").status_code == 200


# ----------------------------------------------------------------------------- limits
def check_429(resp: Any) -> dict[str, Any]:
    assert resp.status_code == 429, (resp.status_code, resp.get_data(as_text=True))
    assert int(resp.headers["Retry-After"]) >= 1
    err = resp.get_json()["error"]
    assert err["code"] == "tenant_limit" and err["type"] == "rate_limit_error"
    return err


def test_open_jobs_limit_per_tenant(redis_url: str) -> None:
    client = make_app(redis_url, api_keys=KEYS, tenant_max_queued=2).test_client()
    first = [submit(client, A), submit(client, A)]
    err = check_429(client.post("/v1/jobs", json={"prompt": "x"}, headers=A))
    assert "2 open jobs" in err["message"]
    submit(client, B)  # another tenant is not affected
    store = JobStore(redis_url)
    assert store.tenants.open_jobs("team-a", force=True) == 2
    # A job that ended frees its place (the count is pruned by job status, at most every 100 ms).
    client.delete(f"/v1/jobs/{first[0]}", headers=A)
    time.sleep(PRUNE_EVERY_MS / 1000 + 0.05)
    submit(client, A)
    check_429(client.post("/v1/jobs", json={"prompt": "x"}, headers=A))
    # A batch cannot be started at the limit either.
    resp = upload(client, A, line("a") + "\n")
    fid = resp.get_json()["id"]
    check_429(
        client.post(
            "/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions"}, headers=A
        )
    )


def test_file_bytes_limit_per_tenant(redis_url: str) -> None:
    text = line("a") + "\n"
    limit = len(text.encode()) * 2
    client = make_app(redis_url, api_keys=KEYS, tenant_max_file_bytes=limit).test_client()
    ids = [upload(client, A, text).get_json()["id"] for _ in range(2)]
    err = check_429(upload(client, A, text))
    assert str(limit) in err["message"]
    assert upload(client, B, text).status_code == 200
    # The refused file was not kept; deleting a file (any code path) frees its bytes.
    r = connect(redis_url)
    assert len(r.keys("ps:file:*")) == 3
    r.delete(JobStore(redis_url).keys.file(ids[0]))
    assert upload(client, A, text).status_code == 200


def test_open_count_stays_bounded_without_limits(redis_url: str) -> None:
    """Ended jobs leave the per-tenant set by sampling at each enqueue, without any limit set."""
    c = Client(redis_url, tenant="team-a")
    book = TenantBook(c.r, c.keys)
    for _ in range(300):
        c.cancel(c.submit("x"))
    assert c.r.scard(book.open_key("team-a")) < 100
    assert book.open_jobs("team-a", force=True) == 0
    assert book.usage("team-a", "ps:file:").jobs_finished == 300


# ----------------------------------------------------------------------------- keys
def test_key_entries() -> None:
    digest = hashlib.sha256(b"s3cret").hexdigest()
    assert parse_entry(f"team-x:sha256:{digest}") == (bytes.fromhex(digest), Principal("team-x"))
    assert parse_entry("admin:k")[1] == Principal("admin", admin=True)
    assert parse_entry("t:k:admin")[1] == Principal("t", admin=True)
    assert parse_entry("bare")[1] == Principal("default")
    for bad in ("t:sha256:abcd", "bad tenant:k", "t:", "a:b:c", ":k"):
        with pytest.raises(ValueError):
            parse_entry(bad)
    ring = KeyRing.parse([f"team-x:sha256:{digest}", "team-y:other"])
    assert ring.lookup("s3cret") == Principal("team-x") and ring.lookup("nope") is None
    assert visible(None, Principal("default")) and not visible(None, Principal("team-x"))
    assert visible("team-x", None) and visible("team-x", Principal("o", admin=True))


def test_keys_file_with_hashed_keys(redis_url: str, tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    digest = hashlib.sha256(b"file-key-a").hexdigest()
    path.write_text(f"# team keys\nteam-a:sha256:{digest}\n\nteam-b:file-key-b\n")
    client = make_app(redis_url, api_keys_file=str(path)).test_client()
    jid = submit(client, hdr("file-key-a"))
    assert client.get(f"/v1/jobs/{jid}", headers=hdr("file-key-a")).status_code == 200
    assert_404(client.get(f"/v1/jobs/{jid}", headers=hdr("file-key-b")), "job_not_found")
    assert client.get(f"/v1/jobs/{jid}", headers=hdr(digest)).status_code == 401


def test_open_mode_warns_once_and_sees_everything(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="api.auth"):
        client = make_app(redis_url).test_client()
        client.get("/healthz")
        client.get("/healthz")
    warnings = [r for r in caplog.records if "no API keys configured" in r.getMessage()]
    assert len(warnings) == 1
    tagged = Client(redis_url, tenant="team-a").submit("x")
    assert client.get(f"/v1/jobs/{tagged}").status_code == 200


# ----------------------------------------------------------------------------- metrics, workers
def tenant_samples(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "tenant" in s.labels:
                out[(s.name, s.labels["tenant"])] = s.value
    return out


def test_metrics_per_tenant(client: FlaskClient, redis_url: str) -> None:
    a_jobs = [submit(client, A) for _ in range(2)]
    submit(client, B)
    store = JobStore(redis_url)
    lease = store.claim("w1", 1)[0]  # interactive first: A's first job runs
    assert lease.job_id == a_jobs[0]
    store.progress(lease, 5, "hello", [1, 2, 3, 4, 5])
    done = Finish(lease, "succeeded", result=result(7))
    assert not store.commit_step(finished=[done]).lost
    time.sleep(PRUNE_EVERY_MS / 1000 + 0.05)
    every = tenant_samples(client.get("/metrics", headers=ADMIN).get_data(as_text=True))
    assert every[("pagedserve:tenant_queue_depth", "team-a")] == 1
    assert every[("pagedserve:tenant_queue_depth", "team-b")] == 1
    assert every[("pagedserve:tenant_generation_tokens_total", "team-a")] == 7
    assert every[("pagedserve:tenant_jobs_finished_total", "team-a")] == 1
    own = tenant_samples(client.get("/metrics", headers=B).get_data(as_text=True))
    assert {t for _, t in own} == {"team-b"}
    rows = client.get("/v1/tenants", headers=A).get_json()["data"]
    assert [(r["tenant"], r["queued"], r["tokens_generated"]) for r in rows] == [("team-a", 1, 7)]


def test_workers_list_hides_other_tenants_jobs(client: FlaskClient, redis_url: str) -> None:
    ja, jb = submit(client, A), submit(client, B)
    hb = heartbeat("w1")
    hb.jobs = [RunningJob(id=ja, tokens=1, max_tokens=16), RunningJob(id=jb, tokens=2)]
    publish(redis_url, hb)

    def shown(who: dict[str, str]) -> set[str]:
        data = client.get("/v1/workers", headers=who).get_json()["data"]
        return {j["id"] for w in data for j in w["jobs"]}

    assert shown(A) == {ja} and shown(B) == {jb} and shown(ADMIN) == {ja, jb}


# ----------------------------------------------------------------------------- CLI, bench
def test_cli_tenant(redis_url: str, tmp_path: Path) -> None:
    jid = cli(redis_url, "--tenant", "team-a", "submit", "hi")[1]["id"]
    assert JobStore(redis_url).get(jid).tenant == "team-a"  # type: ignore[union-attr]
    path = tmp_path / "in.jsonl"
    path.write_text(line("a") + "\n")
    bs = BatchStore(redis_url)
    assert cli(redis_url, "--tenant", "team-b", "batch", "submit", str(path))[0] == 0
    assert cli(redis_url, "batch", "submit", str(path))[0] == 0
    mine = cli(redis_url, "--tenant", "team-b", "batch", "list")[1]["data"]
    assert len(mine) == 1 and bs.owner(mine[0]["id"]) == (True, "team-b")
    assert bs.files.owner(mine[0]["input_file_id"]) == (True, "team-b")
    assert len(cli(redis_url, "batch", "list")[1]["data"]) == 2  # no tenant: every batch


def test_auth_cost_bench_prints_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    auth_cost.main(["--requests", "20", "--rounds", "1", "--tenants", "3"])
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "auth_cost" and out["requests"] == 20
    assert out["get_keyed_p50_us"] > 0 and out["get_ratio_p50"] > 0


def test_limits_and_keys_file_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "keys"
    path.write_text("team-a:k1\n")
    monkeypatch.setenv("PAGEDSERVE_API_KEYS", "team-b:k2, k3")
    monkeypatch.setenv("PAGEDSERVE_API_KEYS_FILE", str(path))
    monkeypatch.setenv("PAGEDSERVE_TENANT_MAX_QUEUED", "7")
    monkeypatch.setenv("PAGEDSERVE_TENANT_MAX_FILE_BYTES", "1000")
    cfg = ApiConfig.from_env()
    assert (cfg.tenant_max_queued, cfg.tenant_max_file_bytes) == (7, 1000)
    ring = key_ring(cfg)
    assert [ring.lookup(k) for k in ("k1", "k2", "k3")] == [
        Principal("team-a"),
        Principal("team-b"),
        Principal("default"),
    ]


def test_enqueue_resent_after_a_partial_noscript_still_counts_the_job(redis_url: str) -> None:
    """A MULTI whose enqueue ran but whose tag got NOSCRIPT (another client's SCRIPT LOAD half
    done): only the tag is resent, the job is created once, and the API's reservation stays as
    that job's entry in the open set (dropping it would leave the job uncounted when it ends)."""
    client = make_app(redis_url, api_keys=KEYS, tenant_max_queued=10).test_client()
    store = JobStore(redis_url)
    store.r.script_flush()
    store.r.script_load(store._scripts["enqueue"].script)  # the cache half loaded
    jid = submit(client, A, {"prompt": "x", "idempotency_key": "k1"})
    rec = store.get(jid)
    assert rec is not None and rec.tenant == "team-a"
    assert store.tenants.open_jobs("team-a", force=True) == 1
    client.delete(f"/v1/jobs/{jid}", headers=A)
    assert store.tenants.usage("team-a", "ps:file:").jobs_finished == 1


def test_usage_counts_ended_jobs_within_the_prune_throttle(redis_url: str) -> None:
    """The usage view prunes unthrottled: a job that ended just after another read is counted."""
    c = Client(redis_url, tenant="team-a")
    book = TenantBook(c.r, c.keys)
    ids = [c.submit("x") for _ in range(3)]
    assert book.usage("team-a", "ps:file:").queued == 3  # sets the prune throttle
    for jid in ids:
        c.cancel(jid)
    u = book.usage("team-a", "ps:file:")  # within PRUNE_EVERY_MS of the first read
    assert (u.queued, u.running, u.jobs_finished) == (0, 0, 3)
