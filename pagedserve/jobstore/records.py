"""What the job store reads and writes: leases, progress, final writes, batch refs and lines,
and the names the service reserves from clients.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import redis

from pagedserve import openai_format
from pagedserve.keys import Keys, Priority
from pagedserve.redis_util import stream_entries
from pagedserve.schemas import (
    JobRequest,
    JobResult,
)

DEFAULT_RETENTION_S = 24 * 3600
#: How long a lease lasts unless renewed; the worker service runs with the same default.
DEFAULT_LEASE_MS = 15_000
DEFAULT_MAX_DELIVERIES = 3
DEFAULT_EVENTS_MAXLEN = 10_000

FinalStatus = Literal["succeeded", "failed", "cancelled"]

#: Metadata keys only the batch fan-out writes (its jobs show them); refused from clients.
RESERVED_METADATA_KEYS = frozenset({"batch_id", "custom_id"})
#: Idempotency keys with this prefix were the fan-out's own (before ``Keys.batch_idem``); refused
#: from clients so that no old or future internal key can be taken.
RESERVED_IDEMPOTENCY_PREFIX = "batch:"

#: Redis errors that say "not now" rather than "this call is wrong": retried like a lost connection.
TRANSIENT_REPLY_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.BusyLoadingError,
)


def check_client_request(request: JobRequest) -> None:
    """Raise ``ValueError`` for a client request that uses a name the service reserves."""
    idem = request.idempotency_key
    if idem is not None and idem.startswith(RESERVED_IDEMPOTENCY_PREFIX):
        raise ValueError(
            f"idempotency_key: the prefix {RESERVED_IDEMPOTENCY_PREFIX!r} is reserved for "
            "batch requests"
        )
    taken = sorted(RESERVED_METADATA_KEYS & set(request.metadata or {}))
    if taken:
        raise ValueError(f"metadata: the keys {taken} are reserved for batch requests")


@dataclass(frozen=True)
class BatchRef:
    """What makes a job a request of an OpenAI batch: written by the fan-out into the job record
    (server-owned hash fields), never taken from the request."""

    batch_id: str
    custom_id: str
    url: str
    model: str

    @classmethod
    def from_fields(cls, fields: Sequence[Any]) -> BatchRef | None:
        """From ``(batch_id, custom_id, batch_url, batch_model)`` as the scripts return them."""
        if len(fields) < 4 or not fields[0] or fields[1] is None:
            return None
        return cls(str(fields[0]), str(fields[1]), str(fields[2] or ""), str(fields[3] or ""))

    def idempotency_digest(self) -> str:
        return hashlib.sha256(self.custom_id.encode()).hexdigest()[:32]


def batch_line(
    ref: BatchRef,
    job_id: str,
    status: str,
    result: JobResult | None = None,
    error: str | None = None,
    *,
    code: str | None = None,
) -> tuple[bool, str]:
    """``(succeeded?, line)``: the one place a batch job's output or error line is built."""
    return openai_format.batch_line(
        ref.custom_id, ref.url, ref.model, job_id, status, result, error, code=code
    )


@dataclass(frozen=True)
class Lease:
    """A worker's right to run one job, valid while ``fence`` is the job's current fence."""

    job_id: str
    fence: int
    consumer: str
    priority: Priority
    entry_id: str
    request: JobRequest
    deliveries: int
    #: Set for a job of an OpenAI batch (from the job record's server-owned fields).
    batch: BatchRef | None = None
    #: The job's idempotency key (full key name, from the record's ``idem_key``), ``None`` for
    #: none: the final write expires it and, like every script, declares it.
    idem_key: str | None = None
    #: When the job was submitted (the record's ``created_at``, Redis clock), if known.
    created_at: float | None = None


@dataclass(frozen=True)
class Progress:
    """New output of one running job since the last update (for completion ``index``)."""

    lease: Lease
    tokens_generated: int
    delta_text: str = ""
    delta_token_ids: Sequence[int] = ()
    index: int = 0
    #: The completion's tokens + characters published once this delta is (0: unchecked). A
    #: delta whose end its lease already wrote is skipped: a resent pipeline repeats nothing.
    end: int = 0


@dataclass(frozen=True)
class Finish:
    """A running job's final write: ``succeeded`` with a result, ``failed`` with a reason, or
    ``cancelled`` (after a cancel request, optionally with the partial result)."""

    lease: Lease
    status: FinalStatus
    result: JobResult | None = None
    error: str | None = None


def batch_keys(keys: Keys, batch_id: str) -> tuple[str, str, str, str]:
    """A batch's hash, output-line list, error-line list and set of counted job ids."""
    return (
        keys.batch(batch_id),
        keys.batch_output(batch_id),
        keys.batch_errors(batch_id),
        keys.batch_counted(batch_id),
    )


@dataclass(frozen=True)
class LineAdd:
    """One batch line to add outside a worker's final write (see ``batch_line.lua``)."""

    job_id: str
    ref: BatchRef
    ok: bool
    line: str
    allow_missing: bool = False
    allow_running: bool = False


@dataclass(frozen=True)
class WriteError:
    """A write of one job that Redis refused with an error (not a lost lease)."""

    job_id: str
    message: str
    #: The refused final write, or ``None`` for a progress update.
    finish: Finish | None = None


@dataclass
class StepResult:
    """What :meth:`JobStore.commit_step` reports back to the worker loop."""

    #: Job ids whose progress or final write was refused: the lease is lost, drop the sequence.
    lost: list[str] = field(default_factory=list)
    #: (job id, fence) of every refused write: a caller that may hold a newer lease of the same
    #: job by then (written on another thread) drops the job only if the fence is its own.
    refused: list[tuple[str, int]] = field(default_factory=list)
    #: Job ids a client asked to cancel (drained from this worker's cancel set).
    cancels: set[str] = field(default_factory=set)
    #: Writes Redis answered with an error (e.g. a key of the wrong type): the job cannot be
    #: written as asked; the worker fails it (or retries without its batch line) and goes on.
    errors: list[WriteError] = field(default_factory=list)
    #: The status of every final write Redis took (not refused, no error): what the worker
    #: counts as finished.
    finished: list[str] = field(default_factory=list)
    #: Per job whose progress was written: whether a reader follows its events (its watch key
    #: is set), so that the worker writes its progress at the streaming pace.
    watched: dict[str, bool] = field(default_factory=dict)


@dataclass
class ClaimStats:
    """Counters of what claims saw besides leases (for metrics and tests)."""

    skipped: int = 0
    dead_lettered: int = 0


#: A delivered stream entry: (stream key, entry id, job id or None if the entry was deleted).
Entry = tuple[str, str, str | None]


def job_of(fields: Any) -> str | None:
    return fields.get("job") if fields else None


def flatten_entries(reply: Any) -> list[Entry]:
    """An XREADGROUP reply (RESP2 list or RESP3 dict) -> entries."""
    out: list[Entry] = []
    for stream, entries in stream_entries(reply):
        out += [(stream, entry_id, job_of(fields)) for entry_id, fields in entries]
    return out
