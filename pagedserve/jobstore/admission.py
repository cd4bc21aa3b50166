"""The worker side of prefix-aware admission: take bulk jobs out of order from a bounded window of
the bulk stream (``admission.lua``), and keep this worker's prefix affinities (``affinity.lua``).

Why a window consumer: a consumer group delivers entries in order and XCLAIM moves only entries
already pending, so no plain read can pick "the jobs whose prefix my cache holds" from a deep
backlog without one worker hoarding it. The window is the pending list of a consumer no process
uses (:data:`~pagedserve.keys.WINDOW_CONSUMER`): every worker's admission call tops it up to a
bounded size and moves the entries it picks into its own pending list, on the server, in one
script. From there on an entry is leased, renewed, reclaimed and acknowledged like any other, so
exactly-once results, fencing and reclaim after a crash are unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.jobstore.base import StoreBase
from pagedserve.jobstore.records import Entry, Lease
from pagedserve.keys import GROUP, WINDOW_CONSUMER

log = logging.getLogger("pagedserve.worker")


@dataclass(frozen=True)
class AdmissionRequest:
    """One admission round of one worker (see ``admission.lua`` for the order of choice)."""

    window: int  # most bulk entries looked at
    max_wait_ms: int  # an entry passed over this long is taken by whoever asks first (aging)
    steal_ms: int  # a group whose owner took none of its jobs this long is handed over
    affinity_ttl_ms: int  # how long an affinity lasts unless refreshed
    slots: int  # most groups this worker serves at once (what its KV pool holds)
    touch_ms: int  # window entries idle this long get their idle time reset (below reclaim's)
    warm: Mapping[str, int] = field(default_factory=dict)  # signature -> running jobs
    warming: Sequence[str] = ()  # signatures whose first job's prefill is not done


@dataclass(frozen=True)
class Admitted:
    """What an admission round took: leases, the groups now this worker's, the groups it named
    (warm or warming) that another worker owns (taken over, or helped with), and the groups whose
    first job here (the pilot) was taken."""

    leases: list[Lease]
    signatures: dict[str, str]  # job id -> signature, for the jobs leased
    claimed: list[str]
    lost: list[str]
    piloted: list[str] = field(default_factory=list)
    waiting: int = 0  # window entries left that this worker could take with more seats


def admission_for_shards(admission: str, shards: int) -> str:
    """The admission a worker runs: prefix admission reads one bulk stream, so over several
    shards (a Redis Cluster with PAGEDSERVE_SHARDS > 1) it is arrival order (``fcfs``)."""
    if admission == "prefix" and shards != 1:
        log.warning(
            "prefix-aware admission needs one shard; this Redis Cluster has %d: "
            "admitting in arrival order (fcfs). Set PAGEDSERVE_SHARDS=1 for prefix admission",
            shards,
        )
        return "fcfs"
    return admission


class Admission(StoreBase):
    """Prefix-aware bulk admission and affinities (the worker calls these)."""

    _lease_entries: Any  # from Leasing

    def admit_bulk(self, consumer: str, max_jobs: int, req: AdmissionRequest) -> Admitted:
        """Take up to ``max_jobs`` bulk jobs chosen by prefix (one script call) and lease them
        (one pipelined round trip)."""
        if max_jobs <= 0:
            return Admitted([], {}, [], [], [])
        if self.keys.shards != 1:  # workers fall back to fcfs there (admission_for_shards)
            raise ValueError("prefix admission reads one bulk stream: it needs one shard")
        self.ensure_groups()
        stream = self.keys.stream("bulk")
        args: list[Any] = [
            GROUP, WINDOW_CONSUMER, consumer, req.window, max_jobs, req.max_wait_ms,
            req.steal_ms, req.affinity_ttl_ms, req.slots, req.touch_ms, len(req.warm),
        ]  # fmt: skip
        for sig, running in req.warm.items():
            args += [sig, running]
        args += [len(req.warming), *req.warming]
        keys = [stream, self.keys.affinity, self.keys.affinity_expiry, self.keys.window]
        reply = self._exec([("admission", keys, args)])[0]
        *picked, claimed, lost, piloted, waiting = reply
        entries: list[Entry] = [(stream, eid, job) for eid, job, _ in picked]
        sigs = {job: sig for _, job, sig in picked if sig}
        leases = self._lease_entries(consumer, entries, "admission")
        return Admitted(leases, sigs, list(claimed), list(lost), list(piloted), int(waiting))

    def refresh_affinity(
        self, consumer: str, keep: Sequence[str], drop: Sequence[str], ttl_ms: int
    ) -> list[str]:
        """Extend this worker's affinities in ``keep`` and remove those in ``drop`` (only while it
        owns them). Returns the kept signatures another worker took over."""
        if not keep and not drop:
            return []
        keys = [self.keys.affinity, self.keys.affinity_expiry]
        args = [consumer, ttl_ms, len(keep), *keep, *drop]
        return list(self._exec([("affinity", keys, args)])[0])

    def affinities(self) -> dict[str, str]:
        """Live affinities: prefix signature -> owning worker (for the API and tests)."""
        t = self.r.time()
        now_ms = t[0] * 1000 + t[1] // 1000
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.keys.affinity)
        pipe.zrangebyscore(self.keys.affinity_expiry, now_ms, "+inf")
        owners, live = pipe.execute()
        return {s: owners[s].rsplit("|", 1)[0] for s in live if s in owners}
