"""Redis Cluster: every process takes a ``redis+cluster://`` URL; jobs spread over shards (hash
tags) on three masters, each script stays in one slot; a worker killed mid-run loses no job and
runs none twice; a batch runs end to end (its control plane's Celery broker on a plain Redis).

The store's own tests also run over a one-node cluster: ``pytest --redis-cluster tests/...``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve.batches import BatchStore
from pagedserve.client import Client
from pagedserve.keys import GROUP
from pagedserve.openai_format import COMPLETIONS_URL
from pagedserve.redis_url import kombu_options, parse_cluster
from pagedserve.redis_util import URL_ENV, LocalRedisServer
from pagedserve.schemas import Completion, JobRequest, JobResult, JobStatus
from pagedserve.settings import BROKER_URL, SHARDS
from pagedserve.store import BatchRef, Finish, JobStore
from tests.batch_cli import run_cli_batch
from tests.fixtures.cluster import RedisClusterNodes
from tests.fixtures.workers import StartWorker, wait_for

SHARD_COUNT = 3
MODEL = "tiny"
PARAMS = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}

Cluster = Callable[[int], RedisClusterNodes]


@pytest.fixture
def shards(monkeypatch: pytest.MonkeyPatch) -> int:
    """Every process of the test (workers, control plane, CLI) uses the same shard count."""
    monkeypatch.setenv(SHARDS.name, str(SHARD_COUNT))
    return SHARD_COUNT


def result(n: int) -> JobResult:
    comp = Completion(index=0, text="x" * n, token_ids=list(range(n)), finish_reason="length")
    return JobResult(completions=[comp], prompt_tokens=1, completion_tokens=n)


def counts(bs: BatchStore, bid: str) -> dict[str, int]:
    b = bs.get(bid)
    assert b is not None
    return b.request_counts.model_dump()


def test_cluster_urls_parse_and_bad_ones_say_why() -> None:
    t = parse_cluster("redis+cluster://:pw@127.0.0.1:7000,[::1]:7001")
    assert t is not None and t.nodes == (("127.0.0.1", 7000), ("::1", 7001)) and t.password == "pw"
    assert parse_cluster("redis://localhost:6379/0") is None
    for bad in ("redis+cluster://", "redis+cluster://h", "redis+cluster://h:x"):
        with pytest.raises(ValueError, match=r"redis\+cluster|host:port"):
            parse_cluster(bad)
    with pytest.raises(ValueError, match=BROKER_URL.name):
        kombu_options("redis+cluster://127.0.0.1:7000")


def test_jobs_spread_over_shards_and_masters_and_each_ends_once(
    redis_cluster: Cluster, shards: int
) -> None:
    """Store-level: enqueue (plain and idempotent), claim over every shard, cancel a running
    job (its owner's cancel set in the job's shard), reclaim a dead consumer's leases, finish."""
    cluster = redis_cluster(3)
    store = JobStore(cluster.url, lease_ms=60_000)
    assert store.cluster and store.keys.shards == shards
    ids = [
        jid for jid, _ in store.enqueue_many([(f"j{i}", JobRequest(prompt="p")) for i in range(30)])
    ]
    assert ids == [f"j{i}" for i in range(30)]
    by_shard = {store.keys.shard(j) for j in ids}
    assert by_shard == set(range(shards))
    owners = {store.r.keyslot(store.keys.job(j)) for j in ids}
    nodes = {store.r.get_node_from_key(store.keys.job(j)).port for j in ids}
    assert len(owners) == shards and len(nodes) >= 2  # the shards live on several masters
    # An idempotent enqueue gets an id in its key's shard; a repeat returns it.
    idem = JobRequest(prompt="p", idempotency_key="once")
    first, created = store.enqueue("asked-for", idem)
    assert created and store.keys.shard(first) == store.keys.idem_shard("once")
    assert store.enqueue("another", idem) == (first, False)
    ids.append(first)
    assert store.queue_lengths()["interactive"] == 31

    leases = store.claim("a", 10)
    assert len(leases) == 10
    victim = leases[0]
    assert store.cancel(victim.job_id) == JobStatus.CANCELLING
    step = store.commit_step("a")
    assert step.cancels == {victim.job_id}
    assert store.finish_cancelled(victim)
    rest = leases[1:]
    # Consumer "a" dies holding 9 leases; "b" takes everything else, then reclaims those.
    got = store.claim("b", 100)
    assert len(got) == 21
    for lease in got:
        assert store.complete(lease, result(3))
    time.sleep(0.2)
    taken = store.reclaim("b", min_idle_ms=100, max_jobs=100)
    assert sorted(x.job_id for x in taken) == sorted(x.job_id for x in rest)
    assert not store.complete(rest[0], result(3))  # a's fence is stale
    for lease in taken:
        assert store.complete(lease, result(3))
    recs = store.get_many(ids)
    assert sum(r is not None and r.status == JobStatus.SUCCEEDED for r in recs) == 30
    assert store.get(victim.job_id).status == JobStatus.CANCELLED  # type: ignore[union-attr]
    for j in ids:
        ends = [f for _, f in store.r.xrange(store.keys.events(j)) if f["type"] == "end"]
        assert len(ends) == 1
    for k in range(shards):
        for prio in ("interactive", "bulk"):
            assert store.r.xpending(store.keys.stream(prio, k), GROUP)["pending"] == 0
    assert store.queue_lengths() == {"interactive": 0, "bulk": 0}


def test_tenant_accounting_sums_over_shards(redis_cluster: Cluster, shards: int) -> None:
    """A tenant's open jobs are kept per shard (a prune reads records of its own slot) and
    summed: the limit counts every shard, and each ended job is counted once."""
    cluster = redis_cluster(3)
    client = Client(cluster.url, tenant="team-a")
    store, book = client.store, client.store.tenants
    ids = client.submit_many([f"t{i}" for i in range(24)], {"max_tokens": 2})
    assert len({store.keys.shard(j) for j in ids}) == shards
    assert book.open_jobs("team-a", force=True) == 24
    ok, n = book.admit_job("team-a", "reserved-1", limit=24)
    assert (ok, n) == (False, 24)
    for lease in store.claim("w", 100):
        assert store.complete(lease, result(2))
    assert book.open_jobs("team-a", force=True) == 0
    u = book.usage("team-a", store.keys.file(""))
    assert (u.jobs_finished, u.tokens_generated, u.queued, u.running) == (24, 48, 0, 0)
    assert book.admit_job("team-a", "reserved-2", limit=1) == (True, 1)
    assert book.tenants() == ["team-a"]
    assert {r.tenant for r in store.get_many(ids) if r is not None} == {"team-a"}


def test_a_cancel_naming_a_stale_owner_changes_nothing(redis_cluster: Cluster) -> None:
    """The cancel script declares the owner's cancel set it was given: when the job's owner is
    another by then (reclaimed in between), it answers 'moved' and changes nothing; the store's
    cancel reads the owner again and lands in the right set."""
    cluster = redis_cluster(1)
    store = JobStore(cluster.url, lease_ms=60_000)
    store.enqueue("j", JobRequest(prompt="p"))
    (lease,) = store.claim("new-owner", 1)
    k = store.keys.shard("j")
    job = store.keys.job("j")
    keys = [job, store.keys.events("j"), store.keys.cancel("old-owner", k), job]
    args = ["old-owner", store.retention_s, store.events_maxlen]
    assert store._exec([("cancel", keys, args)])[0] == ["moved", 0]
    assert store.status("j") == JobStatus.RUNNING and not store.r.exists(keys[2])
    assert store.cancel("j") == JobStatus.CANCELLING
    assert store.pop_cancels("new-owner") == {"j"} and store.pop_cancels("old-owner") == set()
    assert store.finish_cancelled(lease)


def test_a_process_with_another_shard_count_is_refused(redis_cluster: Cluster) -> None:
    """Jobs in shards a worker does not know would never run: the first process's count is
    kept in the cluster and another count is refused (a single Redis has one shard, always)."""
    cluster = redis_cluster(1)
    JobStore(cluster.url, shards=2).ensure_groups()
    with pytest.raises(ValueError, match="uses 2 shards; this process was given 3"):
        JobStore(cluster.url, shards=3).enqueue("j", JobRequest(prompt="p"))
    assert JobStore(cluster.url, shards=2).enqueue("j", JobRequest(prompt="p")) == ("j", True)


def test_a_crash_between_a_batch_jobs_two_steps_loses_and_repeats_nothing(
    redis_cluster: Cluster, shards: int
) -> None:
    """On a cluster a batch job's end is two steps (its final write, then its line in the
    batch's slot) and so is its enqueue (the job, then its membership). A process dying after
    the first step: the re-run fan-out adds the members, reconcile adds the line; the late
    second step, and reconcile again, add nothing."""
    cluster = redis_cluster(1)
    bs = BatchStore(JobStore(cluster.url), known_models=[MODEL])
    js = bs.jobs
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    text = "".join(
        json.dumps({"custom_id": c, "method": "POST", "url": COMPLETIONS_URL, "body": body}) + "\n"
        for c in ("a", "b", "c")
    )
    bid = bs.create(bs.files.create(text, "in.jsonl").id, COMPLETIONS_URL).id
    # A fan-out that died after enqueueing the first request, before adding it as a member.
    ref = BatchRef(bid, "a", COMPLETIONS_URL, MODEL)
    keys, args = js.enqueue_args("x", JobRequest(prompt="hi", params={"max_tokens": 2}), batch=ref)
    first = js._exec([("enqueue", keys, args)])[0][0]
    js.r.hset(js.keys.batch(bid), "fanout", "started")
    assert bs.member_ids(bid) == []
    bs.fan_out(bid)  # run again to the end: nothing enqueued twice, every job a member
    ids = bs.job_ids(bid)
    assert len(ids) == 3 and first in ids and sorted(bs.member_ids(bid)) == sorted(ids)
    leases = js.claim("w", 10)
    assert sorted(x.job_id for x in leases) == sorted(ids)
    # The first lease's final write lands; its process dies before the line.
    fin = Finish(leases[0], "succeeded", result=result(1))
    assert js._exec([js._finish_call(fin)])[0][0] == 1
    assert counts(bs, bid) == {"total": 3, "completed": 0, "failed": 0}
    assert bs.reconcile(bid) == 1
    assert js.add_batch_lines([js._line_of(fin)]) == 0  # the late second step
    assert bs.reconcile(bid) == 0
    for lease in leases[1:]:
        assert js.complete(lease, result(1))  # both steps
    assert counts(bs, bid) == {"total": 3, "completed": 3, "failed": 0}
    done = bs.finalize(bid)
    assert done is not None and done.status == "completed"
    out = [
        json.loads(x) for x in (bs.files.content(done.output_file_id or "") or "").split("\n") if x
    ]
    assert sorted(o["custom_id"] for o in out) == ["a", "b", "c"]


def test_kill9_mid_run_every_job_exactly_once(
    redis_cluster: Cluster,
    shards: int,
    make_tiny_model: Callable[[str], Path],
    start_worker: StartWorker,
) -> None:
    cluster = redis_cluster(3)
    model = make_tiny_model("llama")
    client = Client(cluster.url)
    ids = client.submit_many([f"job number {i}" for i in range(150)], PARAMS, priority="bulk")
    assert {client.keys.shard(j) for j in ids} == set(range(shards))
    a = start_worker(cluster.url, model, "a", "--max-num-seqs", "16")

    def mid_run() -> bool:
        statuses = client.store.statuses(ids)
        done = sum(s == JobStatus.SUCCEEDED for s in statuses)
        return done >= 30 and any(s == JobStatus.RUNNING for s in statuses)

    wait_for(mid_run, timeout=120, what="30 jobs done and more running")
    a.kill()
    running = [j for j, s in zip(ids, client.store.statuses(ids), strict=True) if s == "running"]
    assert running, "the kill should leave leased jobs behind"
    start_worker(cluster.url, model, "b", "--max-num-seqs", "16")
    recs = client.wait_many(ids, timeout=240)
    assert [r.status for r in recs] == [JobStatus.SUCCEEDED] * 150
    for r in recs:
        assert r.result is not None and r.result.completion_tokens == 40 == r.tokens_generated
        ends = [f for _, f in client.r.xrange(client.keys.events(r.id)) if f["type"] == "end"]
        assert len(ends) == 1  # written once
    assert {r.worker for r in recs} == {"a", "b"}
    assert all(client.get(j).worker == "b" for j in running)  # type: ignore[union-attr]
    assert not client.store.dead_letters()
    for k in range(shards):
        assert client.r.xpending(client.keys.stream("bulk", k), GROUP)["pending"] == 0


def test_a_batch_runs_end_to_end_on_a_cluster(
    redis_cluster: Cluster,
    shards: int,
    make_tiny_model: Callable[[str], Path],
    start_worker: StartWorker,
    redis_server: LocalRedisServer,
    tmp_path: Path,
) -> None:
    """CLI, control plane and worker on one cluster (the CLI by ``--redis-cluster NODES``, the
    others by the ``redis+cluster://`` URL); Celery's broker on a plain Redis
    (``PAGEDSERVE_BROKER_URL``)."""
    cluster = redis_cluster(3)
    nodes = cluster.url.split("://", 1)[1]
    w = start_worker(cluster.url, make_tiny_model("llama"), "w")
    model = JobStore(cluster.url).workers()["w"]["model"]
    env = dict(os.environ, **{URL_ENV: cluster.url, BROKER_URL.name: redis_server.url})
    batch = run_cli_batch(tmp_path, model, env, ["--redis-cluster", nodes], 12, timeout=240)
    store = JobStore(cluster.url)
    jobs = store.r.lrange(store.keys.batch_jobs(batch["id"]), 0, -1)
    assert len(jobs) == 12 and len({store.keys.shard(j) for j in jobs}) > 1
    assert w.proc.poll() is None
