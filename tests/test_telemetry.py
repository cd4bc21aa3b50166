"""The heartbeat path, typed end to end: the engine's telemetry, the worker's published heartbeat
and the API's read of it (a malformed heartbeat is logged and not counted, never defaulted)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from api.state import context_limits_of, parse_heartbeats
from pagedserve.store import JobStore
from pagedserve.telemetry import EngineTelemetry, WorkerHeartbeat
from worker import LLM
from worker.service import ServiceConfig


def test_engine_telemetry_is_typed_and_reaches_the_api(
    make_worker: Any, make_tiny_model, redis_url: str
) -> None:
    llm = LLM(make_tiny_model("llama"), num_kv_blocks=32, kv_cache_dtype="bfloat16")
    engine = llm.engine
    engine.add_request("a", [1, 2, 3, 4, 5], None)
    engine.step()
    tel = engine.heartbeat_stats()
    assert isinstance(tel, EngineTelemetry) and tel.steps == 1 and tel.running == 1
    assert tel.pool is not None and tel.pool.num_blocks == len(tel.pool.block_states) == 32
    assert tel.pool.in_use == tel.pool.block_states.count("1") + tel.pool.block_states.count("3")
    k, _ = engine.runner.kv_caches[0]
    per_block = 2 * len(engine.runner.kv_caches) * k[0].numel() * k.element_size()
    assert (tel.pool.kv_cache_dtype, tel.pool.bytes_per_block) == ("bfloat16", per_block)
    store = JobStore(redis_url)
    w = make_worker(engine, store, ServiceConfig(worker_id="w", redis_url=redis_url))
    w._heartbeat()
    assert w.writer.flush(10)  # (written by the writer's thread)
    (hb,) = parse_heartbeats(store.workers()).values()
    assert hb.pool == tel.pool and hb.steps == 1 and hb.max_model_len == engine.max_model_len
    assert hb.max_token_bytes is not None and hb.tokens_generated == tel.tokens_generated
    assert context_limits_of([hb])[hb.model].max_model_len == engine.max_model_len


@pytest.mark.parametrize(
    "bad", [{"pool": {"num_blocks": "many"}}, {"steps": "x"}, {"max_model_len": 0}, {"model": 3}]
)
def test_a_malformed_heartbeat_is_logged_and_left_out(
    redis_url: str, bad: dict, caplog: pytest.LogCaptureFixture
) -> None:
    store = JobStore(redis_url)
    good = WorkerHeartbeat(worker_id="ok", model="m", max_model_len=64)
    store.heartbeat("ok", good.model_dump(mode="json"))
    store.heartbeat("bad", {**good.model_dump(mode="json"), "worker_id": "bad", **bad})
    with caplog.at_level(logging.WARNING, logger="pagedserve.telemetry"):
        hbs = parse_heartbeats(store.workers())
    assert list(hbs) == ["ok"]
    (rec,) = [r for r in caplog.records if "malformed heartbeat" in r.getMessage()]
    assert "'bad'" in rec.getMessage() and next(iter(bad)) in rec.getMessage()
