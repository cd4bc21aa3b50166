"""Streaming online requests under load and when clients leave: 64 concurrent streams against
the live stack while ``GET /v1/pool`` keeps answering; a client that disconnects mid-stream
leaves no running job and no held blocks; seats (429 with ``Retry-After``, counted in
``/metrics``) and the restart bookkeeping of a stream."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.online_stream import ChoiceText, Diverged
from pagedserve.schemas import JobStatus
from pagedserve.store import JobStore
from tests.api_fixtures import heartbeat, make_app, publish
from tests.api_live import HOST, JsonClient
from tests.fixtures.workers import frozen, wait_for
from tests.online_live import Stack, stack

openai = pytest.importorskip("openai", reason="pip install openai (a dev dependency)")
__all__ = ["stack"]

CLIENTS = 64


def test_64_streams_while_pool_answers(stack: Stack) -> None:
    oa = stack.client()
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            stream = oa.chat.completions.create(
                model=stack.model,
                messages=[{"role": "user", "content": f"Count to {i}."}],
                max_tokens=64,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            parts = []
            for c in stream:
                if c.choices and c.choices[0].delta.content:
                    parts.append(c.choices[0].delta.content)
                if c.choices and c.choices[0].finish_reason:
                    finish[i] = c.choices[0].finish_reason
            texts[i] = "".join(parts)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(CLIENTS)]
    latencies: list[float] = []
    with JsonClient(stack.api.port, timeout=10) as probe:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            t0 = time.perf_counter()
            pool = probe.get("/v1/pool")
            latencies.append(time.perf_counter() - t0)
            assert pool["workers"][0]["worker_id"] == "online-w"
            time.sleep(0.02)
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert sorted(texts) == list(range(CLIENTS)) and all(texts.values())
    assert set(finish.values()) == {"length"}
    # Status endpoints keep answering with every stream open (seats < threads).
    assert len(latencies) >= 3 and max(latencies) < 1.0, sorted(latencies)[-5:]


def _open_stream(port: int, body: dict[str, Any]) -> tuple[socket.socket, str]:
    """A raw streaming request; returns the socket once the first content delta arrived, and
    the job id (from the chunk id)."""
    sock = socket.create_connection((HOST, port), timeout=30)
    raw = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(raw)}\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + raw)
    buf = b""
    while b'"content":"' not in buf.split(b"\r\n\r\n", 1)[-1].replace(b'"content":""', b""):
        got = sock.recv(65536)
        assert got, buf
        buf += got
    first = next(x for x in buf.decode().split("\n") if x.startswith("data: {"))
    return sock, json.loads(first[6:])["id"].removeprefix("chatcmpl-")


def test_disconnect_cancels_and_frees_blocks(stack: Stack) -> None:
    body = {
        "model": stack.model,
        "messages": [{"role": "user", "content": "Tell me everything."}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    sock, job_id = _open_stream(stack.api.port, body)
    store = JobStore(stack.redis_url)
    # The worker and its engine held while the API notices (see the test below).
    with frozen(stack.worker.proc.pid):
        sock.close()  # the client goes away mid-stream
        wait_for(lambda: store.status(job_id) == JobStatus.CANCELLING, 10, "the cancel asked")
    rec = wait_for(lambda: (r := store.get(job_id)) and r.status.terminal and r, 20, "the end")
    assert rec.status == JobStatus.CANCELLED and rec.tokens_generated < 400

    def pool_idle() -> bool:
        hb = store.workers()["online-w"]
        return hb["running"] == 0 and hb["pool"]["in_use"] == 0

    wait_for(pool_idle, 10, "no running job and no blocks in use")


def test_non_stream_disconnect_cancels_the_job(stack: Stack) -> None:
    """A waiting (non-streaming) client that gives up cancels its job too: the API watches its
    socket while the job runs."""
    store = JobStore(stack.redis_url)
    before = set(store.r.keys("ps:job:*"))
    body = {
        "model": stack.model,
        "messages": [{"role": "user", "content": "Tell me everything, slowly."}],
        "max_tokens": 400,
        "ignore_eos": True,
    }
    sock = socket.create_connection((HOST, stack.api.port), timeout=30)
    raw = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(raw)}\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + raw)

    def running() -> str | None:
        new = set(store.r.keys("ps:job:*")) - before
        for key in new:
            rec = store.get(key.removeprefix("ps:job:"))
            if rec is not None and rec.status == JobStatus.RUNNING:
                return rec.id
        return None

    job_id = wait_for(running, 20, "the job started")
    # The worker and its engine process held while the API notices: on a fast CPU the tiny
    # model's 400 tokens take ~0.2 s, about what noticing a hang-up and cancelling take, so the
    # job often ended first (a stop of the worker alone left its engine generating).
    with frozen(stack.worker.proc.pid):
        sock.close()
        wait_for(lambda: store.status(job_id) == JobStatus.CANCELLING, 10, "the cancel asked")
    rec = wait_for(lambda: (r := store.get(job_id)) and r.status.terminal and r, 20, "the end")
    assert rec.status == JobStatus.CANCELLED and rec.tokens_generated < 400
    wait_for(lambda: store.workers()["online-w"]["running"] == 0, 10, "no running job")


def test_non_stream_request_answers_after_a_disconnected_stream(stack: Stack) -> None:
    resp = stack.client().completions.create(model=stack.model, prompt=[1, 2, 3], max_tokens=3)
    assert resp.usage.completion_tokens >= 1


# ----------------------------------------------------------------------------- seats
def _rejected(client: Any, **kw: Any) -> dict[str, float]:
    text = client.get("/metrics", **kw).get_data(as_text=True)
    return {
        s.labels["code"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "pagedserve:api_rejected_requests_total"
    }


def test_no_seat_is_429_with_retry_after_and_counted(redis_url: str) -> None:
    publish(redis_url, heartbeat())  # a live worker serving "tiny-llama" (that never runs jobs)
    app = make_app(redis_url, online_seats=1, online_seat_wait_s=0.2, online_retry_after_s=3)
    client = app.test_client()
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    held = client.post("/v1/chat/completions", json={**body, "stream": True}, buffered=False)
    assert held.status_code == 200  # the seat is held while the stream is open
    busy = client.post("/v1/chat/completions", json=body)
    assert busy.status_code == 429 and busy.headers["Retry-After"] == "3"
    assert busy.get_json()["error"]["code"] == "server_busy"
    assert _rejected(client) == {"server_busy": 1.0}
    store = JobStore(redis_url)
    (job_id,) = [k.split(":")[-1] for k in store.r.scan_iter(store.keys.job("*"))]
    assert store.status(job_id) == JobStatus.QUEUED
    held.close()  # the client leaves before the first chunk: its job is cancelled, seat freed
    assert store.status(job_id) == JobStatus.CANCELLED
    again = client.post("/v1/chat/completions", json={**body, "stream": True}, buffered=False)
    assert again.status_code == 200
    again.close()


def test_tenant_limit_on_online_requests_is_429(redis_url: str) -> None:
    publish(redis_url, heartbeat())
    app = make_app(redis_url, api_keys=("team-a:ka",), tenant_max_queued=1)
    client = app.test_client()
    auth = {"Authorization": "Bearer ka"}
    body = {"model": "tiny-llama", "prompt": "hi", "stream": True}
    first = client.post("/v1/completions", json=body, headers=auth, buffered=False)
    assert first.status_code == 200
    second = client.post("/v1/completions", json=body, headers=auth)
    assert second.status_code == 429 and second.get_json()["error"]["code"] == "tenant_limit"
    first.close()
    assert _rejected(client, headers=auth) == {"tenant_limit": 1.0}


# ----------------------------------------------------------------------------- restarts
def test_choice_text_after_restart_sends_only_what_is_new() -> None:
    t = ChoiceText()
    assert [t.feed(x) for x in ("Hel", "lo")] == ["Hel", "lo"]
    t.restart()
    assert [t.feed(x) for x in ("He", "llo w", "orld")] == ["", " w", "orld"]
    assert t.shown == "Hello world"
    t.restart()
    with pytest.raises(Diverged):
        t.feed("Bye")


def test_stream_keeps_the_http_connection_usable(stack: Stack) -> None:
    body = {"model": stack.model, "prompt": "a", "max_tokens": 2, "stream": True}
    conn = http.client.HTTPConnection(HOST, stack.api.port, timeout=30)
    for _ in range(2):
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        assert conn.getresponse().read().decode().endswith("data: [DONE]\n\n")
    conn.close()


def test_online_routes_answer_errors_in_openai_shape(redis_url: str) -> None:
    client = make_app(redis_url).test_client()
    cases = [
        (client.get("/v1/chat/completions"), 405),
        (client.post("/v1/completions", data="x", content_type="text/plain"), 415),
        (client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "a"}), 404),
        (client.get("/v1/models/nope"), 404),
    ]
    for resp, status in cases:
        assert resp.status_code == status
        err = resp.get_json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
