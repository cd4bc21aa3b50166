"""The worker's options: :class:`ServiceConfig` and the ``pagedserve worker`` argument parser that
builds it and the engine's :class:`~worker.outputs.EngineConfig` (kept together, so defaults
live next to the flags that set them)."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.keys import DEFAULT_PREFIX, env_prefix
from pagedserve.redis_util import default_url
from pagedserve.store import DEFAULT_LEASE_MS
from worker.outputs import EngineConfig

DESCRIPTION = "pagedserve worker: the long-lived Redis service loop around one Engine."


@dataclass(slots=True)
class ServiceConfig:
    """Service-loop options (the engine's are in :class:`EngineConfig`)."""

    worker_id: str
    redis_url: str
    prefix: str = DEFAULT_PREFIX
    lease_ms: int = DEFAULT_LEASE_MS
    reclaim_ms: int = 15_000  # an entry idle this long belongs to a dead worker
    max_deliveries: int = 3
    grace_s: float = 30.0
    progress_interval_s: float = 0.05  # at most one progress write per job per interval
    heartbeat_s: float = 1.0
    idle_block_ms: int = 100  # blocking claim when the engine is idle
    # Least time between non-blocking claims while busy after one found nothing (a claim that
    # found jobs is repeated at once); new work waits at most this long for a busy worker.
    claim_interval_s: float = 0.05
    throughput_window_s: float = 10.0
    # Bulk admission: "prefix" (prefix-aware, worker/admission.py) or "fcfs" (arrival order).
    admission: str = "prefix"
    admission_window: int = 2048  # bulk entries looked ahead over per admission round
    # A bulk job passed over (in the window, not taken) this long goes to whichever worker asks
    # first (aging): the bound on how long prefix grouping may delay a job.
    admission_max_wait_ms: int = 120_000
    # A group whose owner took none of its jobs this long, while its oldest waited as long, is
    # handed to a worker with a free group slot (its owner is busy).
    admission_steal_ms: int = 5_000
    affinity_ttl_ms: int = 10_000  # a prefix affinity lapses unless its worker refreshes it
    prefix_groups: int = 0  # groups served at once; 0: as many prefixes as the KV pool holds

    @property
    def renew_interval_s(self) -> float:
        return min(self.lease_ms, self.reclaim_ms) / 3 / 1e3

    @property
    def reclaim_interval_s(self) -> float:
        return max(0.2, self.reclaim_ms / 3 / 1e3)


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def parse_args(argv: Sequence[str] | None, description: str = DESCRIPTION) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pagedserve worker", description=description)
    ap.add_argument("--model", required=True, help="checkpoint directory or .gguf file")
    ap.add_argument("--worker-id", default=None, help="consumer name (default: host-pid)")
    ap.add_argument("--redis", default=None, help="Redis URL (default: $PAGEDSERVE_REDIS_URL)")
    ap.add_argument("--prefix", default=None, help="key prefix (default: $PAGEDSERVE_PREFIX/ps)")
    e = ap.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--kv-cache-memory", type=_size, default=None, help="bytes, e.g. 512MB")
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--dtype", default="float32")
    e.add_argument("--device", default="cpu")
    e.add_argument("--num-threads", type=int, default=None)
    e.add_argument("--no-prefix-caching", action="store_true")
    s = ap.add_argument_group("service")
    s.add_argument("--lease-ms", type=int, default=DEFAULT_LEASE_MS)
    s.add_argument("--reclaim-ms", type=int, default=15_000)
    s.add_argument("--max-deliveries", type=int, default=3)
    s.add_argument("--grace-s", type=float, default=30.0)
    s.add_argument("--progress-interval-ms", type=float, default=50.0)
    s.add_argument("--admission", choices=("prefix", "fcfs"), default="prefix")
    s.add_argument("--admission-window", type=int, default=2048)
    s.add_argument("--admission-max-wait-ms", type=int, default=120_000)
    s.add_argument("--admission-steal-ms", type=int, default=5_000)
    s.add_argument("--affinity-ttl-ms", type=int, default=10_000)
    s.add_argument("--prefix-groups", type=int, default=0)
    s.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        device=args.device,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads,
    )


def service_config(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(
        worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        redis_url=args.redis or default_url(),
        prefix=args.prefix or env_prefix(),
        lease_ms=args.lease_ms,
        reclaim_ms=args.reclaim_ms,
        max_deliveries=args.max_deliveries,
        grace_s=args.grace_s,
        progress_interval_s=args.progress_interval_ms / 1e3,
        admission=args.admission,
        admission_window=args.admission_window,
        admission_max_wait_ms=args.admission_max_wait_ms,
        admission_steal_ms=args.admission_steal_ms,
        affinity_ttl_ms=args.affinity_ttl_ms,
        prefix_groups=args.prefix_groups,
    )
