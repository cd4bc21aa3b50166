"""Client against a real redis-server, with a minimal hand-driven 'worker' made of store calls."""

from __future__ import annotations

import threading
import time

import pytest
from pydantic import ValidationError

from pagedserve.client import FIRST_CHUNK, Client, _chunks
from pagedserve.params import SamplingParams
from pagedserve.schemas import Completion, JobResult, JobStatus
from pagedserve.store import Finish, JobStore, Lease, Progress


def result(text: str, ids: list[int]) -> JobResult:
    comp = Completion(index=0, text=text, token_ids=ids, finish_reason="stop")
    return JobResult(completions=[comp], prompt_tokens=2, completion_tokens=len(ids))


@pytest.fixture
def client(redis_url: str) -> Client:
    return Client(redis_url)


def claim_one(store: JobStore, consumer: str = "w") -> Lease:
    for _ in range(200):
        got = store.claim(consumer, 1)
        if got:
            return got[0]
        time.sleep(0.005)
    raise AssertionError("no job to claim")


def test_submit_prompt_tokens_and_messages(client: Client) -> None:
    a = client.submit("hello", {"max_tokens": 4, "temperature": 0})
    b = client.submit([1, 2, 3], priority="bulk", metadata={"k": "1"})  # values are strings
    c = client.submit([{"role": "user", "content": "hi"}], SamplingParams(n=2))
    ra, rb, rc = client.get(a), client.get(b), client.get(c)
    assert ra is not None and ra.request.prompt == "hello" and ra.request.params.max_tokens == 4
    assert ra.request.params.greedy
    assert rb is not None and rb.request.prompt == [1, 2, 3] and rb.priority == "bulk"
    assert rb.request.metadata == {"k": "1"}
    assert rc is not None and rc.request.messages is not None
    assert rc.request.messages[0].content == "hi" and rc.request.params.n == 2
    assert client.get("unknown") is None


def test_submit_idempotent(client: Client) -> None:
    first = client.submit("x", idempotency_key="order-17")
    assert client.submit("x", idempotency_key="order-17") == first
    assert client.store.queue_lengths()["interactive"] == 1


def test_submit_many_in_order_and_validated_first(client: Client) -> None:
    prompts = [f"p{i}" for i in range(250)]
    ids = client.submit_many(prompts, {"max_tokens": 2}, priority="bulk", chunk=64)
    assert len(set(ids)) == 250
    recs = client.store.get_many(ids)
    assert [r.request.prompt for r in recs if r is not None] == prompts
    assert client.store.queue_lengths() == {"interactive": 0, "bulk": 250}
    with pytest.raises(ValidationError):
        client.submit_many(["ok", ""], None)
    assert client.store.queue_lengths()["bulk"] == 250  # nothing of the bad batch was queued


def test_wait_returns_when_worker_completes(client: Client, redis_url: str) -> None:
    jid = client.submit("hi")
    worker = JobStore(redis_url)

    def run() -> None:
        lease = claim_one(worker)
        time.sleep(0.05)
        worker.complete(lease, result("done", [4, 5]))

    t = threading.Thread(target=run)
    t.start()
    rec = client.wait(jid, timeout=10)
    t.join()
    assert rec.status == JobStatus.SUCCEEDED and rec.result == result("done", [4, 5])


def test_wait_timeout_and_unknown(client: Client) -> None:
    jid = client.submit("never runs")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        client.wait(jid, timeout=0.1)
    assert time.monotonic() - t0 < 5
    with pytest.raises(KeyError):
        client.wait("missing", timeout=0.1)
    with pytest.raises(TimeoutError):
        client.wait_many([jid], timeout=0.05)


def test_wait_many(client: Client, redis_url: str) -> None:
    ids = client.submit_many([f"p{i}" for i in range(20)])
    worker = JobStore(redis_url)
    leases = worker.claim("w", 20)
    worker.commit_step(finished=[Finish(x, "succeeded", result=result("r", [1])) for x in leases])
    client.cancel(ids[0])  # already finished: stays succeeded
    recs = client.wait_many(ids, timeout=5)
    assert [r.id for r in recs] == ids
    assert {r.status for r in recs} == {JobStatus.SUCCEEDED}


def test_wait_many_ends_when_the_last_open_job_does(client: Client, redis_url: str) -> None:
    """wait_many watches one open job at a time: jobs ending in any order (the watched one
    first or last) end the wait once all have ended, not before; unknown ids and timeouts say
    so, counting the jobs still open."""
    ids = client.submit_many([f"q{i}" for i in range(6)])
    worker = JobStore(redis_url)
    leases = {x.job_id: x for x in worker.claim("w", 6)}
    order = [ids[-1], ids[2], ids[0], ids[4], ids[1], ids[3]]  # the watched (last) one first

    def finish_in_order() -> None:
        for jid in order:
            time.sleep(0.03)
            worker.commit_step(finished=[Finish(leases[jid], "succeeded", result=result("r", [1]))])

    with pytest.raises(TimeoutError, match="6 of 6 jobs still open"):
        client.wait_many(ids, timeout=0.05)
    t = threading.Thread(target=finish_in_order)
    t.start()
    recs = client.wait_many(ids, timeout=10, poll_s=0.01)
    t.join()
    assert [r.id for r in recs] == ids and {r.status for r in recs} == {JobStatus.SUCCEEDED}
    with pytest.raises(KeyError, match="missing"):
        client.wait_many([ids[0], "missing"], timeout=1)


def test_wait_many_wakes_at_the_watched_jobs_end(client: Client, redis_url: str) -> None:
    """A poll of wait_many blocks on the watched job's events: its end wakes it (not the end of
    the poll interval), an open job that does not end within the wait reads as open, an
    unknown one as ended (the pipelined read that follows says which)."""
    jid = client.submit("watched")
    worker = JobStore(redis_url)
    lease = claim_one(worker)
    assert client._ends_within(jid, 0.05) is False
    delta = threading.Timer(0.2, lambda: worker.commit_step(
        progress=[Progress(lease, 1, "par", [3])]))  # fmt: skip
    t0 = time.monotonic()
    delta.start()
    assert client._ends_within(jid, 60.0) is False  # woken by the delta: not an end
    assert time.monotonic() - t0 < 30
    delta.join()
    done = threading.Timer(0.2, lambda: worker.commit_step(
        finished=[Finish(lease, "succeeded", result=result("done", [4]))]))  # fmt: skip
    t0 = time.monotonic()
    done.start()
    assert client._ends_within(jid, 60.0) is True
    assert time.monotonic() - t0 < 30  # woken by the end event, not the 60 s timeout
    done.join()
    assert client._ends_within(jid, 60.0) is True  # ended: answered without blocking
    assert client._ends_within("missing", 60.0) is True


def test_submit_chunks_start_small() -> None:
    """The first round trip of a large submission carries FIRST_CHUNK jobs (workers start on
    them while the rest is sent), then ``chunk`` at a time; all in order, none twice."""
    assert list(_chunks(5, 2000)) == [(0, 5)]
    assert list(_chunks(40, 2000)) == [(0, FIRST_CHUNK), (FIRST_CHUNK, 40)]
    assert list(_chunks(25, 10)) == [(0, 10), (10, 20), (20, 25)]
    assert list(_chunks(0, 10)) == []
    with pytest.raises(ValueError):
        list(_chunks(3, 0))


def test_submit_many_over_several_chunks(client: Client, redis_url: str) -> None:
    ids = client.submit_many([f"c{i}" for i in range(FIRST_CHUNK + 5)], chunk=3)
    assert len(set(ids)) == FIRST_CHUNK + 5
    leases = JobStore(redis_url).claim("w", 64)
    assert [x.job_id for x in leases] == ids  # queued in order
    assert [x.request.prompt for x in leases] == [f"c{i}" for i in range(FIRST_CHUNK + 5)]


def test_wait_many_reads_records_as_their_jobs_end(client: Client, redis_url: str) -> None:
    """Records are read while the wait goes on (the oldest open jobs, swept), not all after the
    last job ended; each once; the answer keeps the order (and repeats) of the ids asked for."""
    ids = client.submit_many([f"s{i}" for i in range(100)])
    worker = JobStore(redis_url)
    leases = {x.job_id: x for x in worker.claim("w", 100)}
    reads: list[int] = []
    get_many = client.store.get_many

    def counted(job_ids):  # type: ignore[no-untyped-def]
        reads.append(len(job_ids))
        return get_many(job_ids)

    client.store.get_many = counted  # type: ignore[method-assign]

    def finish_oldest_first() -> None:
        for jid in ids:
            time.sleep(0.004)
            worker.commit_step(finished=[Finish(leases[jid], "succeeded", result=result("r", [1]))])

    t = threading.Thread(target=finish_oldest_first)
    t.start()
    recs = client.wait_many([*ids, ids[0]], timeout=20, poll_s=0.01)
    t.join()
    assert [r.id for r in recs] == [*ids, ids[0]]
    assert {r.status for r in recs} == {JobStatus.SUCCEEDED}
    assert sum(reads) == 100  # every record read once
    assert len(reads) > 2 and reads[-1] < 50  # most of them before the end


def test_stream_yields_deltas_until_end(client: Client, redis_url: str) -> None:
    jid = client.submit("tell me")
    worker = JobStore(redis_url)
    pieces = [("Hel", [1]), ("lo", [2]), (" world", [3, 4])]

    def run() -> None:
        lease = claim_one(worker)
        n = 0
        for text, ids in pieces:
            n += len(ids)
            worker.commit_step("w", progress=[Progress(lease, n, text, ids)])
            time.sleep(0.02)
        worker.complete(lease, result("Hello world", [1, 2, 3, 4]))

    t = threading.Thread(target=run)
    t.start()
    events = list(client.stream(jid, timeout=10))
    t.join()
    deltas = [e for e in events if e.type == "delta"]
    assert "".join(e.text for e in deltas) == "Hello world"
    assert [tid for e in deltas for tid in e.token_ids] == [1, 2, 3, 4]
    assert [e.tokens_generated for e in deltas] == [1, 2, 4]
    assert events[-1].type == "end" and events[-1].status == JobStatus.SUCCEEDED
    # Streaming a finished job replays its retained events.
    assert [e.type for e in client.stream(jid)] == ["delta"] * 3 + ["end"]


def test_stream_of_cancelled_queued_job(client: Client) -> None:
    jid = client.submit("x")
    assert client.cancel(jid) == JobStatus.CANCELLED
    events = list(client.stream(jid, timeout=5))
    assert [(e.type, e.status) for e in events] == [("end", JobStatus.CANCELLED)]
    with pytest.raises(KeyError):
        list(client.stream("missing", timeout=1))


def test_cancel_running_via_client(client: Client, redis_url: str) -> None:
    jid = client.submit("x")
    worker = JobStore(redis_url)
    lease = claim_one(worker)
    assert client.cancel(jid) == JobStatus.CANCELLING
    assert worker.pop_cancels("w") == {jid}
    assert worker.finish_cancelled(lease)
    assert client.wait(jid, timeout=5).status == JobStatus.CANCELLED
    assert client.cancel("missing") == JobStatus.NOT_FOUND
