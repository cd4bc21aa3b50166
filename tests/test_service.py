"""The Redis worker end to end: Client -> redis-server -> real worker processes -> results."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import pytest

from pagedserve.client import Client
from pagedserve.params import SamplingParams
from pagedserve.schemas import JobStatus
from tests.fixtures.workers import (
    TEST_WORKER_ARGS,
    StartWorker,
    wait_for,
)
from worker.engine import Engine
from worker.outputs import EngineConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS: list[str | list[int]] = [
    "The quick brown fox",
    "def main():",
    [5, 17, 99, 200, 3, 42],
    "Once upon a time, in a land far away, there lived",
    [7] * 40,
    "import os",
]


@pytest.fixture
def model_dir(make_tiny_model) -> Path:  # type: ignore[no-untyped-def]
    return make_tiny_model("llama")


def offline(model_dir: Path, prompts: list[str | list[int]], params: SamplingParams) -> list:
    """The offline engine's outputs for the same prompts (same options as the test worker)."""
    eng = Engine(model_dir, EngineConfig(num_kv_blocks=256, max_model_len=512, num_threads=1))
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))]


def heartbeat(client: Client, worker_id: str) -> dict:
    return client.store.workers().get(worker_id, {})


def heartbeat_succeeded(client: Client, worker_id: str, n: int) -> dict | None:
    """The worker's heartbeat once it counts ``n`` succeeded jobs."""
    hb = heartbeat(client, worker_id)
    return hb if hb and hb["jobs_finished"].get("succeeded") == n else None


#: The engine in the worker's process, and in a child of its own (worker/engine_process.py,
#: the default).
ENGINE_PLACES = pytest.mark.parametrize(
    "engine_flags", [("--no-engine-process",), ()], ids=["in-process", "engine-process"]
)


@ENGINE_PLACES
def test_results_equal_offline_greedy_and_stream(
    redis_url: str, model_dir: Path, start_worker: StartWorker, engine_flags: tuple[str, ...]
) -> None:
    start_worker(redis_url, model_dir, "w1", *engine_flags)
    client = Client(redis_url)
    ids = client.submit_many(PROMPTS, GREEDY)
    recs = client.wait_many(ids, timeout=60)
    expected = offline(model_dir, PROMPTS, GREEDY)
    for rec, exp in zip(recs, expected, strict=True):
        assert rec.status == JobStatus.SUCCEEDED, rec.error
        assert rec.result is not None and rec.worker == "w1"
        comp = rec.result.completions[0]
        assert comp.token_ids == exp.outputs[0].token_ids
        assert comp.text == exp.outputs[0].text
        assert comp.finish_reason == "length"
        assert rec.result.prompt_tokens == len(exp.prompt_token_ids)
        assert rec.result.completion_tokens == 12 == rec.tokens_generated
        assert rec.first_token_at is not None and rec.started_at is not None

    # Streaming: the deltas of a longer job concatenate to its final text and token ids.
    jid = client.submit("Streaming test:", {"max_tokens": 64, "temperature": 0, "ignore_eos": True})
    events = list(client.stream(jid, timeout=60))
    assert events[-1].type == "end" and events[-1].status == JobStatus.SUCCEEDED
    deltas = [e for e in events if e.type == "delta"]
    assert len(deltas) >= 2
    rec = client.get(jid)
    assert rec is not None and rec.result is not None
    assert "".join(e.text for e in deltas) == rec.result.completions[0].text
    assert [t for e in deltas for t in e.token_ids] == rec.result.completions[0].token_ids
    assert deltas[-1].tokens_generated == 64

    # Chat messages and n > 1 with logprobs go through as well.
    chat = client.submit(
        [{"role": "user", "content": "hi"}],
        {"max_tokens": 5, "n": 2, "temperature": 0.8, "seed": 1, "logprobs": 2},
    )
    rec = client.wait(chat, timeout=30)
    assert rec.status == JobStatus.SUCCEEDED and rec.result is not None
    assert [c.index for c in rec.result.completions] == [0, 1]
    for c in rec.result.completions:
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)


def test_interactive_before_bulk(
    redis_url: str, model_dir: Path, start_worker: StartWorker
) -> None:
    client = Client(redis_url)
    params = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    bulk = client.submit_many([f"bulk {i}" for i in range(8)], params, priority="bulk")
    inter = client.submit_many([f"interactive {i}" for i in range(8)], params)
    start_worker(redis_url, model_dir, "w1", "--max-num-seqs", "2")
    recs = {r.id: r for r in client.wait_many(bulk + inter, timeout=60)}
    assert all(r.status == JobStatus.SUCCEEDED for r in recs.values())
    last_interactive = max(recs[j].started_at or 0 for j in inter)
    first_bulk = min(recs[j].started_at or 0 for j in bulk)
    assert last_interactive <= first_bulk


def test_two_workers_share_the_queue(
    redis_url: str, model_dir: Path, start_worker: StartWorker
) -> None:
    start_worker(redis_url, model_dir, "a")
    start_worker(redis_url, model_dir, "b")
    client = Client(redis_url)
    params = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    ids = client.submit_many([f"job {i}" for i in range(60)], params, priority="bulk")
    recs = client.wait_many(ids, timeout=90)
    assert all(r.status == JobStatus.SUCCEEDED for r in recs)
    by_worker = {w: sum(r.worker == w for r in recs) for w in ("a", "b")}
    assert by_worker["a"] > 0 and by_worker["b"] > 0, by_worker
    assert by_worker["a"] + by_worker["b"] == 60


@ENGINE_PLACES
def test_cancel_mid_generation_frees_blocks(
    redis_url: str, model_dir: Path, start_worker: StartWorker, engine_flags: tuple[str, ...]
) -> None:
    # A heartbeat every 0.2 s: on a fast CPU the whole job takes less than the default 1 s.
    start_worker(
        redis_url, model_dir, "w1", "--max-model-len", "2048", "--heartbeat-s", "0.2",
        *engine_flags,
    )  # fmt: skip
    client = Client(redis_url)
    jid = client.submit([3] * 100, {"max_tokens": 1900, "temperature": 0, "ignore_eos": True})
    wait_for(lambda: (r := client.get(jid)) and r.tokens_generated > 0, what="first tokens")
    wait_for(
        lambda: (heartbeat(client, "w1").get("pool") or {}).get("in_use", 0) > 0,
        what="blocks in use in the heartbeat",
    )
    assert client.cancel(jid) in (JobStatus.CANCELLING, JobStatus.CANCELLED)
    rec = client.wait(jid, timeout=30)
    assert rec.status == JobStatus.CANCELLED
    assert rec.result is not None and 0 < rec.result.completion_tokens < 1900
    assert rec.result.completions[0].finish_reason == "abort"
    hb = wait_for(
        lambda: (h := heartbeat(client, "w1")) and h["pool"]["in_use"] == 0 and not h["jobs"]
        and h["jobs_finished"] and h,
        what="the pool to have no blocks in use and the job counted",
    )  # fmt: skip
    assert "1" not in hb["pool"]["block_states"]
    assert hb["jobs_finished"] == {"cancelled": 1}
    # The worker goes on serving.
    nxt = client.submit("after the cancel", {"max_tokens": 4, "temperature": 0})
    assert client.wait(nxt, timeout=30).status == JobStatus.SUCCEEDED


@ENGINE_PLACES
def test_heartbeat_counts_a_drained_batch_before_its_period(
    redis_url: str, model_dir: Path, start_worker: StartWorker, engine_flags: tuple[str, ...]
) -> None:
    """With a 60 s period, only the first heartbeat is periodic within this test: the ones
    counting each batch's jobs go out as the loop drains it (``Worker._settled``)."""
    start_worker(redis_url, model_dir, "w1", "--heartbeat-s", "60", *engine_flags)
    client = Client(redis_url)
    wait_for(lambda: heartbeat(client, "w1"), what="the first heartbeat")
    expected = 0
    for n in (6, 3):
        ids = client.submit_many([f"batch {n} {i}" for i in range(n)], {"max_tokens": 6})
        assert all(r.status == JobStatus.SUCCEEDED for r in client.wait_many(ids, timeout=30))
        expected += n
        hb = wait_for(
            partial(heartbeat_succeeded, client, "w1", expected),
            timeout=10,
            what=f"a heartbeat counting {expected} jobs",
        )
        assert hb["jobs_finished"] == {"succeeded": expected}
        assert not hb["jobs"]


def test_heartbeat_contents(redis_url: str, model_dir: Path, start_worker: StartWorker) -> None:
    from pagedserve.telemetry import WorkerHeartbeat

    start_worker(redis_url, model_dir, "w1")
    client = Client(redis_url)
    ids = client.submit_many([f"x{i}" for i in range(5)], {"max_tokens": 8, "temperature": 0})
    client.wait_many(ids, timeout=30)
    hb = wait_for(
        lambda: (
            (h := WorkerHeartbeat.parse_published(heartbeat(client, "w1")))
            and h.e2e_request_latency_seconds.count == 5
            and sum(h.jobs_finished.values()) == 5
            and h
        ),
        what="a heartbeat with 5 finished jobs",
    )
    assert hb.model == model_dir.name and hb.state == "serving"
    assert hb.time_to_first_token_seconds.count == 5
    assert hb.tokens_generated >= 5 and hb.steps > 0
    assert hb.pool is not None and len(hb.pool.block_states) == hb.pool.num_blocks == 256
    assert hb.jobs_finished == {"succeeded": 5}
    loop = hb.loop_seconds  # the loop clock: its phases add up to no more than the uptime
    assert set(loop) == {"engine", "service", "idle"} and loop["engine"] > 0
    assert sum(loop.values()) <= time.time() - hb.started_at + 0.01
    assert 0 < hb.engine_cpu_seconds <= loop["engine"] + 0.01  # the steps' CPU time is in it
    assert TEST_WORKER_ARGS  # the fixture's options are what the offline comparison mirrors


def test_a_worker_takes_bfloat16_weights_from_its_command_line(
    redis_url: str, model_dir: Path, start_worker: StartWorker
) -> None:
    """``pagedserve worker --weight-dtype bfloat16`` serves jobs with its projections packed in
    bfloat16 (its log says so); asked of a bfloat16 model, or on a CPU without bfloat16
    products (an AVX2-only one), it exits with the reason instead."""
    from worker.models.layers import bf16_products_available

    if bf16_products_available():
        w = start_worker(
            redis_url, model_dir, "w1", "--weight-dtype", "bfloat16", "--log-level", "INFO"
        )
        client = Client(redis_url)
        jid = client.submit([1, 2, 3], {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True})
        rec = client.wait(jid, timeout=60)
        assert rec.status == JobStatus.SUCCEEDED and rec.result is not None
        assert rec.result.completion_tokens == 10
        assert "projection weights in bfloat16" in w.log()
    else:
        refused = start_worker(
            redis_url, model_dir, "w1", "--weight-dtype", "bfloat16", ready=False
        )
        assert refused.wait(timeout=60) != 0
        assert "bfloat16 products, which this CPU lacks" in refused.log()
    bad = start_worker(
        redis_url, model_dir, "w2", "--weight-dtype", "bfloat16", "--dtype", "bfloat16",
        ready=False,
    )  # fmt: skip
    assert bad.wait(timeout=60) != 0
    assert "CPU mode for float32 models" in bad.log()
