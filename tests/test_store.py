"""JobStore against a real redis-server: leases, fencing, reclaim, dead letters, cancel, release."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from pydantic import ValidationError

from pagedserve.keys import GROUP, WINDOW_CONSUMER
from pagedserve.redis_url import is_cluster
from pagedserve.redis_util import connect
from pagedserve.schemas import Completion, JobRequest, JobResult, JobStatus
from pagedserve.store import Finish, JobStore, Progress


def req(prompt: str = "hello", **kw: object) -> JobRequest:
    return JobRequest(prompt=prompt, **kw)  # type: ignore[arg-type]


def result(text: str, ids: list[int]) -> JobResult:
    comp = Completion(index=0, text=text, token_ids=ids, finish_reason="length")
    return JobResult(completions=[comp], prompt_tokens=3, completion_tokens=len(ids))


def pending_count(store: JobStore, priority: str) -> int:
    return store.r.xpending(store.keys.stream(priority), GROUP)["pending"]


@pytest.fixture
def store(redis_url: str) -> JobStore:
    return JobStore(redis_url, retention_s=100)


def test_enqueue_and_get(store: JobStore) -> None:
    r = req(metadata={"user": "u1"}, params={"max_tokens": 5, "temperature": 0.0})
    jid, created = store.enqueue("j1", r)
    assert (jid, created) == ("j1", True)
    rec = store.get("j1")
    assert rec is not None
    assert rec.status == JobStatus.QUEUED
    assert rec.request == r
    assert rec.deliveries == 0 and rec.started_at is None and rec.result is None
    assert rec.created_at == pytest.approx(time.time(), abs=60)
    assert store.get("nope") is None
    assert store.status("nope") == JobStatus.NOT_FOUND
    assert store.queue_lengths() == {"interactive": 1, "bulk": 0}


def test_idempotency_key_returns_same_job(store: JobStore) -> None:
    assert store.enqueue("a", req(idempotency_key="k1")) == ("a", True)
    assert store.enqueue("b", req("other", idempotency_key="k1")) == ("a", False)
    assert store.enqueue("c", req(idempotency_key="k2")) == ("c", True)
    assert store.get("b") is None
    assert store.r.xlen(store.keys.stream("interactive")) == 2


def test_claim_interactive_before_bulk_and_max_jobs(store: JobStore) -> None:
    for i in range(3):
        store.enqueue(f"b{i}", req(priority="bulk"))
    for i in range(3):
        store.enqueue(f"i{i}", req())
    assert [x.job_id for x in store.claim("w", 2)] == ["i0", "i1"]
    assert [x.job_id for x in store.claim("w", 3)] == ["i2", "b0", "b1"]
    assert store.claim("w", 0) == []
    last = store.claim("w", 5)
    assert [(x.job_id, x.priority, x.fence, x.deliveries) for x in last] == [("b2", "bulk", 1, 1)]
    assert store.claim("w", 5) == []
    rec = store.get("b2")
    assert rec is not None and rec.status == JobStatus.RUNNING and rec.worker == "w"


def test_claim_blocks_when_empty(store: JobStore) -> None:
    t0 = time.monotonic()
    assert store.claim("w", 4, block_ms=50) == []
    assert time.monotonic() - t0 >= 0.04


def test_own_pending_entries_reread_after_restart(redis_url: str) -> None:
    first = JobStore(redis_url)
    for i in range(3):
        first.enqueue(f"j{i}", req())
    before = first.claim("w1", 2)
    assert [x.job_id for x in before] == ["j0", "j1"]
    # The process dies; a new one with the same consumer name picks its entries up first.
    second = JobStore(redis_url)
    after = second.claim("w1", 10)
    assert [x.job_id for x in after] == ["j0", "j1", "j2"]
    assert [x.deliveries for x in after] == [2, 2, 1]
    assert [x.fence for x in after] == [2, 2, 1]
    # Re-read once only: those are now running in this process.
    assert second.claim("w1", 10) == []
    # The old process's leases are dead.
    assert not first.complete(before[0], result("x", [1]))


def test_fencing_reclaimed_job_written_exactly_once(redis_url: str) -> None:
    a, b = JobStore(redis_url), JobStore(redis_url)
    a.enqueue("j", req())
    (la,) = a.claim("A", 1)
    time.sleep(0.02)
    (lb,) = b.reclaim("B", min_idle_ms=5, max_jobs=10)
    assert (lb.job_id, lb.fence, lb.deliveries) == ("j", 2, 2)
    assert not a.progress(la, 1, "stale", [9])
    assert not a.complete(la, result("from A", [1]))
    assert b.complete(lb, result("from B", [2, 3]))
    assert not a.fail(la, "late failure")
    assert not b.complete(lb, result("again", [4]))  # a second write by the owner is refused too
    rec = b.get("j")
    assert rec is not None and rec.status == JobStatus.SUCCEEDED
    assert rec.result == result("from B", [2, 3])
    assert rec.worker == "B" and rec.tokens_generated == 2 and rec.error is None
    ends = [f for _, f in a.r.xrange(a.keys.events("j")) if f["type"] == "end"]
    assert ends == [{"type": "end", "status": "succeeded"}]
    assert pending_count(a, "interactive") == 0
    assert a.renew([la]) == ["j"]


def test_renew_keeps_entries_from_being_reclaimed(redis_url: str) -> None:
    a, b = JobStore(redis_url), JobStore(redis_url)
    a.enqueue("kept", req())
    a.enqueue("lost", req())
    leases = a.claim("A", 2)
    time.sleep(0.3)
    assert a.renew([x for x in leases if x.job_id == "kept"]) == []
    taken = b.reclaim("B", min_idle_ms=200, max_jobs=10)
    assert [x.job_id for x in taken] == ["lost"]
    assert a.renew(leases) == ["lost"]
    rec = a.get("kept")
    assert rec is not None and rec.worker == "A" and rec.status == JobStatus.RUNNING


def test_reclaim_leaves_the_callers_held_jobs_alone(redis_url: str) -> None:
    """Reclaim finds the caller's own idle entries too: a job it still serves (``held``)
    is not leased again, so its delivery count does not grow; an own entry it no longer holds
    (a write lost in a failover, say) is taken back as before."""
    a = JobStore(redis_url)
    a.enqueue("held", req())
    a.enqueue("orphan", req())
    leases = a.claim("A", 2)
    time.sleep(0.05)
    taken = a.reclaim("A", min_idle_ms=10, max_jobs=10, held={"held"})
    assert [(x.job_id, x.deliveries, x.fence) for x in taken] == [("orphan", 2, 2)]
    held = next(x for x in leases if x.job_id == "held")
    assert a.renew([held]) == []  # its first lease still stands
    rec = a.get("held")
    assert rec is not None and rec.status == JobStatus.RUNNING and rec.worker == "A"
    assert int(a.r.hget(a.keys.job("held"), "deliveries")) == 1


def test_reclaim_leaves_the_admission_window_alone(redis_url: str) -> None:
    """Entries waiting in the admission window (pending under its consumer, which no process
    runs) are not a dead worker's: however long they wait, reclaim does not take them, while a
    dead worker's idle entry behind them is taken (the reclaim cursor walks past the window)."""
    a = JobStore(redis_url)
    for jid in ("w1", "w2", "dead"):
        a.enqueue(jid, req(priority="bulk"))
    a.ensure_groups()
    stream = a.keys.stream("bulk")
    a.r.xreadgroup(GROUP, WINDOW_CONSUMER, {stream: ">"}, count=2)  # into the window
    (gone,) = a.claim("gone-worker", 1)
    assert gone.job_id == "dead"
    time.sleep(0.05)
    taken = a.reclaim("B", min_idle_ms=10, max_jobs=10)
    assert [(x.job_id, x.deliveries) for x in taken] == [("dead", 2)]
    window = a.r.xpending_range(stream, GROUP, "-", "+", 10, consumername=WINDOW_CONSUMER)
    assert len(window) == 2 and all(w["times_delivered"] == 1 for w in window)
    assert a.reclaim("B", min_idle_ms=10, max_jobs=10) == []  # from the start again: nothing


def test_dead_letter_after_max_deliveries(redis_url: str) -> None:
    s = JobStore(redis_url, max_deliveries=2)
    s.enqueue("j", req())
    assert len(s.claim("A", 1)) == 1
    time.sleep(0.01)
    assert len(s.reclaim("B", 1, 1)) == 1
    time.sleep(0.01)
    assert s.reclaim("C", 1, 1) == []
    assert s.stats.dead_lettered == 1
    rec = s.get("j")
    assert rec is not None and rec.status == JobStatus.FAILED and rec.deliveries == 3
    assert rec.error is not None and "delivered 3 times" in rec.error
    (dead,) = s.dead_letters()
    assert dead["job"] == "j" and dead["deliveries"] == "3"
    assert pending_count(s, "interactive") == 0
    time.sleep(0.01)
    assert s.reclaim("D", 1, 1) == []


def test_cancel_queued_job_is_skipped_at_claim(store: JobStore) -> None:
    store.enqueue("j", req())
    assert store.cancel("j") == JobStatus.CANCELLED
    assert store.claim("w", 5) == []
    assert store.stats.skipped == 1
    assert pending_count(store, "interactive") == 0
    assert store.cancel("j") == JobStatus.CANCELLED
    assert store.cancel("missing") == JobStatus.NOT_FOUND


def test_cancel_running_job(store: JobStore) -> None:
    store.enqueue("j", req())
    store.enqueue("other", req())
    leases = {x.job_id: x for x in store.claim("w", 2)}
    assert store.cancel("j") == JobStatus.CANCELLING
    assert store.status("j") == JobStatus.CANCELLING
    step = store.commit_step("w", progress=[Progress(leases["other"], 1, "a", [7])])
    assert step.cancels == {"j"} and step.lost == []
    assert store.pop_cancels("w") == set()
    assert store.renew(list(leases.values())) == []  # still ours while cancelling
    assert store.finish_cancelled(leases["j"])
    assert store.status("j") == JobStatus.CANCELLED
    assert store.cancel("j") == JobStatus.CANCELLED


def test_release_hands_job_back(redis_url: str) -> None:
    s = JobStore(redis_url, max_deliveries=1)
    s.enqueue("j", req())
    (lease,) = s.claim("A", 1)
    assert s.progress(lease, 2, "ab", [1, 2])
    assert s.release(lease) == JobStatus.QUEUED
    rec = s.get("j")
    assert rec is not None and rec.status == JobStatus.QUEUED and rec.worker is None
    assert rec.tokens_generated == 0 and rec.deliveries == 0
    assert not s.complete(lease, result("x", [1]))
    assert s.release(lease) is None
    (again,) = s.claim("B", 1)  # max_deliveries=1: the release did not count
    assert again.job_id == "j" and again.fence == lease.fence + 2
    types = [f["type"] for _, f in s.r.xrange(s.keys.events("j"))]
    assert types == ["restart"]  # the handed-back run's deltas are trimmed
    assert pending_count(s, "interactive") == 1
    # Releasing a job being cancelled cancels it.
    s.cancel("j")
    assert s.release(again) == JobStatus.CANCELLED
    assert pending_count(s, "interactive") == 0


def test_commit_step_batches_many_jobs(store: JobStore) -> None:
    ids = [f"j{i}" for i in range(50)]
    for jid in ids:
        store.enqueue(jid, req())
    leases = store.claim("w", 100)
    assert len(leases) == 50
    step = store.commit_step("w", progress=[Progress(x, 1, "t", [5]) for x in leases])
    assert step.lost == [] and step.cancels == set()
    done = [Finish(x, "succeeded", result=result("t", [5])) for x in leases[:25]]
    failed = [Finish(x, "failed", error="oom") for x in leases[25:]]
    step = store.commit_step("w", finished=done + failed)
    assert step.lost == []
    statuses = store.statuses(ids)
    assert statuses == [JobStatus.SUCCEEDED] * 25 + [JobStatus.FAILED] * 25
    rec = store.get("j30")
    assert rec is not None and rec.error == "oom" and rec.first_token_at is not None
    again = store.commit_step("w", finished=done[:3])
    assert again.lost == ["j0", "j1", "j2"]


def test_a_lease_carries_the_jobs_submission_time(store: JobStore) -> None:
    """The lease script returns the record's ``created_at`` (the worker's time-to-first-token
    and latency start there; it was a round trip more per claim round)."""
    store.enqueue("j", req())
    (lease,) = store.claim("w", 1)
    raw = store.r.hget(store.keys.job("j"), "created_at")
    assert raw and lease.created_at == float(raw)
    assert lease.batch is None and lease.idem_key is None


def evalsha_calls(store: JobStore) -> int:
    return int(store.r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_steps_deltas_go_in_one_script_call_each_job_answered_apart(store: JobStore) -> None:
    """progress.lua: every delta of a step in one call; each job still gets its own
    answer: written, refused (a stale lease), or its own error (its events key is not a
    stream), which stops that job's writes and no other's."""
    for jid in ("a", "b", "c", "d"):
        store.enqueue(jid, req())
    leases = {x.job_id: x for x in store.claim("w", 4)}
    store.r.set(store.keys.events("b"), "not a stream")
    stale = replace(leases["c"], fence=leases["c"].fence + 1)
    deltas = [
        Progress(leases["a"], 2, "hi", [1, 2]),
        Progress(leases["b"], 1, "x", [3]),
        Progress(stale, 1, "y", [4]),
        Progress(leases["d"], 1, "z", [5], end=2),
    ]
    before = evalsha_calls(store)
    step = store.commit_step(progress=deltas)
    # one call on a single Redis; on a cluster (``--redis-cluster``) one per job, as the jobs'
    # keys lie in different slots
    assert evalsha_calls(store) == before + (len(deltas) if is_cluster(store.r) else 1)
    assert [e.job_id for e in step.errors] == ["b"] and "WRONGTYPE" in step.errors[0].message
    assert step.errors[0].finish is None
    assert step.lost == ["c"] and step.refused == [("c", stale.fence)]
    got = {jid: store.get(jid) for jid in "abcd"}
    assert {jid: r.tokens_generated for jid, r in got.items() if r} == {
        "a": 2, "b": 0, "c": 0, "d": 1,
    }  # fmt: skip
    (ev,) = [f for _, f in store.r.xrange(store.keys.events("a"))]
    assert ev["type"] == "delta" and ev["text"] == "hi" and ev["token_ids"] == "[1,2]"
    # Sent again (the reply was lost with the connection): d's delta is not written twice.
    assert store.commit_step(progress=deltas[3:]).lost == []
    assert len(store.r.xrange(store.keys.events("d"))) == 1


def test_retention_ttl_set_when_job_ends(store: JobStore) -> None:
    store.enqueue("j", req(idempotency_key="idem"))
    (lease,) = store.claim("w", 1)
    assert store.progress(lease, 1, "a", [1])
    assert store.r.ttl(store.keys.job("j")) == -1
    assert store.r.ttl(store.keys.idem("idem")) == -1
    assert store.complete(lease, result("a", [1]))
    for key in (store.keys.job("j"), store.keys.events("j"), store.keys.idem("idem")):
        assert 0 < store.r.ttl(key) <= 100


def test_every_end_of_a_job_expires_its_declared_idempotency_key(redis_url: str) -> None:
    """The scripts that end a job declare its idempotency key (issue #19): finish and release
    take it from the lease, cancel reads it with the owner, and lease, which learns it only from
    the record, answers 'idem' (nothing changed) to a call naming another key and is called
    again naming it. Each end puts the retention TTL on the key."""
    s = JobStore(redis_url, retention_s=100, max_deliveries=1)
    s.enqueue("q", req(idempotency_key="q"))
    assert s.cancel("q") == JobStatus.CANCELLED  # queued
    s.enqueue("d", req(idempotency_key="d"))
    (ld,) = s.claim("A", 5)  # (q's entry is skipped)
    assert ld.idem_key == s.keys.idem("d")
    time.sleep(0.01)
    assert s.reclaim("B", 1, 1) == [] and s.stats.dead_lettered == 1  # dead-lettered at lease
    rec = s.get("d")
    assert rec is not None and rec.status == JobStatus.FAILED and rec.deliveries == 2
    s.enqueue("c", req(idempotency_key="c"))
    assert len(s.claim("A", 1)) == 1
    assert s.cancel("c") == JobStatus.CANCELLING
    time.sleep(0.01)
    assert s.reclaim("B", 1, 1) == []  # its owner died while it was being cancelled
    s.enqueue("r", req(idempotency_key="r"))
    (lr,) = s.claim("A", 1)
    s.cancel("r")
    assert s.release(lr) == JobStatus.CANCELLED
    s.enqueue("f", req(idempotency_key="f"))
    (lf,) = s.claim("A", 1)
    # A final write naming another key (none: the job key) is refused before it writes.
    step = s.commit_step(finished=[Finish(replace(lf, idem_key=None), "failed", error="x")])
    assert len(step.errors) == 1 and s.status("f") == JobStatus.RUNNING
    assert s.r.ttl(s.keys.idem("f")) == -1
    assert s.fail(lf, "x")
    assert s.statuses(list("qdcrf")) == [JobStatus.CANCELLED, JobStatus.FAILED] + [
        JobStatus.CANCELLED
    ] * 2 + [JobStatus.FAILED]
    for k in "qdcrf":
        assert 0 < s.r.ttl(s.keys.idem(k)) <= 100, k
    # A cancel naming another key than the record's answers 'moved' and changes nothing.
    s.enqueue("m", req(idempotency_key="m"))
    job = s.keys.job("m")
    keys = [job, s.keys.events("m"), s.keys.cancel("", s.keys.shard("m")), job]
    assert s._exec([("cancel", keys, ["", s.retention_s, s.events_maxlen])])[0] == ["moved", 0]
    assert s.status("m") == JobStatus.QUEUED and s.r.ttl(s.keys.idem("m")) == -1


def test_scripts_reloaded_after_script_flush(store: JobStore) -> None:
    store.enqueue("a", req())
    store.r.script_flush()
    store.enqueue("b", req())
    assert [x.job_id for x in store.claim("w", 5)] == ["a", "b"]


def test_heartbeat_and_workers(store: JobStore) -> None:
    store.heartbeat("w1", {"free_blocks": 12, "running": 3}, ttl_s=10)
    workers = store.workers()
    assert workers["w1"]["free_blocks"] == 12 and workers["w1"]["running"] == 3
    assert 0 < store.r.ttl(store.keys.worker("w1")) <= 10
    store.r.delete(store.keys.worker("w1"))
    assert store.workers() == {}


def test_queued_jobs_survive_redis_crash_with_aof(redis_factory) -> None:  # type: ignore[no-untyped-def]
    server = redis_factory(aof=True)
    s = JobStore(server.url)
    s.enqueue("j", req())
    server.kill()
    server.start()
    s2 = JobStore(server.url)
    (lease,) = s2.claim("w", 1)
    assert lease.job_id == "j"
    s2.r.close()
    s.r.close()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one of"),
        ({}, "exactly one of"),
        ({"prompt": ""}, "prompt must not be empty"),
        ({"prompt": [1, -2]}, "non-negative"),
        ({"messages": []}, "at least one message"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"prompt": "a", "priority": "urgent"}, "'interactive' or 'bulk'"),
        ({"prompt": "a", "colour": "red"}, "Extra inputs are not permitted"),
        ({"prompt": "a", "params": {"temperature": -1}}, "temperature"),
        ({"prompt": "a", "params": {"max_tokens": 2, "min_tokens": 3}}, "min_tokens (3)"),
        ({"prompt": "a", "metadata": {"x": "y" * 20000}}, "at most 512 characters"),
        ({"prompt": "a", "metadata": {f"k{i}": "é" * 512 for i in range(16)}}, "16384 bytes"),
    ],
)
def test_bad_requests_have_clear_messages(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError) as e:
        JobRequest.model_validate(fields)
    assert message in str(e.value)


def test_fixture_server_is_private(redis_url: str) -> None:
    if redis_url.startswith("redis+cluster://"):
        pytest.skip("--redis-cluster: the cluster's nodes listen on local TCP ports")
    assert redis_url.startswith("unix://")
    client = connect(redis_url)
    assert client.config_get("port")["port"] == "0"
    assert client.dbsize() == 0


def test_half_loaded_script_cache_runs_no_call_twice(store: JobStore) -> None:
    """After a SCRIPT FLUSH and a half-done reload (only the enqueue script cached), a pipeline
    whose enqueue ran and whose tenant tag got NOSCRIPT resends only the tag: the job is queued
    once (one stream entry), reported created, and tagged."""
    store.r.script_flush()
    store.r.script_load(store._scripts["enqueue"].script)
    jid, created = store.enqueue("half-1", req(), tenant="team-a")
    assert (jid, created) == ("half-1", True)
    assert store.r.xlen(store.keys.stream("interactive")) == 1
    rec = store.get("half-1")
    assert rec is not None and rec.tenant == "team-a"
