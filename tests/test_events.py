"""The one events-stream reader (``pagedserve.events.follow_events``) against a real redis-server:
what it yields while a job runs, after a restart, at its end, and for a job that is gone."""

from __future__ import annotations

import pytest

from pagedserve.client import accumulate
from pagedserve.events import FIRST_ID, WATCH_TTL_MS, Gone, Idle, follow_events
from pagedserve.schemas import Completion, DeltaEvent, JobRequest, JobResult, JobStatus
from pagedserve.store import JobStore, Progress


@pytest.fixture
def store(redis_url: str) -> JobStore:
    return JobStore(redis_url, lease_ms=60_000)


def _follow(store: JobStore, job_id: str, last: str = FIRST_ID) -> list[DeltaEvent | Idle | Gone]:
    """Read until the reader ends or reports one idle read."""
    out: list[DeltaEvent | Idle | Gone] = []
    for item in follow_events(store, job_id, last, count=2, block_ms=lambda: 1):
        out.append(item)
        if isinstance(item, Idle):
            break
    return out


def test_reader_yields_deltas_then_idle_then_the_end(store: JobStore) -> None:
    job, _ = store.enqueue("j1", JobRequest(prompt="hi"))
    lease = store.claim("w", 1)[0]
    assert store.progress(lease, 1, "a", [5]) and store.progress(lease, 2, "b", [6])
    first = _follow(store, job)
    deltas = [x for x in first if isinstance(x, DeltaEvent)]
    assert [d.text for d in deltas] == ["a", "b"]  # read two per XREAD (count=2), in order
    assert isinstance(first[-1], Idle) and first[-1].status == JobStatus.RUNNING
    assert first[-1].last == deltas[-1].id
    comp = Completion(index=0, text="ab", token_ids=[5, 6], finish_reason="stop")
    res = JobResult(completions=[comp], prompt_tokens=1, completion_tokens=2)
    assert store.complete(lease, res)
    rest = _follow(store, job, deltas[-1].id)  # resumes after the last id it was given
    assert [x.type for x in rest if isinstance(x, DeltaEvent)] == ["end"]
    assert isinstance(rest[-1], DeltaEvent)  # ends after the end event, no Idle


def test_reader_passes_a_restart_through(store: JobStore) -> None:
    job, _ = store.enqueue("j2", JobRequest(prompt="hi"))
    lease = store.claim("w1", 1)[0]
    assert store.progress(lease, 1, "old", [1])
    assert store.release(lease) == JobStatus.QUEUED  # handed back: leased again restarts it
    again = store.claim("w2", 1)[0]
    assert store.progress(again, 1, "new", [2])
    events = [x for x in _follow(store, job) if isinstance(x, DeltaEvent)]
    assert "restart" in [e.type for e in events]
    acc = accumulate(events)
    assert acc.texts == {0: "new"} and acc.token_ids == {0: [2]}


def test_reader_reports_a_job_that_is_gone(store: JobStore) -> None:
    assert _follow(store, "no-such-job") == [Gone(JobStatus.NOT_FOUND, FIRST_ID)]
    job, _ = store.enqueue("j3", JobRequest(prompt="hi"))
    assert store.cancel(job) == JobStatus.CANCELLED
    store.r.delete(store.keys.events(job))  # ended, and its events already expired
    assert _follow(store, job) == [Gone(JobStatus.CANCELLED, FIRST_ID)]


def test_reader_stops_when_told(store: JobStore) -> None:
    job, _ = store.enqueue("j4", JobRequest(prompt="hi"))
    items = list(follow_events(store, job, count=8, block_ms=lambda: 1, keep_going=lambda: False))
    assert items == []


def test_a_reader_marks_the_job_watched_and_the_worker_hears_of_it(store: JobStore) -> None:
    """A follower keeps the job's watch key set (with a time to live); a progress write then
    tells the worker that someone streams the job (``StepResult.watched``). A reader that only
    waits for the end (``watch=False``) does not."""
    job, _ = store.enqueue("j5", JobRequest(prompt="hi"))
    lease = store.claim("w", 1)[0]
    first = store.commit_step(progress=[Progress(lease, 1, "a", [5])])
    assert first.watched == {job: False} and not first.lost
    waiting_only = follow_events(store, job, count=2, block_ms=lambda: 1, watch=False)
    assert isinstance(next(waiting_only), DeltaEvent)
    assert not store.r.exists(store.keys.watch(job))
    assert isinstance(_follow(store, job)[-1], Idle)
    assert 0 < store.r.pttl(store.keys.watch(job)) <= WATCH_TTL_MS
    again = store.commit_step(progress=[Progress(lease, 2, "b", [6])])
    assert again.watched == {job: True}
    store.r.delete(store.keys.watch(job))  # the reader went away: its key lapsed
    assert store.commit_step(progress=[Progress(lease, 3, "c", [7])]).watched == {job: False}
    events = [x for x in _follow(store, job) if isinstance(x, DeltaEvent)]
    assert accumulate(events).texts == {0: "abc"}  # every delta written, watched or not
