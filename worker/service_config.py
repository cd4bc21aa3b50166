"""The worker's options: :class:`ServiceConfig` and the ``pagedserve worker`` argument parser,
built by :mod:`pagedserve.settings` from it and the engine's
:class:`~worker.outputs.EngineConfig`, so each default is written once, in the dataclass."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve import settings
from pagedserve.settings import add_options, build, opt
from pagedserve.store import DEFAULT_LEASE_MS
from worker.outputs import EngineConfig

DESCRIPTION = "pagedserve worker: the long-lived Redis service loop around one Engine."


@dataclass(slots=True)
class ServiceConfig:
    """Service-loop options (the engine's are in :class:`EngineConfig`); each with an
    :func:`~pagedserve.settings.opt` is a ``pagedserve worker`` flag."""

    #: Consumer name in the streams' group; empty: ``host-pid``.
    worker_id: str = field(default="", metadata=opt("consumer name (default: host-pid)"))
    redis_url: str = settings.redis_url_field()
    prefix: str = settings.prefix_field()
    lease_ms: int = field(
        default=DEFAULT_LEASE_MS, metadata=opt("a job's lease; renewed every third of it")
    )
    reclaim_ms: int = field(
        default=DEFAULT_LEASE_MS,
        metadata=opt("a stream entry idle this long belongs to a dead worker and is reclaimed"),
    )
    max_deliveries: int = field(
        default=3, metadata=opt("deliveries before an entry goes to the dead stream")
    )
    grace_s: float = field(
        default=30.0, metadata=opt("on SIGTERM: seconds to finish running jobs, then requeue")
    )
    progress_interval_ms: float = field(
        default=50.0,
        metadata=opt("at most one progress write per streamed job per this many ms"),
    )
    # Jobs no reader follows (pagedserve.events: a follower keeps the job's watch key set), bulk
    # or interactive: their deltas and token counts are written this often (their first token at
    # once, as for every job). At fast steps the progress writes of a full batch were the
    # worker's largest Redis cost (bench.service, bench.redis_cost).
    bulk_progress_interval_ms: float = field(
        default=500.0,
        metadata=opt("at most one progress write per job no reader streams per this many ms"),
    )
    heartbeat_s: float = field(
        default=1.0, metadata=opt("seconds between heartbeats (the API's view of this worker)")
    )
    idle_block_ms: int = 100  # blocking claim when the engine is idle
    # While busy with free seats: after a claim that found nothing, the next one waits up to
    # this long for new work (a blocking read, woken by the first job queued); a claim that
    # found jobs is repeated at once, without waiting.
    claim_interval_s: float = 0.05
    throughput_window_s: float = 10.0
    # Prefix-aware admission of bulk jobs (worker/admission.py, pagedserve/lua/admission.lua),
    # the default; "fcfs" takes bulk jobs in arrival order.
    admission: str = field(
        default="prefix",
        metadata=opt("bulk admission: by prefix group and affinity, or in arrival order",
                     choices=("prefix", "fcfs")),
    )  # fmt: skip
    admission_window: int = field(
        default=2048, metadata=opt("bulk entries looked ahead over per admission round")
    )
    admission_max_wait_ms: int = field(
        default=120_000,
        metadata=opt("a bulk job passed over this long (in the window, not taken) goes to the "
                     "first worker that asks: the bound on the delay prefix grouping may cause"),
    )  # fmt: skip
    admission_steal_ms: int = field(
        default=5_000,
        metadata=opt("a prefix group whose worker took none of its jobs this long, while its "
                     "oldest waited as long, moves to a worker with a free group slot"),
    )  # fmt: skip
    affinity_ttl_ms: int = field(
        default=10_000, metadata=opt("a prefix affinity lapses unless its worker refreshes it")
    )
    prefix_groups: int = field(
        default=0,
        metadata=opt("prefix groups served at once; 0: as many prefixes as the KV pool holds"),
    )
    # While jobs run, the writer drains the cancel set with every write and at least this often.
    cancel_poll_s: float = 0.05
    # Writes of bulk jobs wait for the writer's next send, at most this long after the last one
    # (interactive jobs' go at once): fewer wakes of the writer's thread (worker/writer.py).
    write_interval_s: float = 0.05
    # The engine in a child process of its own (worker/engine_process.py): the service's Python
    # work no longer takes the interpreter lock from the engine's steps. The default since the
    # forty-first session: at fast steps it ran 2-14% faster than the engine in the loop's
    # process on every CPU kind measured (a tie at slow steps); since the forty-second session
    # the loop's process never imports torch (its tokenizer: the class the child's
    # AutoTokenizer chose), so it costs ~0.06 GB more memory, and it starts as fast.
    engine_process: bool = field(
        default=True,
        metadata=opt("step the engine in a child process beside the service loop; "
                     "--no-engine-process keeps it in the loop's process (one process, "
                     "~0.06 GB less memory, 2-14% slower at fast steps: bench/README.md)"),
    )  # fmt: skip
    # At exit, how long the writer may go on retrying writes that Redis has not taken yet.
    writer_drain_s: float = 5.0

    def __post_init__(self) -> None:
        ms = (self.admission_max_wait_ms, self.admission_steal_ms, self.affinity_ttl_ms)
        if self.admission_window < 1 or self.prefix_groups < 0 or min(ms) < 1:
            raise ValueError(
                "admission_window and the admission times must be positive, prefix_groups >= 0"
            )
        if not self.worker_id:
            self.worker_id = f"{socket.gethostname()}-{os.getpid()}"

    @property
    def progress_interval_s(self) -> float:
        return self.progress_interval_ms / 1e3

    @property
    def bulk_progress_interval_s(self) -> float:
        return max(self.bulk_progress_interval_ms, self.progress_interval_ms) / 1e3

    @property
    def renew_interval_s(self) -> float:
        return min(self.lease_ms, self.reclaim_ms) / 3 / 1e3

    @property
    def reclaim_interval_s(self) -> float:
        return max(0.2, self.reclaim_ms / 3 / 1e3)


def parse_args(argv: Sequence[str] | None, description: str = DESCRIPTION) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pagedserve worker", description=description)
    ap.add_argument("--model", required=True, help="checkpoint directory or .gguf file")
    ap.add_argument("--log-level", default="INFO")
    add_options(ap.add_argument_group("engine"), EngineConfig)
    add_options(ap.add_argument_group("service"), ServiceConfig)
    return ap.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return build(EngineConfig, args)


def service_config(args: argparse.Namespace) -> ServiceConfig:
    return build(ServiceConfig, args)
