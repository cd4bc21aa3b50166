"""What one app process keeps: its Redis client, job store, config and readiness memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from flask import Flask, current_app

from api.config import ApiConfig
from pagedserve.redis_util import connect
from pagedserve.store import JobStore
from pagedserve.telemetry import WorkerHeartbeat

EXTENSION = "pagedserve"


@dataclass
class WorkerView:
    """A live worker's parsed heartbeat plus when it was published (Redis clock)."""

    hb: WorkerHeartbeat
    last_seen: float
    age_s: float


@dataclass
class StepMemory:
    """Per worker: the last step counter this process saw and since when (monotonic)."""

    steps: dict[str, tuple[int, float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, worker_id: str, steps: int, now: float | None = None) -> float:
        """Record ``steps``; returns for how many seconds the counter has stood still."""
        now = time.monotonic() if now is None else now
        with self.lock:
            prev = self.steps.get(worker_id)
            if prev is None or prev[0] != steps:
                self.steps[worker_id] = (steps, now)
                return 0.0
            return now - prev[1]


@dataclass(frozen=True)
class ContextLimits:
    """What the workers serving a model publish about its context (the smallest over workers).

    ``max_token_bytes``: most UTF-8 bytes of text one token of the vocabulary stands for, so a
    text of N bytes has at least ceil(N / max_token_bytes) tokens (``None`` if not published).
    """

    max_model_len: int
    max_token_bytes: int | None = None


@dataclass
class ContextCache:
    """Per model (and ``None``: any model): the limits, refreshed every ``context_cache_s``."""

    at: float = -1e9
    limits: dict[str | None, ContextLimits] = field(default_factory=dict)
    #: Served model name -> the live workers' heartbeats for it (``GET /v1/models``).
    models: dict[str, list[WorkerHeartbeat]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def parse_heartbeats(raw: dict[str, dict[str, Any]]) -> dict[str, WorkerHeartbeat]:
    """``JobStore.workers()`` validated: one typed heartbeat per worker, sorted by id; a malformed
    one is logged (``WorkerHeartbeat.parse_published``) and left out."""
    out: dict[str, WorkerHeartbeat] = {}
    for wid in sorted(raw):
        hb = WorkerHeartbeat.parse_published({"worker_id": wid, **raw[wid]})
        if hb is not None:
            out[wid] = hb
    return out


def context_limits_of(workers: Iterable[WorkerHeartbeat]) -> dict[str | None, ContextLimits]:
    """Smallest ``max_model_len`` / ``max_token_bytes`` per served model and over all workers."""
    out: dict[str | None, ContextLimits] = {}
    for hb in workers:
        if hb.max_model_len is None:
            continue
        mml, mtb = hb.max_model_len, hb.max_token_bytes
        for key in {hb.model, None}:
            cur = out.get(key)
            if cur is None:
                out[key] = ContextLimits(mml, mtb)
            else:
                both = [x for x in (cur.max_token_bytes, mtb) if x is not None]
                out[key] = ContextLimits(min(cur.max_model_len, mml), max(both, default=None))
    return out


@dataclass
class AppState:
    config: ApiConfig
    r: redis.Redis
    store: JobStore
    memory: StepMemory = field(default_factory=StepMemory)
    #: Lazily built helpers (batch store, Celery app for sending tasks).
    extras: dict[str, Any] = field(default_factory=dict)
    contexts: ContextCache = field(default_factory=ContextCache)

    def context_limits(self, model: str | None) -> ContextLimits | None:
        """The context of the live workers serving ``model`` (any, for ``None``); ``None`` if no
        live worker publishes one. Cached for ``config.context_cache_s``."""
        with self.contexts.lock:
            self._refresh_workers(force=False)
            return self.contexts.limits.get(model)

    def served_models(self, *, fresh: bool = False) -> dict[str, list[WorkerHeartbeat]]:
        """Model name -> heartbeats of the live workers serving it, cached like
        :meth:`context_limits`; ``fresh``: read the heartbeats again now."""
        with self.contexts.lock:
            self._refresh_workers(force=fresh)
            return self.contexts.models

    def _refresh_workers(self, *, force: bool) -> None:
        now = time.monotonic()
        if force or now - self.contexts.at > self.config.context_cache_s:
            hbs = list(parse_heartbeats(self.store.workers()).values())
            self.contexts.limits = context_limits_of(hbs)
            models: dict[str, list[WorkerHeartbeat]] = {}
            for hb in hbs:
                models.setdefault(hb.model, []).append(hb)
            self.contexts.models = models
            self.contexts.at = now

    def redis_now(self) -> float:
        sec, usec = self.r.time()
        return sec + usec / 1e6

    def live_workers(self) -> list[WorkerView]:
        """Workers whose heartbeat key has not expired, sorted by id (malformed ones skipped)."""
        raw = self.store.workers()
        now = self.redis_now()
        out: list[WorkerView] = []
        for wid, hb in parse_heartbeats(raw).items():
            last_seen = float(raw[wid].get("last_seen") or 0.0)
            out.append(WorkerView(hb, last_seen, max(0.0, now - last_seen)))
        return out


def init_state(app: Flask, config: ApiConfig) -> AppState:
    r = connect(config.redis_url)
    state = AppState(config=config, r=r, store=JobStore(r, prefix=config.prefix))
    app.extensions[EXTENSION] = state
    return state


def get_state() -> AppState:
    state: Any = current_app.extensions[EXTENSION]
    return state
