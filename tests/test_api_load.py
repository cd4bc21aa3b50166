"""Load through the real HTTP API: gunicorn -> redis-server -> two real worker processes.

5,000 short generations are posted to ``POST /v1/jobs`` over keep-alive ``http.client``
connections from a few threads (mixed token-id, text and chat prompts; interactive and bulk).
Checks: every job succeeded exactly once with its requested number of tokens, both workers took a
share, the KV pools are empty afterwards (``GET /v1/pool``), nothing is left pending in the
streams, and each worker's resident memory does not grow between a 500-job warm-up and the end.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from pagedserve.keys import GROUP, PRIORITIES
from pagedserve.schemas import JobStatus
from pagedserve.store import JobStore
from tests.api_live import ApiServer, JsonClient, api_server, rss_kib
from tests.fixtures.workers import StartWorker, WorkerProcess, wait_for

TOTAL_JOBS = 5000
WARMUP_JOBS = 500
SUBMIT_THREADS = 4
WORKER_IDS = ("load-a", "load-b")
#: Per worker: small batches keep steps short; the pool (256 blocks x 16) is ample for them.
WORKER_ARGS = ("--max-num-seqs", "48")
#: Deadline for one phase's jobs to finish after its last submission.
FINISH_TIMEOUT_S = 120.0
#: Worker RSS may grow by at most this much between warm-up and the end (KiB).
RSS_SLACK_KIB = 64 * 1024
RSS_SLACK_FRACTION = 0.15

TEXTS = (
    "The quick brown fox",
    "def main():",
    "Once upon a time, in a land far away, there lived",
    "import os",
    "Redis streams and consumer groups",
    "A paged KV cache stores keys and values in fixed-size blocks.",
)


def job_body(i: int) -> dict[str, Any]:
    """Job ``i`` of the run: deterministic prompt kind, length, priority and max_tokens."""
    rng = random.Random(i)
    kind = i % 10
    body: dict[str, Any]
    if kind < 4:
        body = {"prompt": [rng.randrange(5, 500) for _ in range(rng.randint(1, 40))]}
    elif kind < 9:
        body = {"prompt": f"{rng.choice(TEXTS)} #{i}"}
    else:
        body = {"messages": [{"role": "user", "content": f"{rng.choice(TEXTS)} ({i})"}]}
    body["params"] = {"max_tokens": 2 + i % 3, "temperature": 0, "ignore_eos": True}
    body["priority"] = "interactive" if i % 5 == 0 else "bulk"
    # Makes a POST that lost its connection safe to send again (same job id back).
    body["idempotency_key"] = f"load-{i}"
    return body


#: With tenants on: job ``i`` is submitted with ``KEYS[TENANTS[i % 2]]``; the admin reads all.
TENANTS = ("team-a", "team-b")
KEYS = {"team-a": "load-key-a", "team-b": "load-key-b", "ops": "load-key-ops"}
API_KEYS = "team-a:load-key-a,team-b:load-key-b,ops:load-key-ops:admin"


def tenant_of(i: int) -> str:
    return TENANTS[i % 2]


def submit_all(
    port: int, indices: Sequence[int], keyed: bool = False
) -> tuple[dict[int, str], float, int]:
    """POST jobs ``indices`` from SUBMIT_THREADS keep-alive connections (with ``keyed``, each
    job with its tenant's key).

    Returns (index -> job id, seconds, reconnects)."""
    ids: dict[int, str] = {}
    errors: list[str] = []
    reconnects = [0]
    lock = threading.Lock()

    def run(part: Sequence[int]) -> None:
        got: dict[int, str] = {}
        tenants = TENANTS if keyed else (None,)
        clients = {t: JsonClient(port, KEYS[t] if t else None, timeout=30) for t in tenants}
        client = clients[tenants[0]]
        with contextlib.ExitStack() as stack:
            for c in clients.values():
                stack.enter_context(c)
            try:
                for i in part:
                    client = clients[tenant_of(i) if keyed else None]
                    status, body = client.request("POST", "/v1/jobs", job_body(i))
                    if status != 202 or not isinstance(body, dict) or "id" not in body:
                        raise AssertionError(f"job {i}: HTTP {status}: {body}")
                    got[i] = body["id"]
            except Exception as e:
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
            finally:
                with lock:
                    ids.update(got)
                    reconnects[0] += sum(c.reconnects for c in clients.values())

    parts = [indices[k::SUBMIT_THREADS] for k in range(SUBMIT_THREADS)]
    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in parts]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    elapsed = time.monotonic() - t0
    assert not any(t.is_alive() for t in threads), "submission threads did not finish in 120 s"
    assert not errors, errors[:5]
    assert len(ids) == len(indices)
    return ids, elapsed, reconnects[0]


def wait_finished(store: JobStore, ids: Sequence[str], timeout: float) -> None:
    """Poll the store (pipelined HGETs) until every job is terminal."""
    pending = list(ids)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        statuses = store.statuses(pending)
        pending = [j for j, s in zip(pending, statuses, strict=True) if not s.terminal]
        if pending:
            time.sleep(0.2)
    if pending:
        counts: dict[str, int] = {}
        for s in store.statuses(pending):
            counts[s.value] = counts.get(s.value, 0) + 1
        raise AssertionError(f"{len(pending)} jobs not finished after {timeout} s: {counts}")


def pools_idle(client: JsonClient) -> dict[str, Any] | None:
    """``/v1/pool`` when both workers report no blocks in use, nothing running or waiting."""
    pool = client.get("/v1/pool")
    workers = {w["worker_id"]: w for w in pool["workers"]}
    if set(workers) != set(WORKER_IDS):
        return None
    for w in workers.values():
        p = w["pool"]
        if p is None or p["blocks_in_use"] != 0 or w["running"] != 0 or w["waiting"] != 0:
            return None
    return pool


def heartbeat_finished(client: JsonClient) -> dict[str, dict[str, int]] | None:
    """Each worker's ``jobs_finished`` from its heartbeat, once together they count every job.

    Why wait: the loop counts a final write when its writer thread reports it; the heartbeat
    that first shows a pool idle can be a periodic one sent before the writer's last reports
    were taken (its counts trailed the store's by a few jobs: 2299 against 2313), and the one
    with the final counts follows as the loop drains (``Worker._settled``)."""
    hbs = {w["worker_id"]: w for w in client.get("/v1/workers")["data"]}
    if set(hbs) != set(WORKER_IDS):
        return None
    finished = {wid: hbs[wid]["jobs_finished"] for wid in WORKER_IDS}
    if sum(sum(f.values()) for f in finished.values()) < TOTAL_JOBS:
        return None
    return finished


def settled_rss(workers: Sequence[WorkerProcess], client: JsonClient) -> dict[str, int]:
    """Each worker's RSS (KiB) once the pools are idle (fresh heartbeats say so)."""
    wait_for(lambda: pools_idle(client), timeout=20, what="both pools idle")
    time.sleep(0.5)  # let the loops go back to their idle claim
    return {w.worker_id: rss_kib(w.proc.pid) for w in workers}


@pytest.fixture(params=[False, True], ids=["open", "tenants"])
def keyed(request: pytest.FixtureRequest) -> bool:
    """Without keys, and with two tenants' keys, an admin key and a per-tenant limit."""
    return bool(request.param)


@pytest.fixture
def api(redis_url: str, tmp_path: Path, keyed: bool) -> Iterator[ApiServer]:
    kw: dict[str, Any] = {}
    if keyed:  # the limit is far above the run's needs: the admission path runs on every POST
        kw = {"api_keys": API_KEYS, "env_extra": {"PAGEDSERVE_TENANT_MAX_QUEUED": "100000"}}
    with api_server(redis_url, tmp_path / "api.log", workers=2, threads=8, **kw) as server:
        yield server


def check_tenants(port: int, store: JobStore, ids: dict[int, str]) -> None:
    """Every record carries its submitter's tenant; the other tenant gets 404; the per-tenant
    counts have drained (the admin's /v1/tenants)."""
    recs = store.get_many([ids[i] for i in sorted(ids)])
    wrong = [i for i, r in zip(sorted(ids), recs, strict=True) if not r or r.tenant != tenant_of(i)]
    assert not wrong, wrong[:5]
    for i in random.Random(3).sample(sorted(ids), 10):
        owner, other = tenant_of(i), TENANTS[1 - i % 2]
        with JsonClient(port, KEYS[owner]) as own, JsonClient(port, KEYS[other]) as them:
            assert own.request("GET", f"/v1/jobs/{ids[i]}")[0] == 200
            assert them.request("GET", f"/v1/jobs/{ids[i]}")[0] == 404
    time.sleep(0.2)  # past the prune throttle
    with JsonClient(port, KEYS["ops"]) as admin:
        rows = {r["tenant"]: r for r in admin.get("/v1/tenants")["data"]}
    assert {t: (rows[t]["queued"], rows[t]["running"]) for t in TENANTS} == {
        t: (0, 0) for t in TENANTS
    }
    assert sum(rows[t]["jobs_finished"] for t in TENANTS) == len(ids)


def test_5000_jobs_through_http_api(
    redis_url: str,
    make_tiny_model,  # type: ignore[no-untyped-def]
    start_worker: StartWorker,
    api: ApiServer,
    keyed: bool,
) -> None:
    t_start = time.monotonic()
    model_dir = make_tiny_model("llama")
    workers = [
        start_worker(redis_url, model_dir, wid, *WORKER_ARGS, ready=False) for wid in WORKER_IDS
    ]
    for w in workers:
        w.wait_ready()
    store = JobStore(redis_url)
    client = JsonClient(api.port, KEYS["ops"] if keyed else None)
    try:
        # Phase 1: warm-up.
        warm_ids, warm_s, rc1 = submit_all(api.port, range(WARMUP_JOBS), keyed)
        wait_finished(store, list(warm_ids.values()), FINISH_TIMEOUT_S)
        rss_warm = settled_rss(workers, client)

        # Phase 2: the rest, timed end to end (first POST to last job finished).
        t0 = time.monotonic()
        main_ids, main_submit_s, rc2 = submit_all(api.port, range(WARMUP_JOBS, TOTAL_JOBS), keyed)
        sample = random.Random(7).sample(sorted(main_ids.values()), 40)
        wait_finished(store, list(main_ids.values()), FINISH_TIMEOUT_S)
        main_total_s = time.monotonic() - t0
        rss_end = settled_rss(workers, client)
        ids = {**warm_ids, **main_ids}
        assert len(set(ids.values())) == TOTAL_JOBS
        if keyed:
            check_tenants(api.port, store, ids)

        # A sample through the HTTP API: the job JSON as clients see it.
        for jid in sample:
            job = client.get(f"/v1/jobs/{jid}")
            assert job["status"] == "succeeded", job
            assert job["progress"]["fraction"] == 1.0
            mt = job["request"]["params"]["max_tokens"]
            assert job["result"]["completion_tokens"] == mt == job["progress"]["tokens_generated"]
            assert job["worker"] in WORKER_IDS
            # Its events stream: one end event, never a restart (it ran once).
            types = [f["type"] for _eid, f in store.r.xrange(store.keys.events(jid))]
            assert types.count("end") == 1 and "restart" not in types, (jid, types)

        # Every job, from the store: succeeded once, right token counts, by one of our workers.
        by_worker = dict.fromkeys(WORKER_IDS, 0)
        by_priority = dict.fromkeys(PRIORITIES, 0)
        problems: list[str] = []
        order = sorted(ids)
        for k in range(0, len(order), 500):
            chunk = order[k : k + 500]
            recs = store.get_many([ids[i] for i in chunk])
            for i, rec in zip(chunk, recs, strict=True):
                body = job_body(i)
                mt = body["params"]["max_tokens"]
                if rec is None or rec.status != JobStatus.SUCCEEDED or rec.result is None:
                    problems.append(f"job {i}: {rec and rec.status} {rec and rec.error}")
                    continue
                comp = rec.result.completions
                ok = (
                    len(comp) == 1
                    and len(comp[0].token_ids) == mt
                    and comp[0].finish_reason == "length"
                    and rec.result.completion_tokens == mt == rec.tokens_generated
                    and rec.deliveries == 1
                    and rec.worker in WORKER_IDS
                    and rec.priority == body["priority"]
                    and rec.started_at is not None
                    and rec.finished_at is not None
                )
                if ok and isinstance(body.get("prompt"), list):
                    ok = rec.result.prompt_tokens == len(body["prompt"])
                if not ok:
                    problems.append(f"job {i}: {rec.model_dump_json()[:400]}")
                    continue
                by_worker[rec.worker] += 1  # type: ignore[index]
                by_priority[rec.priority] += 1
        assert not problems, f"{len(problems)} bad jobs, e.g. {problems[:3]}"
        assert all(n > 0 for n in by_worker.values()), by_worker
        assert sum(by_worker.values()) == TOTAL_JOBS

        # Exactly once: the workers' own counters of final writes add up to the job count, and
        # no stream entry is left pending (every delivery acknowledged) or dead-lettered.
        finished = wait_for(
            lambda: heartbeat_finished(client), timeout=20, what="heartbeats counting every job"
        )
        assert all(set(f) == {"succeeded"} for f in finished.values()), finished
        assert {wid: f["succeeded"] for wid, f in finished.items()} == by_worker
        for prio in PRIORITIES:
            pend = store.r.xpending(store.keys.stream(prio), GROUP)
            assert pend["pending"] == 0, (prio, pend)
        assert store.dead_letters() == []

        # The KV pools are back to empty and the queues drained.
        pool = pools_idle(client)
        assert pool is not None
        assert pool["queues"] == dict.fromkeys(PRIORITIES, 0)
        for w in pool["workers"]:
            assert w["pool"]["block_state_counts"]["in_use"] == 0
            assert w["pool"]["block_state_counts"]["shared"] == 0

        # Worker memory does not grow.
        growth = {wid: rss_end[wid] - rss_warm[wid] for wid in WORKER_IDS}
        figures = (
            f"RSS KiB after {WARMUP_JOBS}-job warm-up {rss_warm}, after {TOTAL_JOBS} {rss_end}, "
            f"growth {growth}; phase 2: {len(main_ids)} jobs submitted in {main_submit_s:.1f} s "
            f"({len(main_ids) / main_submit_s:.0f} jobs/s over HTTP), all finished in "
            f"{main_total_s:.1f} s ({len(main_ids) / main_total_s:.0f} jobs/s end to end); "
            f"warm-up submitted in {warm_s:.1f} s; by worker {by_worker}, by priority "
            f"{by_priority}; reconnects {rc1 + rc2}; test {time.monotonic() - t_start:.1f} s"
        )
        print(figures)
        for wid in WORKER_IDS:
            bound = max(RSS_SLACK_KIB, int(RSS_SLACK_FRACTION * rss_warm[wid]))
            assert growth[wid] < bound, f"worker {wid} RSS grew by {growth[wid]} KiB: {figures}"
    except BaseException:
        for w in workers:
            print(f"--- worker {w.worker_id} log tail:\n{w.log()}")
        print(f"--- api log tail:\n{api.log()}")
        raise
    finally:
        client.close()
        store.r.close()
