"""Prefix-aware admission: which bulk jobs this worker takes, so that each shared prompt prefix is
computed once per worker that serves it.

The choice itself runs on the Redis server (``pagedserve/lua/admission.lua``, one call per round,
O(window)); this module keeps what that call needs to know about this worker's cache:

- its **groups** (one per prefix signature, :mod:`pagedserve.prefix_sig`): which it owns (the
  affinity in Redis, refreshed by the heartbeat, lapsing when the worker dies), which are
  *warming* (the first job's prefill is not done; the group's jobs still join it, since the
  engine registers prefix blocks as it schedules them), how many of the group's prefix blocks the
  KV pool still holds (a probe of the pool's prefix-cache table with the prefix's block hashes),
  and hit counts;
- its **slots**: how many groups its pool holds at once (``prefix_groups``, or estimated from the
  pool size and the prompts seen); they bound how many new groups one round starts, never how
  many jobs of groups already here it takes.

Interactive jobs never go through this: they are claimed first, as before. A group whose prefix
was evicted and which has nothing running is dropped (its affinity released), so that another
worker may take it.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.store import AdmissionRequest, Admitted, JobStore, Lease
from pagedserve.telemetry import PrefixGroup
from scheduler.block_pool import BlockHash, hash_block
from worker.job_state import JobState
from worker.outputs import RequestOutput

if TYPE_CHECKING:
    from worker.service_config import ServiceConfig

#: Share of the KV pool that cached prefixes of served groups may fill (the rest: the jobs' own
#: suffixes and outputs); sets the group slots when ``prefix_groups`` is 0.
PREFIX_POOL_SHARE = 0.8
#: Groups kept for telemetry and probing (most recently used).
MAX_GROUPS = 64

log = logging.getLogger("pagedserve.worker.admission")


@dataclass
class RoundStats:
    """Diagnostic: what the admission rounds since the last heartbeat returned against ``cap``
    (logged at DEBUG with each heartbeat). A round that returns less than its cap while window
    entries this worker could take still wait leaves seats idle (``idle_seats``)."""

    rounds: int = 0
    cap: int = 0
    got: int = 0
    short: int = 0  # rounds that returned fewer than cap (most had nothing to take)
    empty: int = 0  # rounds that returned nothing
    idle_seats: int = 0  # seats left free while as many admissible entries waited

    def add(self, cap: int, got: int, waiting: int) -> None:
        self.rounds += 1
        self.cap += cap
        self.got += got
        self.short += got < cap
        self.empty += got == 0
        self.idle_seats += min(cap - got, waiting) if got < cap else 0


@dataclass
class Group:
    """What this worker knows of one prefix group."""

    sig: str
    owned: bool = False
    pilot: str | None = None  # job id of the first job, while its prefill runs
    running: set[str] = field(default_factory=set)
    probe: list[tuple[BlockHash, tuple[int, ...]]] = field(default_factory=list)
    depth: int = 0  # blocks the group's jobs were seen to share (largest hit)
    blocks: int = 0  # of those, cached at the last probe
    probed: int = -1  # the pool's eviction count at that probe (-1: count again)
    jobs: int = 0
    hits: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0

    def telemetry(self) -> PrefixGroup:
        return PrefixGroup(
            signature=self.sig, owned=self.owned, warming=self.pilot is not None,
            blocks=self.blocks, jobs=self.jobs, hits=self.hits, hit_tokens=self.hit_tokens,
            prompt_tokens=self.prompt_tokens, running=len(self.running),
        )  # fmt: skip


def claim_round(
    store: JobStore, consumer: str, cap: int, block_ms: int, req: AdmissionRequest | None
) -> tuple[list[Lease], Admitted | None]:
    """One claim round (on the claimer's thread, :mod:`worker.claimer`): interactive (and own
    pending) entries as before, then bulk jobs by prefix (``req``); when nothing came, wait
    ``block_ms`` for new work. Without ``req`` (``admission = "fcfs"``): the plain claim, in
    arrival order, interactive first."""
    if req is None:
        return store.claim(consumer, cap, block_ms), None
    leases = store.claim(consumer, cap, 0, priorities=("interactive",))
    admitted = None
    if cap - len(leases) > 0:
        admitted = store.admit_bulk(consumer, cap - len(leases), req)
        leases += admitted.leases
    if not leases and block_ms > 0:
        # Idle: wait on both streams as the plain claim does, so that idle workers share new
        # work (a blocked read delivers one entry each); later rounds go by prefix again.
        leases = store.claim(consumer, cap, block_ms)
    return leases, admitted


def _probe_of(token_ids: list[int], block_size: int) -> list[tuple[BlockHash, tuple[int, ...]]]:
    """Block hashes (as the scheduler chains them, no salt) of a prompt's full blocks but the
    last token's, each with its tokens (a tuple: what the pool's lookup compares)."""
    out: list[tuple[BlockHash, tuple[int, ...]]] = []
    parent: BlockHash | None = None
    for i in range((len(token_ids) - 1) // block_size):
        toks = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block(parent, toks, None)
        out.append((parent, tuple(toks)))
    return out


class PrefixAdmission:
    """This worker's side of prefix-aware admission (see the module docstring)."""

    def __init__(self, cfg: ServiceConfig, engine: Any, jobs: Mapping[str, JobState]) -> None:
        self.cfg = cfg
        self.engine = engine
        self.jobs = jobs
        self.groups: OrderedDict[str, Group] = OrderedDict()
        self.sig_of: dict[str, str] = {}  # running job id -> signature
        self._prompt_blocks = 0.0  # running mean of the prompts' blocks (for the slot estimate)
        self._seen = 0
        self._released: list[str] = []  # owned groups evicted: affinity to give up
        self.stats = RoundStats()

    # ----------------------------------------------------------------- claim
    def order_request(self) -> AdmissionRequest | None:
        """The admission request of the next claim round (this worker's cache, on the loop's
        thread); None with ``admission = "fcfs"`` (arrival order)."""
        return None if self.cfg.admission == "fcfs" else self.request()

    def claimed(self, cap: int, leases: list[Lease], admitted: Admitted | None) -> None:
        """Book what a claim round of ``cap`` seats took (on the loop's thread)."""
        if admitted is not None:
            self._took(admitted)
        if self.cfg.admission != "fcfs":
            self.stats.add(cap, len(leases), admitted.waiting if admitted is not None else 0)

    def request(self) -> AdmissionRequest:
        self._update()
        warm = {g.sig: len(g.running) for g in self.groups.values()
                if g.pilot is None and (g.owned or g.blocks > 0)}  # fmt: skip
        warming = [g.sig for g in self.groups.values() if g.pilot is not None]
        c = self.cfg
        return AdmissionRequest(
            window=c.admission_window, max_wait_ms=c.admission_max_wait_ms,
            steal_ms=c.admission_steal_ms, affinity_ttl_ms=c.affinity_ttl_ms,
            slots=self.slots(), touch_ms=max(1, c.reclaim_ms // 3), warm=warm, warming=warming,
        )  # fmt: skip

    def slots(self) -> int:
        """Groups served at once: ``prefix_groups``, else as many prefixes as the pool holds."""
        if self.cfg.prefix_groups > 0:
            return self.cfg.prefix_groups
        pool = self._pool()
        if pool is None or self._prompt_blocks <= 0:
            return 1  # nothing seen yet: one group, whose first job tells the prefix size
        return max(1, int(pool.num_blocks * PREFIX_POOL_SHARE // max(1.0, self._prompt_blocks)))

    def _took(self, got: Admitted) -> None:
        for sig in got.lost:
            if (g := self.groups.get(sig)) is not None:
                g.owned = False
        for sig in got.claimed:
            self._group(sig).owned = True
        new = set(got.piloted)  # their first job here fills the cache: the pilot
        for lease in got.leases:
            sig = got.signatures.get(lease.job_id)
            if sig is None:
                continue
            g = self._group(sig)
            if sig in new:
                new.discard(sig)
                g.pilot = lease.job_id
            g.running.add(lease.job_id)
            self.sig_of[lease.job_id] = sig
            self._observe_prompt(lease)
        self._evict(keep=set(got.claimed).union(got.signatures.values()))

    def _observe_prompt(self, lease: Lease) -> None:
        prompt = lease.request.prompt
        if isinstance(prompt, list):
            n = len(prompt)
        else:  # text or chat: about four characters a token, until the job tells
            text = prompt or "".join(m.content for m in lease.request.messages or [])
            n = len(text) // 4
        bs = self._block_size()
        self._seen += 1
        self._prompt_blocks += (n / bs + 1 - self._prompt_blocks) / min(self._seen, 32)

    # ----------------------------------------------------------------- jobs ending
    def finished(self, job_id: str, out: RequestOutput | None) -> None:
        """A job ended here (``out`` is its last output, if any): count its prefix hit."""
        sig = self.sig_of.pop(job_id, None)
        g = self.groups.get(sig) if sig is not None else None
        if g is None:
            return
        g.running.discard(job_id)
        g.probed = -1  # its jobs may have cached more than the last count: count again
        if g.pilot == job_id:
            g.pilot = None
        if out is None or not out.prompt_token_ids:
            return
        bs = self._block_size()
        g.jobs += 1
        g.prompt_tokens += len(out.prompt_token_ids)
        g.hit_tokens += out.num_cached_tokens
        if out.num_cached_tokens > 0:
            g.hits += 1
            g.depth = max(g.depth, out.num_cached_tokens // bs)
        if not g.probe:
            g.probe = _probe_of(out.prompt_token_ids, bs)

    def _update(self, full: bool = False) -> None:
        """Pilots whose prefill is done, cache probes, and (``full``, the heartbeat's) jobs that
        ended without ``finished`` and a count of the cached blocks of every group that has
        none running here. Every admission round runs this over every group, so its part is
        cheap: a group with jobs running here keeps its count (they hold its prefix blocks), and
        so does one counted since the pool last evicted a prefix (a count falls only by an
        eviction; ``Group.probed``); any other is probed for its first block. The heartbeat
        counts every group again (a count that rose without the group's own jobs, through
        another group's sharing its blocks, is corrected there). Why the eviction count: with
        hundreds of groups (prompts that share nothing make one each) the rounds' probes were
        most of the loop thread's admission work, ~0.3 ms a round."""
        pool = self._pool()
        evictions = getattr(pool, "evictions", -2)
        for g in list(self.groups.values()):
            if full:
                for jid in [j for j in g.running if j not in self.jobs]:
                    self.finished(jid, None)
            if g.pilot is not None:
                st = self.jobs.get(g.pilot)
                if st is None or st.first_token_seen:
                    if st is not None and st.latest is not None and not g.probe:
                        g.probe = _probe_of(st.latest.prompt_token_ids, self._block_size())
                    g.pilot = None
            if not g.probe:
                g.blocks = 0
            elif (g.running and g.blocks) or (not full and g.probed == evictions):
                continue  # its running jobs hold the blocks counted / nothing was evicted
            elif full:
                g.blocks = self._cached_blocks(g)
                g.probed = evictions
            else:
                g.blocks = self._still_cached(g)
                g.probed = evictions

    def _still_cached(self, g: Group) -> int:
        """``g.blocks`` as of the last count while the group's first block stays cached (a
        count that went stale is corrected by the next heartbeat), 0 once it is gone, a new
        count when it came back."""
        if not self._cached_blocks(g, limit=1):
            return 0
        return g.blocks or self._cached_blocks(g)

    def _cached_blocks(self, g: Group, limit: int = 0) -> int:
        pool = self._pool()
        if pool is None:
            return 0
        limit = min(limit or len(g.probe), g.depth or len(g.probe))
        prefetch = getattr(pool, "prefetch", None)  # (an engine process's view: asks ahead)
        if prefetch is not None:
            prefetch(g.probe[:limit])
        n = 0
        for h, toks in g.probe[:limit]:
            if pool.lookup(h, toks) is None:
                break
            n += 1
        return n

    # ----------------------------------------------------------------- heartbeat
    def refresh(self, store: JobStore, consumer: str) -> None:
        """Extend the affinities of groups still cached or running here; release the others."""
        self._log_rounds()
        self._update(full=True)
        keep, drop = [], self._released
        self._released = []
        for g in self.groups.values():
            if not g.owned:
                continue
            if g.running or g.pilot is not None or g.blocks > 0:
                keep.append(g.sig)
            else:
                drop.append(g.sig)
                g.owned = False
        for sig in store.refresh_affinity(consumer, keep, drop, self.cfg.affinity_ttl_ms):
            if (g := self.groups.get(sig)) is not None:
                g.owned = False

    def _log_rounds(self) -> None:
        """The diagnostic: the rounds since the last heartbeat against the seats they asked for."""
        st, self.stats = self.stats, RoundStats()
        if st.rounds and log.isEnabledFor(logging.DEBUG):
            warming = sum(g.pilot is not None for g in self.groups.values())
            log.debug(
                "admission: %d rounds took %d of the %d seats asked for (%d short, %d empty, "
                "%d seats idle while admissible work waited); %d slots, %d groups (%d warming)",
                st.rounds, st.got, st.cap, st.short, st.empty, st.idle_seats, self.slots(),
                len(self.groups), warming,
            )  # fmt: skip

    def release_all(self, store: JobStore, consumer: str) -> None:
        """Give up every affinity (the worker stops): its groups move at once, not at lapse."""
        owned = [g.sig for g in self.groups.values() if g.owned] + self._released
        self._released = []
        store.refresh_affinity(consumer, [], owned, self.cfg.affinity_ttl_ms)
        for g in self.groups.values():
            g.owned = False

    def telemetry(self) -> list[PrefixGroup]:
        """The MAX_GROUPS most recently used groups (prompts that share nothing make one group
        each: with every seat running, the heartbeat carried hundreds, ~10 ms a beat)."""
        return [g.telemetry() for g in itertools.islice(reversed(self.groups.values()), MAX_GROUPS)]

    # ----------------------------------------------------------------- helpers
    def _group(self, sig: str) -> Group:
        g = self.groups.get(sig)
        if g is None:
            g = self.groups[sig] = Group(sig)
        self.groups.move_to_end(sig)
        return g

    def _evict(self, keep: Container[str]) -> None:
        """Keep at most MAX_GROUPS groups: the least recently used with nothing running here go,
        owned ones too (their affinity is released at the next heartbeat), but not those in
        ``keep`` (the claim round's). Without this, prompts that share nothing (one group each,
        each owned while its blocks stay cached) piled up groups without bound, and every
        admission round probed them all. One pass per claim round: run per new group, with
        hundreds of groups running here (nothing to evict), the scans took ~0.3% of a fast
        worker's loop."""
        surplus = len(self.groups) - MAX_GROUPS
        if surplus <= 0:
            return
        idle = [s for s, x in self.groups.items()
                if not x.running and x.pilot is None and s not in keep]  # fmt: skip
        for old in idle[:surplus]:
            if self.groups.pop(old).owned:
                self._released.append(old)

    def _pool(self) -> Any:
        sched = getattr(self.engine, "scheduler", None)
        return getattr(sched, "pool", None)

    def _block_size(self) -> int:
        pool = self._pool()
        return int(pool.block_size) if pool is not None else 16
