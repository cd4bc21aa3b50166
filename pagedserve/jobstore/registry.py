"""Workers and queues as the job store sees them: heartbeats, live workers, queue lengths,
dead letters.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.jobstore.base import StoreBase
from pagedserve.keys import GROUP, PRIORITIES, WINDOW_CONSUMER


class WorkerRegistry(StoreBase):
    """Worker heartbeats and queue introspection (for the API's status and metrics)."""

    def heartbeat(self, worker_id: str, info: dict[str, Any], ttl_s: int = 30) -> None:
        """Publish a worker's liveness and stats (JSON values) with a TTL: one script call,
        stamped with Redis's clock (``last_seen``)."""
        args: list[Any] = [ttl_s, worker_id]
        for k, v in info.items():
            args += (k, json.dumps(v))
        self._exec([("heartbeat", [self.keys.worker(worker_id), self.keys.workers], args)])

    def workers(self) -> dict[str, dict[str, Any]]:
        """Live workers (heartbeat key not expired) and their last published info."""
        ids = self.r.zrange(self.keys.workers, 0, -1)
        pipe = self.r.pipeline(transaction=False)
        for wid in ids:
            pipe.hgetall(self.keys.worker(wid))
        out: dict[str, dict[str, Any]] = {}
        stale: list[str] = []
        for wid, h in zip(ids, pipe.execute(), strict=True):
            if h:
                out[wid] = {k: json.loads(v) for k, v in h.items()}
            else:
                stale.append(wid)
        if stale:
            self.r.zrem(self.keys.workers, *stale)
        return out

    def queue_lengths(self) -> dict[str, int]:
        """Entries not yet delivered to any worker, per priority (the group's lag, plus the bulk
        entries waiting in the admission window: read ahead, not yet taken)."""
        self.ensure_groups()
        out: dict[str, int] = {}
        for prio in PRIORITIES:
            out[prio] = sum(self._lag(self.keys.stream(prio, k)) for k in range(self.keys.shards))
        out["bulk"] += self.window_length()
        return out

    def _lag(self, stream: str) -> int:
        groups = self.r.xinfo_groups(stream)
        g = next((g for g in groups if g["name"] == GROUP), None)
        lag = g.get("lag") if g else None
        return int(lag) if lag is not None else int(self.r.xlen(stream))

    def window_length(self) -> int:
        """Bulk entries read ahead into the admission window and not yet taken by a worker."""
        info = self.r.xpending(self.keys.stream("bulk"), GROUP)
        for c in info.get("consumers") or []:
            if c.get("name") == WINDOW_CONSUMER:
                return int(c.get("pending", 0))
        return 0

    def dead_letters(self, count: int = 100) -> list[dict[str, str]]:
        """The oldest ``count`` dead-lettered entries (of every shard, oldest first)."""
        out = [
            dict(fields, id=eid)
            for k in range(self.keys.shards)
            for eid, fields in self.r.xrange(self.keys.dead_in(k), count=count)
        ]
        return sorted(out, key=lambda d: tuple(int(x) for x in d["id"].split("-")))[:count]
