"""Claims run on the claimer's thread (worker/claimer.py): a claim round that Redis is slow to
answer never holds up the engine's steps, and what a round took when the worker stops is handed
back to the queue, never lost."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from pagedserve.client import Client
from pagedserve.params import SamplingParams
from pagedserve.schemas import JobStatus
from pagedserve.store import JobStore
from tests.fixtures.redis_server import RedisFactory
from tests.fixtures.workers import loop_once, run_loop_until
from worker.admission import claim_round
from worker.claimer import Claimer, ClaimOrder
from worker.engine import Engine
from worker.service import ServiceConfig

LONG = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class HeldRounds:
    """Wraps the claim round: while ``hold`` is set, a round that took something waits for
    ``release`` before answering (Redis slow to answer, as seen from the loop)."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.release = threading.Event()
        self.waiting = threading.Event()  # a held round took leases and waits

    def __call__(self, *args: Any) -> Any:
        got = claim_round(*args)
        if self.hold.is_set() and got[0]:
            self.waiting.set()
            assert self.release.wait(30)
        return got


def held_worker(make_worker: Any, redis_url: str, engine: Engine, worker_id: str) -> Any:
    """(a worker on its own consumer name whose claim rounds go through HeldRounds, those
    rounds, a client)."""
    store = JobStore(redis_url, lease_ms=60_000)
    w = make_worker(engine, store, ServiceConfig(worker_id=worker_id, redis_url=redis_url))
    held = HeldRounds()
    w.claimer.claim_round = held
    return w, held, Client(redis_url)


def test_a_slow_claim_round_never_holds_up_the_steps(
    make_worker: Any, redis_url: str, loop_engine: Engine
) -> None:
    w, held, client = held_worker(make_worker, redis_url, loop_engine, "claim-slow")
    running = client.submit([5, 6, 7, 8], LONG)
    run_loop_until(w, lambda: loop_engine.has_unfinished())
    held.hold.set()
    late = client.submit([9, 10, 11], SHORT)
    run_loop_until(w, held.waiting.is_set)  # the round took the new job and is held
    steps = loop_engine.stats().steps
    for _ in range(20):  # the loop steps on meanwhile, and asks for no second round
        loop_once(w)
    assert loop_engine.stats().steps >= steps + 20
    assert w.claimer.pending and late not in w.jobs
    held.release.set()
    run_loop_until(w, lambda: client.status(late).terminal)
    rec = client.get(late)
    assert rec is not None and rec.status == JobStatus.SUCCEEDED
    assert rec.result is not None and rec.result.completion_tokens == SHORT.max_tokens
    assert client.status(running) == JobStatus.RUNNING


def test_a_round_in_flight_at_stop_is_handed_back(
    make_worker: Any, redis_url: str, loop_engine: Engine
) -> None:
    w, held, client = held_worker(make_worker, redis_url, loop_engine, "claim-stop")
    held.hold.set()
    jid = client.submit([5, 6, 7, 8], SHORT)
    run_loop_until(w, held.waiting.is_set)  # leased by the round, not admitted yet
    assert client.status(jid) == JobStatus.RUNNING and jid not in w.jobs
    w.request_stop()
    held.release.set()
    run_loop_until(w, lambda: not w.claimer.pending)
    assert not w.jobs and not loop_engine.has_unfinished()
    assert client.status(jid) == JobStatus.QUEUED  # back in the queue, fence moved on
    other = JobStore(redis_url)
    (lease,) = other.claim("claim-other", 5)
    assert lease.job_id == jid


def recorded_orders(w: Any) -> list[ClaimOrder]:
    """The worker's claim orders from now on, in the order asked."""
    asks: list[ClaimOrder] = []
    ask = w.claimer.ask

    def record(order: ClaimOrder) -> None:
        asks.append(order)
        ask(order)

    w.claimer.ask = record
    return asks


def test_the_round_after_an_idle_wake_goes_out_at_once(
    make_worker: Any, redis_url: str, loop_engine: Engine
) -> None:
    """An idle worker's blocking read wakes at the first job queued (the rest of a burst
    usually comes after it): the next round, not blocking, is ordered in the same pass of the
    loop, before the first step."""
    store = JobStore(redis_url, lease_ms=60_000)
    w = make_worker(loop_engine, store, ServiceConfig(worker_id="claim-wake", redis_url=redis_url))
    asks = recorded_orders(w)
    steps = loop_engine.stats().steps
    jid = Client(redis_url).submit([5, 6, 7, 8], SHORT)
    deadline = time.monotonic() + 30
    while jid not in w.jobs:  # the loop's claim part only: no step runs
        assert time.monotonic() < deadline, "the job was not claimed"
        w.housekeeping()
    assert w.claimer.pending and asks[-1].block_ms == 0  # the next round, not blocking
    assert loop_engine.stats().steps == steps


def test_a_busy_worker_waits_on_redis_for_new_work(
    make_worker: Any, redis_url: str, loop_engine: Engine
) -> None:
    """A busy worker with free seats whose last round found nothing waits for new work with a
    blocking read (up to claim_interval_s), which the next job queued wakes: with an interval
    of 60 s that job still joins the running batch at once, not a poll interval later; a
    round that took jobs is followed by one that does not block."""
    store = JobStore(redis_url, lease_ms=120_000)
    cfg = ServiceConfig(worker_id="claim-busy", redis_url=redis_url, claim_interval_s=60.0)
    w = make_worker(loop_engine, store, cfg)
    asks = recorded_orders(w)
    client = Client(redis_url)
    long = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)
    running = client.submit([5, 6, 7, 8], long)
    run_loop_until(w, lambda: running in w.jobs and not w.claim_found and w.claimer.pending)
    assert asks[-1].block_ms == 60_000  # busy, the last round found nothing: it waits
    late = client.submit([9, 10, 11], SHORT)
    t0 = time.monotonic()
    run_loop_until(w, lambda: late in w.jobs, timeout=30)
    assert time.monotonic() - t0 < 30 and running in w.jobs  # joined the running batch
    assert w.claim_found and asks[-1].block_ms == 0  # took a job: the next round at once
    run_loop_until(w, lambda: client.status(late).terminal)
    assert client.status(late) == JobStatus.SUCCEEDED


def test_close_hands_back_what_the_last_round_took(redis_url: str) -> None:
    store = JobStore(redis_url, lease_ms=60_000)
    client = Client(redis_url)
    jid = client.submit([1, 2, 3], SHORT)
    claimer = Claimer(store, "claim-close", claim_round)
    claimer.ask(ClaimOrder(cap=4, block_ms=0))
    got = claimer.close(10)
    assert got is not None and [x.job_id for x in got.leases] == [jid]
    assert not got.down and got.admitted is None  # fcfs: no admission request
    with pytest.raises(RuntimeError):
        claimer.ask(ClaimOrder(cap=1, block_ms=0))
    assert store.release(got.leases[0]) == JobStatus.QUEUED


def test_redis_down_marks_the_claimer_and_the_heartbeat(
    make_worker: Any, redis_factory: RedisFactory, loop_engine: Engine
) -> None:
    server = redis_factory()
    store = JobStore(server.url)
    w = make_worker(loop_engine, store, ServiceConfig(worker_id="claim-down", redis_url=server.url))
    loop_once(w)
    server.kill()
    run_loop_until(w, lambda: not w.claimer.guard.ok, timeout=30)
    assert w.heartbeat_model().state == "reconnecting"
    server.start()
    client = Client(server.url)
    jid = client.submit([5, 6, 7], SHORT)
    run_loop_until(w, lambda: client.status(jid).terminal, timeout=60)
    assert client.status(jid) == JobStatus.SUCCEEDED and w.claimer.guard.ok


def test_reclaim_leaves_a_job_whose_final_write_waits(
    make_worker: Any, redis_url: str, loop_engine: Engine
) -> None:
    """A job that ended but whose final write Redis has not answered yet (held up here; a
    failover or a loaded machine in the wild) is still this worker's: its entry goes idle (no
    running job renews it), yet the worker's own reclaim leaves it, and the job ends once, on
    its first delivery."""
    store = JobStore(redis_url, lease_ms=60_000)
    w = make_worker(loop_engine, store, ServiceConfig(worker_id="claim-final", redis_url=redis_url))
    release = threading.Event()
    real = store.commit_step

    def held_commit(consumer: Any, progress: Any = (), finished: Any = ()) -> Any:
        if finished:
            assert release.wait(30)
        return real(consumer, progress=progress, finished=finished)

    store.commit_step = held_commit  # type: ignore[method-assign]
    client = Client(redis_url)
    jid = client.submit([5, 6, 7], SHORT)
    run_loop_until(w, lambda: jid in w.jobs)
    run_loop_until(w, lambda: jid not in w.jobs)  # ended, its final write held
    # The idle loop keeps a blocking round in flight; take it here, so that the reclaim below
    # is ours. (Waiting for the loop to be seen between rounds failed 2 runs in 3 on a slow
    # Zen 3 host, where an idle round outlasted the loop's 150 ms wait for it.)
    idle = w.claimer.take(10) if w.claimer.pending else None
    assert idle is None or idle.leases == []  # nothing queued: taking it here drops nothing
    assert not w.claimer.pending
    assert jid in w.held and client.status(jid) == JobStatus.RUNNING
    time.sleep(0.05)
    w.claimer.ask(ClaimOrder(cap=8, block_ms=0, reclaim_ms=10, held=w.held))
    got = w.claimer.take(10)
    assert got is not None and not got.down and got.leases == []
    release.set()
    run_loop_until(w, lambda: client.status(jid).terminal)
    rec = client.get(jid)
    assert rec is not None and rec.status == JobStatus.SUCCEEDED and rec.deliveries == 1
    # The writer lets go of the job once Redis answered its final write, a moment after the
    # status turned terminal (failed once on a busy host when asserted at once).
    run_loop_until(w, lambda: jid not in w.held)
