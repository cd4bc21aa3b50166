"""The service loop's guard around Redis calls: connection errors mark Redis down and are retried
with exponential backoff (never fatal), and the Redis clock offset is kept for timestamps."""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from pagedserve.store import JobStore

log = logging.getLogger("pagedserve.worker")

#: Errors that mean "Redis is unreachable right now": retried with backoff, never fatal.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
MIN_BACKOFF_S, MAX_BACKOFF_S = 0.05, 2.0


class RedisDown(Exception):
    """The Redis operation was skipped or failed; retry later."""


class RedisGuard:
    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.ok = True
        self.retry_at = 0.0
        self.backoff = MIN_BACKOFF_S
        self.clock_offset = 0.0  # Redis clock - local clock

    def call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """Run one Redis operation; on a connection error mark Redis down (retry later)."""
        if not self.ok and time.monotonic() < self.retry_at:
            raise RedisDown
        try:
            out = fn(*args, **kw)
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):
                # The streams or the group vanished (FLUSHALL, a restart without AOF): recreate.
                log.warning("consumer group missing; recreating it")
                self.store._groups_ready = False
            else:
                # Not one job's (those come back in StepResult.errors): retried with backoff,
                # never fatal.
                log.warning("redis error (%s); retrying with backoff", e)
                self._down()
            raise RedisDown from e
        except REDIS_DOWN as e:
            if self.ok:
                log.warning("redis unreachable (%s); retrying with backoff", e)
            self._down()
            raise RedisDown from e
        if not self.ok:
            log.info("redis reachable again")
            self.store._groups_ready = False
            self.sync_clock()
        self.ok = True
        self.backoff = MIN_BACKOFF_S
        return out

    def _down(self) -> None:
        self.ok = False
        self.retry_at = time.monotonic() + self.backoff
        self.backoff = min(MAX_BACKOFF_S, self.backoff * 2)

    def sync_clock(self) -> None:
        try:
            sec, usec = self.store.r.time()
            self.clock_offset = sec + usec / 1e6 - time.time()
        except REDIS_DOWN:
            pass

    def now(self) -> float:
        """The Redis clock, in seconds."""
        return time.time() + self.clock_offset

    def wait_s(self) -> float:
        """How long to sleep before the next retry when there is nothing else to do."""
        return min(self.backoff, max(0.0, self.retry_at - time.monotonic()))
