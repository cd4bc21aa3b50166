"""``GET /metrics``: Prometheus text built at scrape time from Redis.

Worker series come from each live worker's heartbeat, labelled ``worker``; names follow vLLM's
where the meaning is the same (``vllm:X`` -> ``pagedserve:X``). Counters are cumulative per worker
process, so a restarted worker shows as a counter reset.
"""

from __future__ import annotations

from collections.abc import Iterator

from flask import Blueprint, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from api.state import AppState, WorkerView, get_state
from api.status import state_counts, tenant_usage
from pagedserve.telemetry import Histogram
from pagedserve.tenants import TenantUsage

bp = Blueprint("metrics", __name__)

P = "pagedserve:"


def histogram(name: str, doc: str, views: list[WorkerView], attr: str) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(P + name, doc, labels=["worker"])
    for w in views:
        h: Histogram = getattr(w.hb, attr)
        buckets = [(repr(float(b)), float(c)) for b, c in zip(h.buckets, h.counts, strict=False)]
        buckets.append(("+Inf", float(h.count)))
        fam.add_metric([w.hb.worker_id], buckets, h.sum)
    return fam


def worker_gauges(views: list[WorkerView]) -> Iterator[Metric]:
    def gauge(name: str, doc: str, values: list[tuple[str, float]]) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(P + name, doc, labels=["worker"])
        for wid, v in values:
            fam.add_metric([wid], v)
        return fam

    yield gauge("num_requests_running", "Jobs in the worker's running batch.",
                [(w.hb.worker_id, w.hb.running) for w in views])  # fmt: skip
    yield gauge("num_requests_waiting", "Jobs admitted by the worker, waiting for KV blocks.",
                [(w.hb.worker_id, w.hb.waiting) for w in views])  # fmt: skip
    yield gauge("kv_cache_usage_perc", "KV-cache usage: fraction of blocks in use (1 = 100%).",
                [(w.hb.worker_id, w.hb.pool.usage) for w in views if w.hb.pool])  # fmt: skip
    yield gauge("kv_cache_bytes", "KV-cache pool size in bytes (blocks x bytes per block).",
                [(w.hb.worker_id, w.hb.pool.num_blocks * w.hb.pool.bytes_per_block)
                 for w in views if w.hb.pool and w.hb.pool.bytes_per_block])  # fmt: skip
    yield gauge("generation_throughput_toks_per_s", "Output tokens per second over ~10 s.",
                [(w.hb.worker_id, w.hb.throughput_tok_s) for w in views])  # fmt: skip
    yield gauge("heartbeat_age_seconds", "Seconds since the worker's last heartbeat.",
                [(w.hb.worker_id, w.age_s) for w in views])  # fmt: skip
    blocks = GaugeMetricFamily(
        P + "kv_cache_blocks", "KV blocks per state (exclusive states).", labels=["worker", "state"]
    )
    for w in views:
        if w.hb.pool:
            for st, n in state_counts(w.hb.pool.block_states, w.hb.pool).items():
                blocks.add_metric([w.hb.worker_id, st], n)
    yield blocks


def worker_counters(views: list[WorkerView]) -> Iterator[Metric]:
    def counter(name: str, doc: str, values: list[tuple[str, float]]) -> CounterMetricFamily:
        fam = CounterMetricFamily(P + name, doc, labels=["worker"])
        for wid, v in values:
            fam.add_metric([wid], v)
        return fam

    ids = [(w.hb.worker_id, w.hb) for w in views]
    yield counter("prefix_cache_queries", "Prefix-cache queries, in tokens.",
                  [(i, hb.prefix_cache.queried_tokens) for i, hb in ids])  # fmt: skip
    yield counter("prefix_cache_hits", "Prefix-cache hits, in tokens.",
                  [(i, hb.prefix_cache.hit_tokens) for i, hb in ids])  # fmt: skip
    yield counter("num_preemptions", "Cumulative preemptions.",
                  [(i, hb.preemptions) for i, hb in ids])  # fmt: skip
    yield counter("generation_tokens", "Output tokens generated.",
                  [(i, hb.tokens_generated) for i, hb in ids])  # fmt: skip
    yield counter("prompt_tokens", "Prompt tokens computed (prefill).",
                  [(i, hb.prompt_tokens) for i, hb in ids])  # fmt: skip
    yield counter("engine_steps", "Engine steps run.",
                  [(i, hb.steps) for i, hb in ids])  # fmt: skip
    finished = CounterMetricFamily(
        P + "request_success", "Finished jobs by final status.", labels=["worker", "status"]
    )
    for i, hb in ids:
        for status, n in sorted(hb.jobs_finished.items()):
            finished.add_metric([i, status], n)
    yield finished
    loop = CounterMetricFamily(
        P + "worker_loop_seconds",
        "The service loop's time by phase: engine (steps), service (its own work), idle.",
        labels=["worker", "phase"],
    )
    for i, hb in ids:
        for phase, sec in sorted(hb.loop_seconds.items()):
            loop.add_metric([i, phase], sec)
    yield loop
    cpu = CounterMetricFamily(
        P + "worker_engine_cpu_seconds",
        "The stepping thread's CPU time in engine steps; the engine phase of "
        "worker_loop_seconds minus this is time off the CPU mid-step (interpreter lock, "
        "preemption).",
        labels=["worker"],
    )
    for i, hb in ids:
        cpu.add_metric([i], hb.engine_cpu_seconds)
    yield cpu


def prefix_series(views: list[WorkerView]) -> Iterator[Metric]:
    """Prefix-cache hit ratio (hit / queried prompt tokens) per worker and over the fleet, and
    the prefix groups each worker holds cached (prefix-aware admission, ``worker.admission``)."""
    ratio = GaugeMetricFamily(
        P + "prefix_cache_hit_ratio", "Prompt tokens served by the prefix cache / prompt tokens "
        "looked up, since the worker started.", labels=["worker"]
    )  # fmt: skip
    for w in views:
        pc = w.hb.prefix_cache
        ratio.add_metric(
            [w.hb.worker_id], pc.hit_tokens / pc.queried_tokens if pc.queried_tokens else 0.0
        )
    yield ratio
    queried = sum(w.hb.prefix_cache.queried_tokens for w in views)
    hits = sum(w.hb.prefix_cache.hit_tokens for w in views)
    yield GaugeMetricFamily(
        P + "prefix_cache_hit_ratio_fleet",
        "The prefix-cache hit ratio over all live workers.",
        value=hits / queried if queried else 0.0,
    )
    groups = GaugeMetricFamily(
        P + "prefix_groups_cached",
        "Prefix groups with blocks in the worker's cache.",
        labels=["worker"],
    )
    for w in views:
        groups.add_metric([w.hb.worker_id], sum(1 for g in w.hb.prefixes if g.blocks > 0))
    yield groups
    moved = CounterMetricFamily(
        P + "prefix_cache_moved_blocks",
        "Cached prefixes moved into another block (one block copy each) so that a sequence's "
        "table could grow into the block after its last one, since the worker started.",
        labels=["worker"],
    )
    for w in views:
        moved.add_metric([w.hb.worker_id], w.hb.prefix_cache.moved_blocks)
    yield moved


def child_restarts(state: AppState) -> CounterMetricFamily:
    """Restarts of ``pagedserve up``'s children, counted by the supervisor in Redis."""
    fam = CounterMetricFamily(
        P + "child_restarts", "Times pagedserve up restarted a child.", labels=["child"]
    )
    raw = state.r.hgetall(state.store.keys.supervisor_restarts)
    for child, n in sorted(raw.items()):
        fam.add_metric([str(child)], float(n))
    return fam


def rejected(state: AppState) -> CounterMetricFamily:
    """429 answers of every API process, by error code (tenant limit, no online seat...)."""
    fam = CounterMetricFamily(
        P + "api_rejected_requests", "Requests the API answered with 429.", labels=["code"]
    )
    for code, n in sorted(state.r.hgetall(state.store.keys.api_rejected).items()):
        fam.add_metric([str(code)], float(n))
    return fam


def tenant_series(usage: list[TenantUsage]) -> Iterator[Metric]:
    """Per-tenant series, labelled ``tenant``."""

    def family(kind: type, name: str, doc: str, attr: str) -> Metric:
        fam = kind(P + name, doc, labels=["tenant"])
        for u in usage:
            fam.add_metric([u.tenant], getattr(u, attr))
        return fam

    yield family(GaugeMetricFamily, "tenant_queue_depth", "Jobs queued per tenant.", "queued")
    yield family(GaugeMetricFamily, "tenant_num_requests_running",
                 "Jobs running per tenant.", "running")  # fmt: skip
    yield family(CounterMetricFamily, "tenant_generation_tokens",
                 "Output tokens generated per tenant (ended jobs and running ones).",
                 "tokens_generated")  # fmt: skip
    yield family(CounterMetricFamily, "tenant_jobs_finished", "Jobs ended per tenant.",
                 "jobs_finished")  # fmt: skip
    yield family(GaugeMetricFamily, "tenant_file_bytes", "Bytes of stored files per tenant.",
                 "file_bytes")  # fmt: skip


class PagedServeCollector:
    """Reads Redis once per scrape. ``usage``: the tenants the caller may see."""

    def __init__(self, state: AppState, usage: list[TenantUsage] | None = None) -> None:
        self.state = state
        self.usage = usage or []

    def collect(self) -> Iterator[Metric]:
        queues = self.state.store.queue_lengths()
        views = self.state.live_workers()
        depth = GaugeMetricFamily(
            P + "queue_depth", "Jobs queued and not yet taken by a worker.", labels=["priority"]
        )
        for prio, n in queues.items():
            depth.add_metric([prio], n)
        yield depth
        yield GaugeMetricFamily(P + "num_workers", "Live workers.", value=len(views))
        yield from worker_gauges(views)
        yield from worker_counters(views)
        yield from prefix_series(views)
        yield from tenant_series(self.usage)
        yield histogram("time_to_first_token_seconds", "Time to first token in seconds.",
                        views, "time_to_first_token_seconds")  # fmt: skip
        yield histogram("e2e_request_latency_seconds", "End-to-end job latency in seconds.",
                        views, "e2e_request_latency_seconds")  # fmt: skip
        yield child_restarts(self.state)
        yield rejected(self.state)


def render(state: AppState, usage: list[TenantUsage] | None = None) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PagedServeCollector(state, usage))  # type: ignore[arg-type]
    return generate_latest(registry)


@bp.get("/metrics")
def metrics() -> Response:
    state = get_state()
    return Response(render(state, tenant_usage(state)), content_type=CONTENT_TYPE_LATEST)
