"""Process and cluster state: health checks, KV pool occupancy, workers, queue depths."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import redis
from flask import Blueprint, Response, jsonify

from api import auth
from api.state import AppState, WorkerView, get_state
from pagedserve.telemetry import BLOCK_CACHED, BLOCK_FREE, BLOCK_IN_USE, BLOCK_SHARED
from pagedserve.tenants import TenantUsage

health = Blueprint("health", __name__)
bp = Blueprint("status", __name__)

STATE_NAMES = {
    BLOCK_FREE: "free",
    BLOCK_IN_USE: "in_use",
    BLOCK_CACHED: "cached",
    BLOCK_SHARED: "shared",
}


# ----------------------------------------------------------------------------- health
@health.get("/healthz")
def healthz() -> dict[str, Any]:
    """The process is up (touches nothing else)."""
    return {"status": "ok"}


def worker_ready(state: AppState, w: WorkerView) -> tuple[bool, str]:
    """Fresh heartbeat, and its step counter moving (or nothing to run)."""
    if w.age_s > state.config.heartbeat_fresh_s:
        return False, f"heartbeat {w.age_s:.1f} s old"
    if w.hb.state != "serving":
        return False, f"state {w.hb.state}"
    still_s = state.memory.observe(w.hb.worker_id, w.hb.steps)
    if w.hb.running == 0:
        return True, "idle"
    if still_s > state.config.stall_s:
        return False, f"{w.hb.running} running but no step for {still_s:.1f} s"
    return True, "advancing"


@health.get("/readyz")
def readyz() -> tuple[Response, int]:
    """Ready: Redis answers and at least one worker is fresh and advancing (or idle)."""
    state = get_state()
    try:
        state.r.ping()
        workers = state.live_workers()
    except redis.RedisError as e:
        body = {"status": "unavailable", "redis": f"unreachable: {type(e).__name__}", "workers": {}}
        return jsonify(body), 503
    checks = {w.hb.worker_id: worker_ready(state, w) for w in workers}
    ready = any(ok for ok, _why in checks.values())
    body = {
        "status": "ready" if ready else "unavailable",
        "redis": "ok",
        "workers": {wid: {"ready": ok, "reason": why} for wid, (ok, why) in checks.items()},
    }
    if not ready and not checks:
        body["reason"] = "no live worker heartbeat"
    return jsonify(body), 200 if ready else 503


# ----------------------------------------------------------------------------- pool & workers
def state_counts(block_states: str, pool: Any) -> dict[str, int]:
    """Blocks per drawn state (exclusive: free-and-uncached, in-use-unshared, cached, shared)."""
    if block_states:
        return {name: block_states.count(ch) for ch, name in STATE_NAMES.items()}
    return {
        "free": pool.free - pool.cached,
        "in_use": pool.in_use - pool.shared,
        "cached": pool.cached,
        "shared": pool.shared,
    }


def pool_json(w: WorkerView) -> dict[str, Any]:
    hb = w.hb
    out: dict[str, Any] = {
        "worker_id": hb.worker_id,
        "model": hb.model,
        "state": hb.state,
        "running": hb.running,
        "waiting": hb.waiting,
        "throughput_tok_s": hb.throughput_tok_s,
        "prefix_cache_hit_rate": hb.prefix_cache.hit_rate,
        "prefix_cache": hb.prefix_cache.model_dump(),
        # Prefix-aware admission: the prefix groups this worker serves or served lately.
        "prefixes": [g.model_dump() for g in hb.prefixes],
        "age_s": round(w.age_s, 3),
        "pool": None,
    }
    p = hb.pool
    if p is None:
        return out
    allocated = p.in_use * p.block_size
    out["pool"] = {
        "blocks_total": p.num_blocks,
        "block_size": p.block_size,
        # Overlapping, as the block manager counts them: free includes cached, in_use shared.
        "blocks_free": p.free,
        "blocks_in_use": p.in_use,
        "blocks_cached": p.cached,
        "blocks_shared": p.shared,
        "usage": p.usage,
        "tokens_stored": p.tokens_stored,
        "fragmentation_slots": p.fragmentation_slots,
        "fragmentation": p.fragmentation_slots / allocated if allocated else 0.0,
        # Exclusive, one per drawn colour: what block_states holds.
        "block_state_counts": state_counts(p.block_states, p),
        "block_states": p.block_states,
        # The cache in memory (--kv-cache-dtype); "" and 0 from a worker that does not say.
        "kv_cache_dtype": p.kv_cache_dtype,
        "kv_cache_bytes": p.num_blocks * p.bytes_per_block,
        "kv_cache_bytes_in_use": p.in_use * p.bytes_per_block,
    }
    return out


def worker_json(w: WorkerView) -> dict[str, Any]:
    hb = w.hb
    return {
        "worker_id": hb.worker_id,
        "model": hb.model,
        "host": hb.host,
        "pid": hb.pid,
        "state": hb.state,
        "started_at": hb.started_at,
        "last_seen": w.last_seen,
        "age_s": round(w.age_s, 3),
        "steps": hb.steps,
        "running": hb.running,
        "waiting": hb.waiting,
        "tokens_generated": hb.tokens_generated,
        "prompt_tokens": hb.prompt_tokens,
        "throughput_tok_s": hb.throughput_tok_s,
        "preemptions": hb.preemptions,
        "jobs_finished": hb.jobs_finished,
        "prefix_cache_hit_rate": hb.prefix_cache.hit_rate,
        "kv_cache_usage": hb.pool.usage if hb.pool else None,
        "jobs": [
            {
                **j.model_dump(),
                "fraction": min(1.0, j.tokens / j.max_tokens) if j.max_tokens else None,
            }
            for j in hb.jobs
        ],
    }


@bp.get("/v1/queues")
def queues() -> dict[str, Any]:
    return {"object": "queues", "depth": get_state().store.queue_lengths()}


@bp.get("/v1/pool")
def pool() -> dict[str, Any]:
    state = get_state()
    workers = [pool_json(w) for w in state.live_workers()]
    return {"object": "pool", "workers": workers, "queues": state.store.queue_lengths()}


def hide_other_tenants(state: AppState, data: list[dict[str, Any]]) -> None:
    """Drop running jobs of other tenants from the workers' job lists (ids are not shown to
    someone who would get 404 for them)."""
    who = auth.caller()
    if who is None or who.admin:
        return
    ids = [j["id"] for w in data for j in w["jobs"]]
    pipe = state.r.pipeline(transaction=False)
    for jid in ids:
        pipe.hget(state.store.keys.job(jid), "tenant")
    owners = dict(zip(ids, pipe.execute(), strict=True)) if ids else {}
    for w in data:
        w["jobs"] = [j for j in w["jobs"] if auth.visible(owners.get(j["id"]), who)]


@bp.get("/v1/workers")
def workers() -> dict[str, Any]:
    state = get_state()
    data = [worker_json(w) for w in state.live_workers()]
    hide_other_tenants(state, data)
    return {"object": "list", "data": data}


def tenant_usage(state: AppState) -> list[TenantUsage]:
    """Usage of every tenant the caller may see (its own; all for an admin or when open)."""
    scope = auth.list_scope()
    book = state.store.tenants
    names = book.tenants() if scope is None else [scope]
    files = f"{state.config.prefix}:file:"
    return [book.usage(t, files) for t in names]


@bp.get("/v1/tenants")
def tenants() -> dict[str, Any]:
    """Queue depth, running jobs, generated tokens and stored file bytes per tenant."""
    rows = [{"object": "tenant", **asdict(u)} for u in tenant_usage(get_state())]
    return {"object": "list", "data": rows}
