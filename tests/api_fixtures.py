"""Shared helpers of the API tests: an app on the fixture Redis and a published heartbeat."""

from __future__ import annotations

from typing import Any

from flask import Flask

from api import create_app
from pagedserve.store import JobStore
from pagedserve.telemetry import (
    Histogram,
    PoolSnapshot,
    PrefixCacheSnapshot,
    RunningJob,
    WorkerHeartbeat,
)

#: 16 blocks: 4 free (uncached), 7 in use (unshared), 3 cached, 2 shared.
BLOCK_STATES = "0000111111122233"


def make_app(redis_url: str, **overrides: Any) -> Flask:
    cfg: dict[str, Any] = {"redis_url": redis_url, "api_keys": (), "sse_block_ms": 100}
    cfg.update(overrides)
    app = create_app(cfg)
    app.testing = True
    return app


def heartbeat(worker_id: str = "w1", *, steps: int = 10, running: int = 2) -> WorkerHeartbeat:
    ttft = Histogram()
    for v in (0.02, 0.3, 0.3, 7.0):
        ttft.observe(v)
    e2e = Histogram()
    e2e.observe(1.5)
    pool = PoolSnapshot(
        num_blocks=16,
        block_size=16,
        free=7,
        in_use=9,
        cached=3,
        shared=2,
        tokens_stored=130,
        fragmentation_slots=14,
        usage=9 / 16,
        block_states=BLOCK_STATES,
        kv_cache_dtype="bfloat16",
        bytes_per_block=4096,
    )
    return WorkerHeartbeat(
        worker_id=worker_id,
        model="tiny-llama",
        host="gpu-1",
        pid=4242,
        steps=steps,
        running=running,
        waiting=1,
        tokens_generated=321,
        prompt_tokens=900,
        throughput_tok_s=42.5,
        preemptions=3,
        jobs_finished={"succeeded": 5, "failed": 1},
        prefix_cache=PrefixCacheSnapshot(
            queried_tokens=200, hit_tokens=50, queried_blocks=12, hit_blocks=3, hit_rate=0.25
        ),
        pool=pool,
        jobs=[RunningJob(id="job-a", tokens=8, max_tokens=16)],
        time_to_first_token_seconds=ttft,
        e2e_request_latency_seconds=e2e,
        loop_seconds={"engine": 12.5, "service": 0.75, "idle": 30.0},
        engine_cpu_seconds=12.25,
    )


def publish(redis_url: str, hb: WorkerHeartbeat) -> None:
    store = JobStore(redis_url)
    store.heartbeat(hb.worker_id, hb.model_dump())
    store.r.close()
