"""The API against a real redis-server with Flask's test client; a 'worker' made of store calls."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from prometheus_client.parser import text_string_to_metric_families
from werkzeug.serving import make_server

from pagedserve.batches import BatchStore
from pagedserve.redis_util import connect
from pagedserve.schemas import Completion, JobResult
from pagedserve.store import JobStore, Lease
from tests.api_fixtures import BLOCK_STATES, heartbeat, make_app, publish


@pytest.fixture
def app(redis_url: str) -> Flask:
    return make_app(redis_url)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def claim_one(store: JobStore, consumer: str = "w1") -> Lease:
    for _ in range(200):
        got = store.claim(consumer, 1)
        if got:
            return got[0]
        time.sleep(0.005)
    raise AssertionError("no job to claim")


def result(text: str, ids: list[int]) -> JobResult:
    comp = Completion(index=0, text=text, token_ids=ids, finish_reason="stop")
    return JobResult(completions=[comp], prompt_tokens=3, completion_tokens=len(ids))


def submit(client: FlaskClient, body: dict[str, Any]) -> str:
    resp = client.post("/v1/jobs", json=body)
    assert resp.status_code == 202, resp.get_json()
    return resp.get_json()["id"]


# ----------------------------------------------------------------------------- jobs
def test_submit_get_cancel(client: FlaskClient, redis_url: str) -> None:
    resp = client.post(
        "/v1/jobs", json={"prompt": "hello", "params": {"max_tokens": 4}, "priority": "bulk"}
    )
    assert resp.status_code == 202
    body = resp.get_json()
    assert body["status"] == "queued" and body["created"] is True
    assert resp.headers["Location"] == f"/v1/jobs/{body['id']}"
    job = client.get(f"/v1/jobs/{body['id']}").get_json()
    assert job["status"] == "queued" and job["priority"] == "bulk"
    assert job["request"]["prompt"] == "hello"
    assert job["progress"] == {"tokens_generated": 0, "max_tokens": 4, "fraction": 0.0}
    assert JobStore(redis_url).queue_lengths() == {"interactive": 0, "bulk": 1}

    resp = client.delete(f"/v1/jobs/{body['id']}")
    assert resp.status_code == 200 and resp.get_json()["status"] == "cancelled"
    assert client.get(f"/v1/jobs/{body['id']}").get_json()["status"] == "cancelled"


def test_idempotent_submit_returns_same_job(client: FlaskClient) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "idempotency_key": "k-1"}
    first = client.post("/v1/jobs", json=body).get_json()
    again = client.post("/v1/jobs", json=body).get_json()
    assert again["id"] == first["id"] and again["created"] is False


def test_running_job_progress_and_result(client: FlaskClient, redis_url: str) -> None:
    jid = submit(client, {"prompt": [1, 2, 3], "params": {"max_tokens": 10, "n": 2}})
    worker = JobStore(redis_url)
    lease = claim_one(worker)
    assert worker.progress(lease, 5, "ab", [7, 8])
    job = client.get(f"/v1/jobs/{jid}").get_json()
    assert job["status"] == "running" and job["worker"] == "w1"
    assert job["progress"] == {"tokens_generated": 5, "max_tokens": 20, "fraction": 0.25}
    # A cancel of a running job asks its worker to stop.
    assert client.delete(f"/v1/jobs/{jid}").get_json()["status"] == "cancelling"
    assert jid in worker.pop_cancels("w1")
    assert worker.finish_cancelled(lease)
    assert client.get(f"/v1/jobs/{jid}").get_json()["status"] == "cancelled"


def test_completed_job_has_result(client: FlaskClient, redis_url: str) -> None:
    jid = submit(client, {"prompt": "x"})
    worker = JobStore(redis_url)
    assert worker.complete(claim_one(worker), result("done", [4, 5]))
    job = client.get(f"/v1/jobs/{jid}").get_json()
    assert job["status"] == "succeeded" and job["progress"]["fraction"] == 1.0
    assert job["result"]["completions"][0]["text"] == "done"


def parse_sse(text: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(id, event, data) of each event; comments skipped."""
    out = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line.startswith(":") or ": " not in line:
                continue
            k, _, v = line.partition(": ")
            fields[k] = v
        if "data" in fields:
            out.append((fields.get("id", ""), fields.get("event", ""), json.loads(fields["data"])))
    return out


def test_events_stream_live_deltas_until_end(client: FlaskClient, redis_url: str) -> None:
    jid = submit(client, {"prompt": "stream me", "params": {"max_tokens": 3}})
    worker = JobStore(redis_url)

    def run() -> None:
        lease = claim_one(worker)
        for i, piece in enumerate(["a", "b", "c"]):
            time.sleep(0.05)
            assert worker.progress(lease, i + 1, piece, [100 + i])
        worker.complete(lease, result("abc", [100, 101, 102]))

    t = threading.Thread(target=run)
    t.start()
    resp = client.get(f"/v1/jobs/{jid}/events")
    text = resp.get_data(as_text=True)
    t.join()
    assert resp.status_code == 200 and resp.mimetype == "text/event-stream"
    events = parse_sse(text)
    deltas = [d for _id, ev, d in events if ev == "delta"]
    assert "".join(d["text"] for d in deltas) == "abc"
    assert [d["token_ids"] for d in deltas] == [[100], [101], [102]]
    assert events[-1][1] == "end" and events[-1][2]["status"] == "succeeded"

    # Resuming after the second delta replays only what came later.
    second = [eid for eid, ev, _d in events if ev == "delta"][1]
    resp = client.get(f"/v1/jobs/{jid}/events", headers={"Last-Event-ID": second})
    later = parse_sse(resp.get_data(as_text=True))
    assert [ev for _i, ev, _d in later] == ["delta", "end"] and later[0][2]["text"] == "c"


def test_events_of_unknown_job_404(client: FlaskClient) -> None:
    resp = client.get("/v1/jobs/nope/events")
    assert resp.status_code == 404 and resp.get_json()["error"]["code"] == "job_not_found"


# ----------------------------------------------------------------------------- pool, workers
def test_pool_and_workers_from_heartbeat(client: FlaskClient, redis_url: str) -> None:
    assert client.get("/v1/pool").get_json()["workers"] == []
    publish(redis_url, heartbeat("w1"))
    submit(client, {"prompt": "q"})
    pool = client.get("/v1/pool").get_json()
    assert pool["queues"] == {"interactive": 1, "bulk": 0}
    (w,) = pool["workers"]
    assert w["worker_id"] == "w1" and w["running"] == 2 and w["waiting"] == 1
    assert w["prefix_cache_hit_rate"] == 0.25 and w["throughput_tok_s"] == 42.5
    p = w["pool"]
    assert (p["blocks_total"], p["blocks_free"], p["blocks_in_use"]) == (16, 7, 9)
    assert (p["blocks_cached"], p["blocks_shared"], p["tokens_stored"]) == (3, 2, 130)
    assert p["block_state_counts"] == {"free": 4, "in_use": 7, "cached": 3, "shared": 2}
    assert p["block_states"] == BLOCK_STATES
    assert p["fragmentation"] == pytest.approx(14 / (9 * 16))
    assert (p["kv_cache_dtype"], p["kv_cache_bytes"]) == ("bfloat16", 16 * 4096)
    assert p["kv_cache_bytes_in_use"] == 9 * 4096

    (wk,) = client.get("/v1/workers").get_json()["data"]
    assert wk["worker_id"] == "w1" and wk["host"] == "gpu-1" and wk["pid"] == 4242
    assert wk["jobs"] == [{"id": "job-a", "tokens": 8, "max_tokens": 16, "fraction": 0.5}]
    assert wk["kv_cache_usage"] == 9 / 16 and 0 <= wk["age_s"] < 5
    assert client.get("/v1/queues").get_json()["depth"] == {"interactive": 1, "bulk": 0}


def test_model_id_with_a_slash_is_retrievable(client: FlaskClient, redis_url: str) -> None:
    """Hub-style ids (``org/name``) reach ``GET /v1/models/{id}`` as the openai client sends
    them, with the slash unescaped."""
    publish(redis_url, heartbeat("w1").model_copy(update={"model": "HuggingFaceTB/SmolLM2"}))
    listed = client.get("/v1/models").get_json()["data"]
    assert [m["id"] for m in listed] == ["HuggingFaceTB/SmolLM2"]
    resp = client.get("/v1/models/HuggingFaceTB/SmolLM2")
    assert resp.status_code == 200 and resp.get_json()["id"] == "HuggingFaceTB/SmolLM2"
    missing = client.get("/v1/models/HuggingFaceTB/other")
    assert missing.status_code == 404
    assert missing.get_json()["error"]["code"] == "model_not_found"


# ----------------------------------------------------------------------------- health
def test_healthz_and_readyz(redis_url: str) -> None:
    app = make_app(redis_url, stall_s=0.05)
    client = app.test_client()
    assert client.get("/healthz").get_json() == {"status": "ok"}
    resp = client.get("/readyz")
    assert resp.status_code == 503 and resp.get_json()["reason"] == "no live worker heartbeat"

    publish(redis_url, heartbeat("w1", steps=10, running=2))
    assert client.get("/readyz").status_code == 200  # first sight of the counter
    time.sleep(0.1)
    resp = client.get("/readyz")  # busy, and the counter has not moved for longer than stall_s
    assert resp.status_code == 503 and not resp.get_json()["workers"]["w1"]["ready"]
    publish(redis_url, heartbeat("w1", steps=11, running=2))
    assert client.get("/readyz").status_code == 200  # it advanced
    time.sleep(0.1)
    publish(redis_url, heartbeat("w1", steps=11, running=0))
    resp = client.get("/readyz")  # not advancing, but idle
    assert resp.status_code == 200 and resp.get_json()["workers"]["w1"]["reason"] == "idle"


def test_readyz_stale_heartbeat_and_unreachable_redis(redis_url: str) -> None:
    client = make_app(redis_url, heartbeat_fresh_s=0.0).test_client()
    publish(redis_url, heartbeat("w1", running=0))
    time.sleep(0.02)
    resp = client.get("/readyz")
    assert resp.status_code == 503 and "old" in resp.get_json()["workers"]["w1"]["reason"]

    down = make_app("unix:///tmp/no-such-dir/redis.sock").test_client()
    resp = down.get("/readyz")
    assert resp.status_code == 503 and "unreachable" in resp.get_json()["redis"]
    assert down.get("/healthz").status_code == 200
    resp = down.get("/v1/pool")
    assert resp.status_code == 503 and resp.get_json()["error"]["code"] == "redis_unavailable"


# ----------------------------------------------------------------------------- metrics
def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_text_parses_with_values(client: FlaskClient, redis_url: str) -> None:
    publish(redis_url, heartbeat("w1"))
    submit(client, {"prompt": "a", "priority": "bulk"})
    submit(client, {"prompt": "b", "priority": "bulk"})
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.mimetype == "text/plain"
    s = samples(resp.get_data(as_text=True))
    w = (("worker", "w1"),)
    assert s[("pagedserve:queue_depth", (("priority", "bulk"),))] == 2
    assert s[("pagedserve:queue_depth", (("priority", "interactive"),))] == 0
    assert s[("pagedserve:num_workers", ())] == 1
    assert s[("pagedserve:num_requests_running", w)] == 2
    assert s[("pagedserve:num_requests_waiting", w)] == 1
    assert s[("pagedserve:kv_cache_usage_perc", w)] == 9 / 16
    assert s[("pagedserve:kv_cache_bytes", w)] == 16 * 4096
    assert s[("pagedserve:prefix_cache_queries_total", w)] == 200
    assert s[("pagedserve:prefix_cache_hits_total", w)] == 50
    assert s[("pagedserve:num_preemptions_total", w)] == 3
    assert s[("pagedserve:generation_tokens_total", w)] == 321
    assert s[("pagedserve:prompt_tokens_total", w)] == 900
    assert s[("pagedserve:request_success_total", (("status", "failed"), *w))] == 1
    assert s[("pagedserve:request_success_total", (("status", "succeeded"), *w))] == 5
    assert s[("pagedserve:kv_cache_blocks", (("state", "cached"), *w))] == 3
    ttft = "pagedserve:time_to_first_token_seconds"
    assert s[(ttft + "_bucket", (("le", "0.025"), *w))] == 1
    assert s[(ttft + "_bucket", (("le", "0.5"), *w))] == 3
    assert s[(ttft + "_bucket", (("le", "+Inf"), *w))] == 4
    assert s[(ttft + "_count", w)] == 4 and s[(ttft + "_sum", w)] == pytest.approx(7.62)
    assert s[("pagedserve:e2e_request_latency_seconds_count", w)] == 1
    loop = "pagedserve:worker_loop_seconds_total"
    assert s[(loop, (("phase", "engine"), *w))] == 12.5
    assert s[(loop, (("phase", "service"), *w))] == 0.75
    assert s[("pagedserve:worker_engine_cpu_seconds_total", w)] == 12.25


# ----------------------------------------------------------------------------- misc
def test_openapi_document(client: FlaskClient, app: Flask) -> None:
    doc = client.get("/openapi.json").get_json()
    assert doc["openapi"].startswith("3.1")
    documented = {p.replace("{id}", "<>") for p in doc["paths"]}
    for rule in app.url_map.iter_rules():
        if rule.endpoint in ("static", "dashboard.page"):
            continue
        path = rule.rule
        for arg in rule.arguments:
            path = re.sub(rf"<(\w+:)?{arg}>", "<>", path)
        assert path in documented, f"{rule.rule} is not in the OpenAPI document"
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            assert method.lower() in doc["paths"][path.replace("<>", "{id}")], (method, path)
    assert "JobRequest" in doc["components"]["schemas"]


def test_api_imports_without_torch(tmp_path) -> None:
    # A meta-path finder that refuses torch (and anything engine-side) as if not installed.
    block = tmp_path / "sitecustomize.py"
    block.write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'triton', 'transformers', 'worker',"
        " 'scheduler', 'kernels'):\n"
        "            raise ModuleNotFoundError(f'blocked: {name}', name=name)\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    code = (
        "import sys, api, api.server\n"
        "app = api.create_app({'redis_url': 'redis://127.0.0.1:1/0'})\n"
        "assert app.test_client().get('/healthz').status_code == 200\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'worker', 'scheduler',"
        " 'kernels')]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{__import__('os').getcwd()}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ----------------------------------------------------------------------------- files, batches
def batch_line(cid: str, content: str = "hi", **body: Any) -> str:
    b = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    b.update(body)
    line = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": b}
    return json.dumps(line)


def upload(client: FlaskClient, text: str, purpose: str = "batch") -> Any:
    data = {"purpose": purpose, "file": (io.BytesIO(text.encode()), "in.jsonl")}
    return client.post("/v1/files", data=data, content_type="multipart/form-data")


def test_files_and_batches(client: FlaskClient, redis_url: str) -> None:
    text = "\n".join([batch_line("a"), batch_line("b", temperature=-1), batch_line("c")]) + "\n"
    resp = upload(client, text)
    assert resp.status_code == 200, resp.get_json()
    f = resp.get_json()
    assert f["object"] == "file" and f["purpose"] == "batch" and f["bytes"] == len(text)
    assert client.get(f"/v1/files/{f['id']}").get_json()["filename"] == "in.jsonl"
    content = client.get(f"/v1/files/{f['id']}/content")
    assert content.get_data(as_text=True) == text

    r = connect(redis_url)
    queued_before = r.llen("celery")
    resp = client.post(
        "/v1/batches",
        json={
            "input_file_id": f["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "metadata": {"run": "7"},
        },
    )
    assert resp.status_code == 200, resp.get_json()
    b = resp.get_json()
    assert b["object"] == "batch" and b["status"] == "validating" and b["metadata"] == {"run": "7"}
    # The fan-out task was sent to the broker by name (no Celery worker runs here).
    assert r.llen("celery") == queued_before + 1
    msg = json.loads(r.lindex("celery", 0))
    assert msg["headers"]["task"] == "batches.fan_out" and msg["headers"]["argsrepr"] == repr(
        [b["id"]]
    )
    # Run what that task runs, then read the batch back through the API.
    BatchStore(JobStore(redis_url)).fan_out(b["id"])
    got = client.get(f"/v1/batches/{b['id']}").get_json()
    assert got["status"] == "in_progress"
    assert got["request_counts"] == {"total": 3, "completed": 0, "failed": 1}
    assert JobStore(redis_url).queue_lengths()["bulk"] == 2

    resp = client.post(f"/v1/batches/{b['id']}/cancel")
    assert resp.status_code == 200 and resp.get_json()["status"] == "cancelled"


def test_batches_list_pagination(client: FlaskClient) -> None:
    fid = upload(client, batch_line("x") + "\n").get_json()["id"]
    body = {"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    ids = [client.post("/v1/batches", json=body).get_json()["id"] for _ in range(5)]
    page1 = client.get("/v1/batches?limit=2").get_json()
    assert [x["id"] for x in page1["data"]] == ids[::-1][:2] and page1["has_more"]
    page2 = client.get(f"/v1/batches?limit=2&after={page1['last_id']}").get_json()
    assert [x["id"] for x in page2["data"]] == ids[::-1][2:4] and page2["has_more"]
    page3 = client.get(f"/v1/batches?limit=2&after={page2['last_id']}").get_json()
    assert [x["id"] for x in page3["data"]] == ids[:1] and not page3["has_more"]


@pytest.fixture
def live_server(app: Flask) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, threaded=True)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1"
    finally:
        server.shutdown()
        t.join(5)


def test_official_openai_client(live_server: str, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai", reason="pip install openai to test the official client")
    oa = openai.OpenAI(base_url=live_server, api_key="unused", max_retries=0)
    path = tmp_path / "in.jsonl"
    path.write_text(batch_line("q1") + "\n" + batch_line("q2") + "\n")
    f = oa.files.create(file=path.open("rb"), purpose="batch")
    assert f.id.startswith("file-") and f.purpose == "batch"
    assert oa.files.retrieve(f.id).bytes == path.stat().st_size
    assert oa.files.content(f.id).text == path.read_text()
    b = oa.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert b.status == "validating" and b.input_file_id == f.id
    assert oa.batches.retrieve(b.id).id == b.id
    assert [x.id for x in oa.batches.list(limit=10).data] == [b.id]
    assert oa.batches.cancel(b.id).status in ("cancelling", "cancelled")
    with pytest.raises(openai.NotFoundError) as e:
        oa.batches.retrieve("batch_missing")
    assert "not found" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        oa.files.create(file=io.BytesIO(b"not json\n"), purpose="batch")


def test_pagedserve_api_runs_gunicorn(redis_url: str) -> None:
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "stack", "--redis", redis_url, "api", "--port", str(port),
           "--workers", "1", "--threads", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        body = None
        for _ in range(100):
            try:
                url = f"http://127.0.0.1:{port}/healthz"
                body = urllib.request.urlopen(url, timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        assert body is not None and json.loads(body) == {"status": "ok"}
    finally:
        proc.terminate()
        out = proc.communicate(timeout=20)[0].decode()
    assert "gthread" in out
