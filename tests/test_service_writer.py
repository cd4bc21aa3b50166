"""The service loop's writer thread (worker/writer.py) against a real redis-server: deltas keep
their order per job and completion, a final write lands after every delta of its job, a lost
lease is refused with its fence, closing drains what is pending, a Redis outage keeps everything
for later while the loop goes on, and one job's refused write fails that job only."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from pagedserve.client import Client, accumulate, new_job_id
from pagedserve.params import SamplingParams
from pagedserve.schemas import Completion, DeltaEvent, JobRequest, JobResult, JobStatus
from pagedserve.store import Finish, JobStore, Lease, Progress, StepResult
from tests.fixtures.redis_server import RedisFactory
from tests.fixtures.workers import loop_once, run_loop_until, wait_for
from worker.engine import Engine
from worker.service import WRITE_FAILED, ServiceConfig
from worker.writer import Batch, Writer

SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


def leases(store: JobStore, n: int, consumer: str = "w") -> list[Lease]:
    """``n`` queued jobs, leased by ``consumer``, in submission order."""
    reqs = [(new_job_id(), JobRequest(prompt=f"job {i}", params=SHORT)) for i in range(n)]
    ids = [jid for jid, _ in store.enqueue_many(reqs)]
    got = store.claim(consumer, n)
    assert sorted(x.job_id for x in got) == sorted(ids)
    return sorted(got, key=lambda x: ids.index(x.job_id))


def events(store: JobStore, job_id: str) -> list[DeltaEvent]:
    return [DeltaEvent.from_stream(i, f) for i, f in store.r.xrange(store.keys.events(job_id))]


def result(ids: list[int], text: str) -> JobResult:
    comp = Completion(index=0, text=text, token_ids=ids, finish_reason="length")
    return JobResult(completions=[comp], prompt_tokens=3, completion_tokens=len(ids))


@pytest.fixture
def store(redis_url: str) -> JobStore:
    return JobStore(redis_url)


def test_batch_merges_deltas_per_job_lease_and_completion(store: JobStore) -> None:
    a, b = leases(store, 2)
    batch = Batch()
    batch.add([Progress(a, 1, "x", [1]), Progress(a, 1, "p", [9], index=1)], [])
    batch.add([Progress(b, 1, "q", [5]), Progress(a, 2, "y", [2])], [])
    batch.add([Progress(a, 3, "z", [3])], [Finish(b, "failed", error="e")])
    ups = batch.updates()
    assert [(p.lease.job_id, p.index) for p in ups] == [(a.job_id, 0), (a.job_id, 1), (b.job_id, 0)]
    assert (ups[0].delta_text, list(ups[0].delta_token_ids)) == ("xyz", [1, 2, 3])
    # Every update of a job carries its newest count (index 1 had nothing new since count 1).
    assert [p.tokens_generated for p in ups] == [3, 3, 1]
    assert [f.lease.job_id for f in batch.finals] == [b.job_id]
    # A newer lease of the same job is never merged with the old one's deltas.
    newer = Lease(a.job_id, a.fence + 1, "w", a.priority, a.entry_id, a.request, 2)
    batch.add([Progress(newer, 1, "n", [4])], [])
    assert len(batch.updates()) == 4
    # After a failed send, later deltas never merge into those sent once (sent again as they
    # were); they follow them, in order.
    batch.attempt += 1
    batch.add([Progress(a, 4, "w", [8])], [])
    ups = batch.updates()
    assert [(p.lease.job_id, p.delta_text) for p in ups][-1] == (a.job_id, "w")
    assert ups[0].delta_text == "xyz" and ups[0].tokens_generated == 4


def test_a_delta_sent_again_is_written_once(store: JobStore) -> None:
    (a,) = leases(store, 1)
    sent = [Progress(a, 2, "ab", [1, 2], end=4), Progress(a, 3, "c", [3], end=6)]
    assert not store.commit_step(progress=sent).errors
    again = store.commit_step(progress=[*sent, Progress(a, 4, "d", [4], end=8)])
    assert not again.lost and not again.errors
    acc = accumulate(events(store, a.job_id))
    assert acc.token_ids == {0: [1, 2, 3, 4]} and acc.texts == {0: "abcd"}


def test_deltas_arrive_in_order_and_the_final_write_after_them(store: JobStore) -> None:
    jobs = leases(store, 3)
    writer = Writer(store, "w")
    sent: dict[tuple[str, int], list[int]] = {}
    for step in range(150):  # one token a step for each job and, for the first, two completions
        ups = []
        for lease in jobs:
            for index in (0, 1) if lease is jobs[0] else (0,):
                tok = 1000 * index + step
                sent.setdefault((lease.job_id, index), []).append(tok)
                ups.append(Progress(lease, step + 1, f"<{tok}>", [tok], index))
        finals = []
        if step == 99:  # the second job ends mid-run: its final write is queued with no wait
            finals = [Finish(jobs[1], "succeeded", result=result(sent[jobs[1].job_id, 0], "r"))]
            jobs_left = [jobs[0], jobs[2]]
        writer.put(ups, finals, cancels=True)
        if step == 99:
            jobs = jobs_left
    assert writer.flush(30)
    reports = writer.take_reports()
    assert reports and all(not r.lost and not r.errors for r in reports)
    assert [s for r in reports for s in r.finished] == ["succeeded"]
    for (jid, index), toks in sent.items():
        evs = events(store, jid)
        acc = accumulate(evs)
        assert acc.token_ids[index] == toks
        assert acc.texts[index] == "".join(f"<{t}>" for t in toks)
    first, second, _ = (k[0] for k in sent if k[1] == 0)
    assert all(e.type == "delta" for e in events(store, first))  # still running
    assert store.r.hget(store.keys.job(first), "tokens_generated") == "150"
    evs = events(store, second)
    assert [e.type for e in evs][-1] == "end" and [e.type for e in evs].count("end") == 1
    rec = store.get(second)
    assert rec is not None and rec.status == JobStatus.SUCCEEDED
    assert rec.result is not None and rec.result.completions[0].token_ids == list(range(100))
    assert writer.close(5) and writer.idle()


def test_bulk_writes_wait_for_the_next_send_urgent_ones_go_at_once(store: JobStore) -> None:
    """A write not marked urgent waits for the writer's next send (at most ``interval_s`` after
    the last one), so that writes of many steps wake the thread once; an urgent one (or a
    flush) sends everything in hand at once, in order."""
    a, b, c = leases(store, 3)
    writer = Writer(store, "w", interval_s=60.0)
    writer.put([Progress(a, 1, "x", [1])], [], cancels=False, urgent=False)  # the first send
    deadline = time.monotonic() + 30
    while not events(store, a.job_id) and time.monotonic() < deadline:
        time.sleep(0.01)
    writer.put([Progress(b, 1, "y", [2])], [], cancels=False, urgent=False)
    time.sleep(0.5)
    assert events(store, b.job_id) == []  # due a minute after the first send
    writer.put([Progress(c, 1, "z", [3])], [], cancels=False, urgent=True)
    deadline = time.monotonic() + 30
    while not events(store, c.job_id) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert accumulate(events(store, b.job_id)).texts == {0: "y"}  # sent with the urgent one
    assert accumulate(events(store, c.job_id)).texts == {0: "z"}
    writer.put([], [Finish(b, "succeeded", result=result([2], "y"))], cancels=False, urgent=False)
    assert writer.flush(30)  # a flush does not wait for the interval either
    assert store.status(b.job_id) == JobStatus.SUCCEEDED
    assert writer.close(5)


def test_a_lost_lease_is_refused_with_its_fence(store: JobStore) -> None:
    (old,) = leases(store, 1)
    (new,) = store.reclaim("x", 0, 1)  # presumed dead: another worker took the job
    assert new.fence > old.fence
    writer = Writer(store, "w")
    writer.put([Progress(old, 1, "stale", [1])], [], cancels=False)
    writer.put([], [Finish(old, "succeeded", result=result([1], "stale"))], cancels=False)
    assert writer.flush(30)
    reports = writer.take_reports()
    refused = [x for r in reports for x in r.refused]
    assert refused == [(old.job_id, old.fence)] * 2
    assert not any(r.finished for r in reports)  # a refused final write finished nothing
    assert [e.type for e in events(store, old.job_id)] == ["restart"]  # nothing of the old run
    assert store.status(old.job_id) == JobStatus.RUNNING
    writer.put([Progress(new, 1, "fresh", [2])], [], cancels=False)
    assert writer.flush(30) and not writer.take_reports()[0].refused
    assert accumulate(events(store, new.job_id)).texts == {0: "fresh"}
    writer.close(5)


def test_close_writes_everything_pending(store: JobStore) -> None:
    jobs = leases(store, 20)
    writer = Writer(store, "w")
    for lease in jobs:
        writer.put([Progress(lease, 1, "a", [3])], [], cancels=True)
    writer.put([], [Finish(x, "succeeded", result=result([3], "a")) for x in jobs], cancels=False)
    assert writer.close(30)  # no flush first: closing drains
    assert writer._thread is not None and not writer._thread.is_alive()
    recs = [store.get(x.job_id) for x in jobs]
    assert all(r is not None and r.status == JobStatus.SUCCEEDED for r in recs)
    assert store.r.xpending(store.keys.stream("interactive"), "workers")["pending"] == 0
    with pytest.raises(RuntimeError):
        writer.put([], [], cancels=True)


def test_one_jobs_refused_or_unbuildable_write_fails_that_job_only(store: JobStore) -> None:
    broken, unbuildable, fine = leases(store, 3)
    store.r.delete(store.keys.events(broken.job_id))
    store.r.set(store.keys.events(broken.job_id), "not a stream")
    writer = Writer(store, "w")
    ups = [
        Progress(broken, 1, "a", [1]),
        Progress(unbuildable, 1, "b", [object()]),  # type: ignore[list-item]
        Progress(fine, 1, "c", [3]),
    ]
    writer.put(ups, [], cancels=False)
    assert writer.flush(30)
    (rep,) = writer.take_reports()
    assert {e.job_id for e in rep.errors} == {broken.job_id, unbuildable.job_id}
    assert "WRONGTYPE" in next(e.message for e in rep.errors if e.job_id == broken.job_id)
    assert not rep.lost and accumulate(events(store, fine.job_id)).texts == {0: "c"}
    writer.close(5)


def test_heartbeats_are_written_on_the_thread_newest_first_none_after_close(
    redis_factory: RedisFactory,
) -> None:
    """A heartbeat put by the loop is written by the writer's thread with Redis's time; while
    Redis is down the thread keeps only the newest, which goes out once it is back; none is
    written after close (the worker deletes its key as it exits)."""
    server = redis_factory()
    store = JobStore(server.url)
    writer = Writer(store, "w")
    writers: list[str] = []
    publish = store.heartbeat

    def recorded(*args: Any) -> None:  # which thread writes it (the loop's must not)
        writers.append(threading.current_thread().name)
        publish(*args)

    store.heartbeat = recorded  # type: ignore[method-assign]
    before = store.r.time()
    writer.put_heartbeat("w", {"steps": 1, "jobs": ["a"]}, 10)
    hb = wait_for(lambda: store.workers().get("w"), 10, "the first heartbeat")
    assert hb["steps"] == 1 and hb["jobs"] == ["a"] and writers == ["pagedserve-writer"]
    assert before[0] <= hb["last_seen"] <= store.r.time()[0] + 1
    assert 0 < store.r.ttl(store.keys.worker("w")) <= 10
    assert store.r.zscore(store.keys.workers, "w") == int(hb["last_seen"])
    server.kill()
    writer.put_heartbeat("w", {"steps": 2}, 10)
    wait_for(lambda: not writer.guard.ok, 10, "the writer to see Redis down")
    writer.put_heartbeat("w", {"steps": 3}, 10)
    server.start()  # (with its snapshot: the first heartbeat is back)

    def newest() -> dict[str, Any] | None:
        hb = store.workers().get("w", {})
        return hb if hb.get("steps") != 1 else None

    hb = wait_for(newest, 30, "a heartbeat after the outage")
    assert hb["steps"] == 3 and "jobs" not in hb  # the newest, replacing the whole hash
    assert writer.close(5)
    store.r.delete(store.keys.worker("w"))
    writer.put_heartbeat("w", {"steps": 4}, 10)
    time.sleep(0.2)
    assert store.workers() == {} and all(n == "pagedserve-writer" for n in writers)


# ------------------------------------------------------------------------------ the loop
def test_redis_outage_keeps_the_loop_stepping_and_loses_nothing(
    make_worker: Any, redis_factory: RedisFactory, loop_engine: Engine
) -> None:
    server = redis_factory(aof=True)
    store = JobStore(server.url, lease_ms=60_000)
    w = make_worker(loop_engine, store, ServiceConfig(worker_id="w", redis_url=server.url))
    client = Client(server.url)
    ids = client.submit_many([[5, 6, 7, i] for i in range(6)], LONG)
    run_loop_until(w, lambda: len(w.jobs) == 6 and loop_engine.stats().steps > 3)
    server.kill()
    t0, steps = time.monotonic(), loop_engine.stats().steps
    # every job ends while Redis is gone
    run_loop_until(w, lambda: not loop_engine.has_unfinished())
    assert loop_engine.stats().steps > steps and not w.jobs
    # the jobs can end before the writer's next send (bulk writes wait up to write_interval_s):
    # the outage shows at that send
    run_loop_until(w, lambda: not w.writer.guard.ok, timeout=10)
    assert w.writer.unsent_finals() == 6
    assert w.heartbeat_model().state == "reconnecting"
    assert time.monotonic() - t0 < 30
    server.start()
    client = Client(server.url)
    run_loop_until(w, lambda: all(s.terminal for s in client.store.statuses(ids)))
    recs = client.wait_many(ids, timeout=5)
    assert [r.status for r in recs] == [JobStatus.SUCCEEDED] * 6
    for r in recs:
        evs = events(client.store, r.id)
        assert [e.type for e in evs].count("end") == 1
        assert (
            r.result is not None
            and accumulate(evs).token_ids[0] == r.result.completions[0].token_ids
        )
    assert w.writer.close(5)


def test_bulk_final_writes_go_at_once_when_the_engine_runs_dry(
    make_worker: Any, redis_url: str, loop_engine: Engine
) -> None:
    """Bulk writes wait for the writer's next send, but not once the engine has nothing left
    to run: the last jobs of a batch are written as soon as they end. (With a send every
    30 s, the results would otherwise wait that long.)"""
    store = JobStore(redis_url)
    cfg = ServiceConfig(worker_id="w", redis_url=redis_url, write_interval_s=30.0)
    w = make_worker(loop_engine, store, cfg)
    client = Client(redis_url)
    ids = client.submit_many([[5, 6, 7, i] for i in range(4)], SHORT, priority="bulk")
    run_loop_until(w, lambda: len(w.jobs) == 4)
    run_loop_until(w, lambda: not loop_engine.has_unfinished())
    recs = client.wait_many(ids, timeout=10)  # the loop is idle now: nothing more is put
    assert [r.status for r in recs] == [JobStatus.SUCCEEDED] * 4
    assert w.writer.close(5)


def test_loop_drops_a_job_only_for_its_own_fence_and_fails_refused_writes(
    make_worker: Any, redis_url: str, loop_engine: Engine
) -> None:
    store = JobStore(redis_url, lease_ms=60_000)
    w = make_worker(loop_engine, store, ServiceConfig(worker_id="w", redis_url=redis_url))
    client = Client(redis_url)
    jid, other = client.submit([5, 6, 7], LONG), client.submit([8, 9], LONG)
    run_loop_until(w, lambda: jid in w.jobs and other in w.jobs)
    st = w.jobs[jid]
    w._on_report(StepResult(refused=[(jid, st.lease.fence - 1)]))  # an older lease's write
    assert jid in w.jobs
    store.reclaim("x", 0, 2)  # both presumed dead: the next writes are refused, jobs dropped
    run_loop_until(w, lambda: not w.jobs)
    assert not loop_engine.has_unfinished()
    assert all(client.status(j) == JobStatus.RUNNING for j in (jid, other))  # x's now
    # A job whose events key breaks fails with the reason; the loop goes on with the next.
    bad = client.submit([1, 2, 3], SHORT)
    run_loop_until(w, lambda: bad in w.jobs)
    store.r.delete(store.keys.events(bad))
    store.r.set(store.keys.events(bad), "x")
    good = client.submit([4, 5, 6], SHORT)
    run_loop_until(w, lambda: client.status(bad).terminal and client.status(good).terminal)
    rec = client.get(bad)
    assert rec is not None and rec.status == JobStatus.FAILED
    assert rec.error is not None and rec.error.startswith(WRITE_FAILED)
    assert client.status(good) == JobStatus.SUCCEEDED
    assert w.writer.close(5)


def test_progress_of_jobs_no_reader_follows_is_written_at_the_bulk_interval(
    make_worker: Any, redis_url: str, loop_engine: Engine
) -> None:
    """A job a reader follows (``Client.stream`` keeps its watch key set) streams at
    ``progress_interval_ms``; jobs nobody follows, interactive or bulk, write their first token
    at once, then their deltas only every ``bulk_progress_interval_ms``; all end complete, and
    the reader got every token."""
    store = JobStore(redis_url, lease_ms=60_000)
    cfg = ServiceConfig(
        worker_id="w", redis_url=redis_url, progress_interval_ms=1, bulk_progress_interval_ms=60_000
    )
    w = make_worker(loop_engine, store, cfg)
    client = Client(redis_url)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    followed, alone = client.submit([5, 6, 7], long), client.submit([5, 6, 7], long)
    bulk = client.submit([5, 6, 7], long, priority="bulk")
    streamed: list[Any] = []
    reader = threading.Thread(target=lambda: streamed.extend(Client(redis_url).stream(followed)))
    reader.start()
    deadline = time.monotonic() + 10
    while not store.r.exists(store.keys.watch(followed)) and time.monotonic() < deadline:
        time.sleep(0.005)  # the reader keeps it set from its first read on

    def generated(jid: str) -> int:  # the engine's count (the worker reads it at flushes)
        out = w.engine.snapshot(jid)
        return 0 if out is None else len(out.outputs[0].token_ids)

    run_loop_until(w, lambda: min(generated(j) for j in (followed, alone, bulk)) >= 40)
    assert w.writer.flush(10)
    recs = {r.id: r for r in client.store.get_many([followed, alone, bulk]) if r is not None}
    assert recs[followed].tokens_generated >= 30  # written as it went
    for jid in (alone, bulk):
        assert 1 <= recs[jid].tokens_generated <= 2  # the first token, at once; no more yet
        assert [e.type for e in events(store, jid)].count("delta") == 1
    jobs = (followed, alone, bulk)
    run_loop_until(w, lambda: all(s.terminal for s in client.store.statuses(list(jobs))))
    reader.join(10)
    for jid in jobs:  # the final write carries everything
        rec = client.get(jid)
        assert rec is not None and rec.status == JobStatus.SUCCEEDED and rec.tokens_generated == 200
        assert rec.result is not None
        assert accumulate(events(store, jid)).token_ids[0] == rec.result.completions[0].token_ids
    assert accumulate(streamed).token_ids[0] == client.get(followed).result.completions[0].token_ids
    assert w.writer.close(5)


def test_a_first_token_is_written_from_the_steps_output_without_a_snapshot(
    make_worker: Any, redis_url: str, loop_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's first token is flushed at once from the output the step just gave; asking the
    engine for a snapshot of it as well was one round trip more per job under the engine
    process (a quarter of its snapshots at ``bench.service --preset tiny``). Later bulk
    flushes of jobs that did not report in that step still ask for one."""
    store = JobStore(redis_url, lease_ms=60_000)
    cfg = ServiceConfig(worker_id="w", redis_url=redis_url, bulk_progress_interval_ms=60_000)
    w = make_worker(loop_engine, store, cfg)
    asked: list[str] = []
    snapshot = loop_engine.snapshot
    monkeypatch.setattr(loop_engine, "snapshot", lambda jid: asked.append(jid) or snapshot(jid))
    client = Client(redis_url)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    jid = client.submit([5, 6, 7], params, priority="bulk")
    run_loop_until(w, lambda: jid in w.jobs and w.jobs[jid].first_token_seen)
    assert w.writer.flush(10)
    rec = client.get(jid)
    assert rec is not None and rec.tokens_generated >= 1  # written at once
    assert [e.type for e in events(store, jid)].count("delta") == 1
    assert asked == []
    w.next_flush = w.next_bulk_flush = 0.0  # the next flush: every job, none just reported
    loop_once(w)
    assert asked == [jid]
    run_loop_until(w, lambda: client.status(jid).terminal)
    rec = client.get(jid)
    assert rec is not None and rec.tokens_generated == params.max_tokens
    assert w.writer.close(5)
