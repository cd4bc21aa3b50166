"""OpenAI batch JSONL input: each line -> :class:`JobRequest`, or a :class:`LineError`.

Input line: ``{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}``. Format errors (bad JSON, missing or duplicate ``custom_id``, wrong method or url)
fail the whole batch; request errors (unknown model, bad parameters) fail only that line, which
goes to the batch's error file.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from pagedserve import jsonsafe
from pagedserve.keys import Priority
from pagedserve.schemas import JobRequest

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS_URL, CHAT_URL)
Endpoint = Literal["/v1/completions", "/v1/chat/completions"]

#: Largest custom_id (OpenAI allows 64 characters; we are more lenient but bounded).
MAX_CUSTOM_ID = 512

#: Body keys accepted and ignored (no effect on generation here).
_IGNORED = frozenset({"user", "stream_options", "service_tier", "store", "metadata", "suffix"})
#: Body keys that map one to one onto :class:`SamplingParams`.
_DIRECT = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
)


class LineError(BaseModel):
    """What is wrong with one input line (``line`` is 1-based)."""

    model_config = ConfigDict(frozen=True)

    line: int
    custom_id: str | None = None
    code: str
    message: str
    #: A format error fails the whole batch; a request error fails only its line.
    fatal: bool = True

    def __str__(self) -> str:
        cid = f" (custom_id {self.custom_id!r})" if self.custom_id is not None else ""
        return f"line {self.line}{cid}: {self.code}: {self.message}"


class LineInvalid(ValueError):
    """Raised by :func:`parse_line`; carries the :class:`LineError`."""

    def __init__(self, error: LineError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class BatchLine:
    """A valid input line."""

    line: int
    custom_id: str
    url: str
    model: str
    request: JobRequest


@dataclass
class ParsedFile:
    lines: list[BatchLine] = field(default_factory=list)
    #: Request errors: those lines go to the error file, the others run.
    request_errors: list[LineError] = field(default_factory=list)
    #: Format errors: the batch fails.
    format_errors: list[LineError] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.lines) + len(self.request_errors)


# ----------------------------------------------------------------------------- input side
def _fail(line: int, cid: str | None, code: str, msg: str, *, fatal: bool = True) -> LineInvalid:
    return LineInvalid(LineError(line=line, custom_id=cid, code=code, message=msg, fatal=fatal))


def _envelope(text: str, line: int, endpoint: str | None) -> tuple[str, str, dict[str, Any]]:
    """Check the line's JSON envelope; returns (custom_id, url, body)."""
    try:
        obj = jsonsafe.loads(text)  # bounded nesting, no lone surrogates
    except jsonsafe.JsonInputError as e:
        raise _fail(line, None, e.code, e.message) from None
    if not isinstance(obj, dict):
        raise _fail(line, None, "invalid_json", "a line must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise _fail(line, None, "missing_custom_id", "'custom_id' must be a non-empty string")
    if len(cid) > MAX_CUSTOM_ID:
        raise _fail(line, None, "invalid_custom_id", f"'custom_id' exceeds {MAX_CUSTOM_ID} chars")
    if obj.get("method") != "POST":
        raise _fail(
            line, cid, "invalid_method", f"'method' must be 'POST', got {obj.get('method')!r}"
        )
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise _fail(line, cid, "invalid_url", f"'url' must be one of {ENDPOINTS}, got {url!r}")
    if endpoint is not None and url != endpoint:
        raise _fail(
            line, cid, "mismatched_url", f"'url' {url!r} differs from batch endpoint {endpoint!r}"
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _fail(line, cid, "invalid_body", "'body' must be a JSON object")
    extra = set(obj) - {"custom_id", "method", "url", "body"}
    if extra:
        raise _fail(line, cid, "invalid_line", f"unknown keys {sorted(extra)}")
    return cid, url, body


def _message_content(content: Any) -> str:
    """A chat message's content: a string, or a list of ``{"type": "text", "text"}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            ):
                raise ValueError("only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise ValueError("message content must be a string or a list of text parts")


def _params(url: str, body: Mapping[str, Any], *, online: bool = False) -> dict[str, Any]:
    """OpenAI body -> SamplingParams fields (raises ValueError with the reason). ``online``: an
    HTTP request (it may stream), not a batch line."""
    if body.get("stream") and not online:
        raise ValueError("'stream' is not supported in a batch")
    if body.get("echo"):
        raise ValueError("'echo' is not supported")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise ValueError("'best_of' other than n is not supported")
    p: dict[str, Any] = {k: body[k] for k in _DIRECT if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if url == COMPLETIONS_URL:
        p["max_tokens"] = 16 if max_tokens is None else max_tokens
        if body.get("logprobs") is not None:
            p["logprobs"] = body["logprobs"]
    else:
        p["max_tokens"] = max_tokens
        if body.get("logprobs"):
            p["logprobs"] = body.get("top_logprobs") or 0
    so = _response_format(body.get("response_format"))
    if body.get("structured_outputs") is not None:  # vLLM's extension, passed through
        if so is not None:
            raise ValueError("give either 'response_format' or 'structured_outputs', not both")
        so = body["structured_outputs"]
    if so is not None:
        p["structured_outputs"] = so
    return p


def _response_format(rf: Any) -> dict[str, Any] | None:
    """OpenAI ``response_format`` -> ``structured_outputs``: ``text`` (none), ``json_object``
    (any JSON object) or ``json_schema`` (``{"name", "schema", "strict"}``). The schema is
    enforced whether ``strict`` is true or not (constrained decoding cannot be partial)."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        if not isinstance(spec.get("strict", False), bool) or (
            spec.get("name") is not None and not isinstance(spec["name"], str)
        ):
            raise ValueError("response_format.json_schema: 'strict' is a bool, 'name' a string")
        return {"json": spec["schema"]}
    raise ValueError(
        f"response_format.type must be one of 'text', 'json_object', 'json_schema'; got {kind!r}"
    )


_KNOWN = frozenset(
    {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "logprobs"}
    | {"top_logprobs", "stream", "echo", "best_of", "response_format", "structured_outputs"}
    | {"priority", *_DIRECT}
)


def _priority(value: Any) -> Priority:
    """vLLM's ``priority`` (an int, lower runs earlier; default 0): 0 or less is
    ``interactive``, above 0 ``bulk``; our own names are taken as they are."""
    if value is None:
        return "interactive"
    if value in ("interactive", "bulk"):
        return value  # type: ignore[no-any-return]
    if type(value) is not int:
        raise ValueError("'priority' must be an integer (vLLM's) or 'interactive' / 'bulk'")
    return "interactive" if value <= 0 else "bulk"


def _prompts(body: Mapping[str, Any]) -> list[str | list[int]]:
    """A completions body's prompts: a string, token ids, or a list of either (one job each)."""
    if "messages" in body:
        raise ValueError("/v1/completions takes 'prompt', not 'messages'")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _ids(prompt)):
        return [prompt]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(x, str) or (isinstance(x, list) and _ids(x)) for x in prompt)
    ):
        return list(prompt)
    raise ValueError("'prompt' must be a string, a list of token ids, or a list of either")


def _ids(xs: list[Any]) -> bool:
    return all(type(t) is int for t in xs)


def _chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise ValueError("'messages' must be a list of {role, content}")
    out = []
    for m in msgs:
        if not isinstance(m, dict):
            raise ValueError("each message must be an object")
        out.append({"role": m.get("role"), "content": _message_content(m.get("content"))})
    return out


def body_requests(
    url: str,
    body: Mapping[str, Any],
    *,
    metadata: dict[str, Any] | None = None,
    online: bool = False,
) -> list[JobRequest]:
    """An OpenAI ``/v1/completions`` or ``/v1/chat/completions`` body -> its jobs: one, or one
    per prompt of a completions body with a list of prompts. The one conversion of batch lines
    (``online=False``: ``bulk`` priority, no streaming) and of the online endpoints (priority
    from the body, ``interactive`` by default). Raises ValueError (or pydantic's
    ValidationError) naming what is wrong; unknown body keys are named."""
    unknown = set(body) - _KNOWN - _IGNORED
    if unknown:
        raise ValueError(f"unsupported body parameters {sorted(unknown)}")
    fields: dict[str, Any] = {
        "params": _params(url, body, online=online),
        "priority": _priority(body.get("priority")) if online else "bulk",
        "model": body["model"],
        "metadata": metadata,
    }
    if url != COMPLETIONS_URL:
        return [JobRequest.model_validate({**fields, "messages": _chat_messages(body)})]
    return [JobRequest.model_validate({**fields, "prompt": p}) for p in _prompts(body)]


def _request(url: str, body: Mapping[str, Any], metadata: dict[str, Any]) -> JobRequest:
    reqs = body_requests(url, body, metadata=metadata)
    if len(reqs) != 1:
        raise ValueError("a batch line takes one prompt, not a list of them")
    return reqs[0]


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(parts)


def parse_line(
    text: str,
    line: int,
    *,
    endpoint: str | None = None,
    known_models: Collection[str] | None = None,
    seen_ids: set[str] | None = None,
    batch_id: str | None = None,
) -> BatchLine:
    """Validate one input line (``line`` is 1-based). Raises :class:`LineInvalid`.

    ``seen_ids`` collects custom_ids across calls (for the duplicate check); ``known_models``
    (when given and non-empty) restricts ``body.model``.
    """
    cid, url, body = _envelope(text, line, endpoint)
    if seen_ids is not None:
        if cid in seen_ids:
            raise _fail(line, cid, "duplicate_custom_id", f"custom_id {cid!r} is used twice")
        seen_ids.add(cid)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _fail(line, cid, "invalid_request", "'body.model' must be a string", fatal=False)
    if known_models and model not in known_models:
        msg = f"model {model!r} is not served; available: {sorted(known_models)}"
        raise _fail(line, cid, "model_not_found", msg, fatal=False)
    meta = {"batch_id": batch_id, "custom_id": cid, "url": url, "model": model}
    try:
        req = _request(url, body, {k: v for k, v in meta.items() if v is not None})
    except ValidationError as e:
        raise _fail(line, cid, "invalid_request", _validation_message(e), fatal=False) from None
    except ValueError as e:
        raise _fail(line, cid, "invalid_request", str(e), fatal=False) from None
    return BatchLine(line=line, custom_id=cid, url=url, model=model, request=req)


def parse_file(
    content: str,
    *,
    endpoint: str | None = None,
    known_models: Collection[str] | None = None,
    batch_id: str | None = None,
) -> ParsedFile:
    """Validate every non-blank line of a batch input file.

    Lines end at ``\n`` only (a ``\r`` before it is dropped): ``str.splitlines`` would also split
    on U+2028, U+2029, U+0085 and other characters that are valid inside JSON strings."""
    out = ParsedFile()
    seen: set[str] = set()
    for no, text in enumerate(content.split("\n"), start=1):
        text = text.removesuffix("\r")
        if not text.strip():
            continue
        try:
            out.lines.append(
                parse_line(
                    text,
                    no,
                    endpoint=endpoint,
                    known_models=known_models,
                    seen_ids=seen,
                    batch_id=batch_id,
                )
            )
        except LineInvalid as e:
            (out.format_errors if e.error.fatal else out.request_errors).append(e.error)
    if not out.lines and not out.request_errors and not out.format_errors:
        out.format_errors.append(
            LineError(line=0, code="empty_file", message="the input file has no requests")
        )
    return out


# ----------------------------------------------------------------------------- output side
