"""The job contract: what a client submits, what the store keeps, what a worker writes back.

Everything here is plain JSON on the wire and in Redis (never pickle).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from pagedserve.jsonsafe import check_text
from pagedserve.keys import Priority
from pagedserve.params import SamplingParams, as_ints

#: Largest ``metadata`` object accepted, measured as compact JSON.
MAX_METADATA_BYTES = 16 * 1024
#: OpenAI's metadata limits: at most 16 pairs, keys up to 64 characters, string values up to 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
#: Largest prompt text (or sum of chat message contents), in characters, refused outright.
MAX_PROMPT_CHARS = 256 * 1024

#: Flat string-to-string metadata with OpenAI's limits (also the batch object's ``metadata``).
Metadata = Annotated[
    dict[
        Annotated[str, StringConstraints(min_length=1, max_length=MAX_METADATA_KEY)],
        Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE)],
    ],
    Field(max_length=MAX_METADATA_PAIRS),
]


def check_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    """Every key and value encodes as UTF-8 (pydantic checks types and lengths)."""
    for k, val in (v or {}).items():
        check_text(k, "a metadata key")
        check_text(val, f"metadata[{k!r}]")
    return v


#: Largest idempotency key (it becomes part of a Redis key name).
MAX_IDEMPOTENCY_KEY = 256


class JobStatus(StrEnum):
    """Life cycle: queued -> running -> succeeded | failed; cancel: cancelling -> cancelled."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    #: Only an answer (``cancel`` / ``status`` of an unknown or expired id), never stored.
    NOT_FOUND = "not_found"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})


class ChatMessage(BaseModel):
    """One chat turn; the worker renders a list of them with the model's chat template."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str

    @field_validator("content")
    @classmethod
    def _valid_text(cls, v: str) -> str:
        return check_text(v, "message content")


class JobRequest(BaseModel):
    """One generation request: exactly one of ``prompt`` (text or token ids) or ``messages``.

    Strict types (``"16"`` is not an int, ``true`` is not one either); ``metadata`` is flat
    strings within OpenAI's limits; prompt text is capped at :data:`MAX_PROMPT_CHARS`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    params: SamplingParams = Field(default_factory=SamplingParams)
    priority: Priority = "interactive"
    idempotency_key: str | None = Field(None, min_length=1, max_length=MAX_IDEMPOTENCY_KEY)
    metadata: Metadata | None = None
    model: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("prompt", mode="before")
    @classmethod
    def _integral_ids(cls, v: object) -> object:
        return as_ints(v) if isinstance(v, (list, tuple)) else v

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: str | list[int] | None) -> str | list[int] | None:
        if v is None:
            return v
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and min(v) < 0:
            raise ValueError("prompt token ids must be non-negative")
        if isinstance(v, str):
            if len(v) > MAX_PROMPT_CHARS:
                raise ValueError(f"prompt is {len(v)} characters; the limit is {MAX_PROMPT_CHARS}")
            check_text(v, "prompt")
        return v

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, v: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if v is not None and len(v) == 0:
            raise ValueError("messages must contain at least one message")
        size = sum(len(m.content) for m in v or ())
        if size > MAX_PROMPT_CHARS:
            raise ValueError(f"messages hold {size} characters; the limit is {MAX_PROMPT_CHARS}")
        return v

    @field_validator("idempotency_key", "model")
    @classmethod
    def _valid_name(cls, v: str | None) -> str | None:
        return v if v is None else check_text(v, "a name")

    @field_validator("metadata")
    @classmethod
    def _metadata_small(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        check_metadata(v)
        try:
            size = len(json.dumps(v, separators=(",", ":")).encode())
        except (TypeError, ValueError) as e:
            raise ValueError(f"metadata must be JSON-serializable: {e}") from e
        if size > MAX_METADATA_BYTES:
            raise ValueError(
                f"metadata is {size} bytes of JSON; the limit is {MAX_METADATA_BYTES} bytes"
            )
        return v

    @model_validator(mode="after")
    def _exactly_one_input(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class TokenLogprob(BaseModel):
    """The sampled token's log-probability and the top alternatives at that position."""

    model_config = ConfigDict(extra="forbid")

    token_id: int
    logprob: float
    top_logprobs: dict[int, float] = Field(default_factory=dict)


class Completion(BaseModel):
    """One of the ``n`` completions of a request."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)
    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length", "abort"]
    logprobs: list[TokenLogprob] | None = None


class JobResult(BaseModel):
    """What a worker writes for a succeeded job."""

    model_config = ConfigDict(extra="forbid")

    completions: list[Completion]
    prompt_tokens: int = Field(ge=0)
    cached_prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(ge=0)


class JobRecord(BaseModel):
    """A job as the store holds it (times are Unix seconds from the Redis server's clock)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    status: JobStatus
    request: JobRequest
    priority: Priority = "interactive"
    created_at: float
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    tokens_generated: int = 0
    worker: str | None = None
    deliveries: int = 0
    result: JobResult | None = None
    error: str | None = None
    #: The tenant that owns the job (written by the server, never taken from the request).
    tenant: str | None = None


class DeltaEvent(BaseModel):
    """One entry of a job's events stream, as :meth:`Client.stream` yields it.

    ``type`` is ``delta`` (new text/tokens for completion ``index``), ``restart`` (the job went
    back to the queue: discard what was streamed so far) or ``end`` (``status`` is final).
    """

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["delta", "restart", "end"]
    index: int = 0
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    tokens_generated: int = 0
    status: JobStatus | None = None

    @classmethod
    def from_stream(cls, entry_id: str, f: Mapping[str, str]) -> DeltaEvent:
        """Decode one events-stream entry (its field names are the store's)."""
        return cls(
            id=entry_id,
            type=f["type"],  # type: ignore[arg-type]
            index=int(f.get("index", 0)),
            text=f.get("text", ""),
            token_ids=json.loads(f["token_ids"]) if f.get("token_ids") else [],
            tokens_generated=int(f.get("tokens", 0)),
            status=JobStatus(f["status"]) if f.get("status") else None,
        )


#: Stands in for a leased job's request that does not parse; such a job is failed at once.
UNPARSABLE_REQUEST = JobRequest(prompt=[0])


def short_validation_error(e: ValidationError, limit: int = 5) -> str:
    """A one-line summary of a pydantic error: ``field: message; ...``."""
    parts = []
    for err in e.errors()[:limit]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "request"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = f" (+{e.error_count() - limit} more)" if e.error_count() > limit else ""
    return "; ".join(parts) + more
