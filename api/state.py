"""What one app process keeps: its Redis client, job store, config and readiness memory."""

from __future__ import annotations

import threading
import time
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


@dataclass
class AppState:
    config: ApiConfig
    r: redis.Redis
    store: JobStore
    memory: StepMemory = field(default_factory=StepMemory)
    #: Lazily built helpers (batch store, Celery app for sending tasks).
    extras: dict[str, Any] = field(default_factory=dict)

    def redis_now(self) -> float:
        sec, usec = self.r.time()
        return sec + usec / 1e6

    def live_workers(self) -> list[WorkerView]:
        """Workers whose heartbeat key has not expired, sorted by id (malformed ones skipped)."""
        raw = self.store.workers()
        now = self.redis_now()
        out: list[WorkerView] = []
        for wid in sorted(raw):
            fields = raw[wid]
            hb = WorkerHeartbeat.parse_published({"worker_id": wid, **fields})
            if hb is None:
                continue
            last_seen = float(fields.get("last_seen") or 0.0)
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
