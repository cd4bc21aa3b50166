"""Redis Sentinel: every process takes a ``redis+sentinel://`` URL, and a master killed mid-run
fails over with every job finished exactly once."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve.client import Client
from pagedserve.redis_url import kombu_options, parse_sentinel
from pagedserve.redis_util import URL_ENV
from pagedserve.schemas import JobStatus
from pagedserve.store import JobStore
from tests.batch_cli import run_cli_batch
from tests.fixtures.sentinel import SentinelGroup
from tests.fixtures.workers import StartWorker, wait_for

PARAMS = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


def test_sentinel_urls_parse_and_bad_ones_say_why() -> None:
    t = parse_sentinel(
        "redis+sentinel://:pw@127.0.0.1:26379,[::1]:26380/main/3?sentinel_password=s"
    )
    assert t is not None and t.sentinels == (("127.0.0.1", 26379), ("::1", 26380))
    assert (t.service, t.db, t.password, t.sentinel_password) == ("main", 3, "pw", "s")
    assert parse_sentinel("redis://localhost:6379/0") is None
    for bad in ("redis+sentinel://h:1", "redis+sentinel://h/m", "redis+sentinel://h:1/m/x"):
        with pytest.raises(ValueError, match=r"redis\+sentinel|host:port"):
            parse_sentinel(bad)
    url, opts = kombu_options("redis+sentinel://a:1,b:2/main/1")
    assert url == "sentinel://a:1/1;sentinel://b:2/1" and opts == {"master_name": "main"}


def test_master_killed_mid_run_fails_over_and_every_job_ends_once(
    sentinel_group: Callable[[], SentinelGroup],
    make_tiny_model: Callable[[str], Path],
    start_worker: StartWorker,
) -> None:
    group = sentinel_group()
    old_master = group.master_port()
    client = Client(group.url)
    ids = client.submit_many([f"failover {i}" for i in range(60)], PARAMS, priority="bulk")
    w = start_worker(
        group.url, make_tiny_model("llama"), "w", "--max-num-seqs", "8", "--log-level", "INFO"
    )
    wait_for(
        lambda: sum(s == JobStatus.SUCCEEDED for s in client.store.statuses(ids)) >= 10,
        what="10 jobs done",
    )
    master = group.nodes[0]
    # Writes acknowledged before this point are on the replica; later ones may be lost in the
    # failover window (Redis replicates asynchronously) and are then re-run, never duplicated.
    master.client().execute_command("WAIT", 1, 2000)
    master.kill()
    wait_for(lambda: group.master_port() != old_master, what="a sentinel failover", timeout=60)
    recs = client.wait_many(ids, timeout=180)
    # (A rare CI failure dead-lettered jobs "delivered 4 times (max 3)": the worker's log says
    # which leases it lost and which writes were refused across the failover.)
    assert [r.status for r in recs] == [JobStatus.SUCCEEDED] * 60, (
        {r.error for r in recs},
        w.log(),
    )
    for r in recs:
        assert r.result is not None and r.result.completion_tokens == 24
        ends = [f for _, f in client.r.xrange(client.keys.events(r.id)) if f["type"] == "end"]
        assert len(ends) == 1
    assert client.r.xpending(client.keys.stream("bulk"), "workers")["pending"] == 0
    # The same worker process goes on, on the new master.
    assert client.wait(client.submit("after", PARAMS), timeout=60).status == JobStatus.SUCCEEDED
    assert w.proc.poll() is None and {r.worker for r in recs} == {"w"}


def test_a_batch_runs_end_to_end_through_sentinel(
    sentinel_group: Callable[[], SentinelGroup],
    make_tiny_model: Callable[[str], Path],
    start_worker: StartWorker,
    tmp_path: Path,
) -> None:
    """CLI, Celery control plane (kombu's sentinel transport), worker and client all on one
    ``redis+sentinel://`` URL."""
    group = sentinel_group()
    w = start_worker(group.url, make_tiny_model("llama"), "w")
    model = JobStore(group.url).workers()["w"]["model"]
    env = dict(os.environ, **{URL_ENV: group.url})
    run_cli_batch(tmp_path, model, env, ["--redis", group.url], 6, timeout=180)
    assert w.proc.poll() is None
