"""The OpenAI file and batch objects, their statuses, and the limits and defaults of the batch
store.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.settings import MODELS

#: Largest uploaded file (it lives in Redis memory). Generated files have no cap.
DEFAULT_MAX_FILE_BYTES = 64 * 1024 * 1024
#: Jobs per pipelined enqueue round trip.
ENQUEUE_CHUNK = 2000
#: Lines per chunk of a generated file (one LRANGE and one RPUSH each).
FILE_CHUNK_LINES = 1000
#: Entries read per round trip when a file listing is filtered by tenant (others' are skipped).
LIST_SCAN_WINDOW = 1000
#: Environment variable listing served models (comma-separated); empty accepts any model.
MODELS_ENV = MODELS.name
#: How often ``finalize_ready`` reconciles an in-progress batch whose counts are short (s).
DEFAULT_RECONCILE_EVERY_S = 30.0
#: How long files and finished batches are kept by default (OpenAI's default for batch files).
DEFAULT_FILE_TTL_S = 30 * 24 * 3600
#: ``expires_after`` / ``output_expires_after`` bounds (OpenAI's: one hour to 30 days).
MIN_TTL_S, MAX_TTL_S = 3600, 30 * 24 * 3600
#: Tries before a batch whose finalisation keeps failing is failed, and the first backoff (s).
DEFAULT_FINALIZE_ATTEMPTS = 5
DEFAULT_FINALIZE_BACKOFF_S = 2.0

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
FINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})


def _new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}" if kind == "file" else f"{kind}_{uuid.uuid4().hex}"


def parse_window(window: str) -> int:
    """A completion window (``24h``; also ``90m``, ``30s``) in seconds."""
    m = re.fullmatch(r"(\d+)([smh])", window)
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"completion_window must look like '24h', got {window!r}")
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


class FileObject(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None = None


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]] = Field(default_factory=list)


class Batch(BaseModel):
    """The OpenAI batch object."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


def check_ttl(seconds: int, what: str = "expires_after") -> int:
    """An ``expires_after`` / ``output_expires_after`` duration, checked against OpenAI's bounds."""
    if not MIN_TTL_S <= seconds <= MAX_TTL_S:
        raise ValueError(f"{what}.seconds must be between {MIN_TTL_S} and {MAX_TTL_S}")
    return seconds


def _known_models_from_env() -> list[str]:
    return [m.strip() for m in MODELS.text().split(",") if m.strip()]
