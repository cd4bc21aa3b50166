"""``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI's online endpoints,
served through the queue.

Each request becomes one job (one per prompt of a completions request with a list of prompts)
in the same Redis queue as ``POST /v1/jobs``, through the same enqueue path (tenant, limits,
context check), at ``interactive`` priority unless the body's ``priority`` says otherwise. The
body is converted by the batch path's own function (:func:`pagedserve.openai_input.body_requests`)
and the answer built by :mod:`pagedserve.openai_output`; the handler follows the job's events
stream (:func:`pagedserve.events.follow_events`). ``stream: true`` answers with server-sent
events (:mod:`api.online_stream`).

A request first takes a *seat* (``online_seats`` per API process, see
:class:`api.config.ApiConfig`): each open request holds a server thread, and the seats stay fewer
than the threads so that status endpoints are never starved. No seat within
``online_seat_wait_s``: 429 with ``Retry-After``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flask import Blueprint, Response, request, stream_with_context
from pydantic import ValidationError

from api.errors import ApiError, describe_validation, json_body
from api.jobs import enqueue_checked
from api.models_route import require_model
from api.online_stream import follow_job
from api.peer import peer_gone
from api.state import AppState, get_state
from pagedserve.events import Gone
from pagedserve.openai_input import CHAT_URL, COMPLETIONS_URL, body_requests
from pagedserve.openai_output import response_body
from pagedserve.schemas import DeltaEvent, JobRecord, JobRequest, JobStatus

bp = Blueprint("openai_online", __name__)

SEATS = "online_seats"
_seats_lock = threading.Lock()


@dataclass
class OnlineCall:
    """One accepted online request: its jobs (in prompt order) and how to answer."""

    url: str
    model: str
    job_ids: list[str]
    n: int
    created: int
    deadline: float
    include_usage: bool = False
    #: True once the client closed its connection (:func:`api.peer.peer_gone`).
    gone: Callable[[], bool] = field(default=lambda: False, repr=False)


def seats(state: AppState) -> threading.BoundedSemaphore:
    with _seats_lock:
        sem = state.extras.get(SEATS)
        if sem is None:
            sem = state.extras[SEATS] = threading.BoundedSemaphore(state.config.online_seats)
        return sem


def take_seat(state: AppState) -> threading.BoundedSemaphore:
    """A seat for one online request (release it when the answer ends), or a 429."""
    sem = seats(state)
    if not sem.acquire(timeout=max(0.0, state.config.online_seat_wait_s)):
        raise ApiError(
            429,
            f"all {state.config.online_seats} online seats of this API process are taken; "
            "retry later",
            "server_busy",
            headers={"Retry-After": str(max(1, state.config.online_retry_after_s))},
        )
    return sem


def _stream_options(body: Mapping[str, Any]) -> bool:
    """``include_usage`` of ``stream_options`` (400 when given without ``stream``)."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not body.get("stream"):
        raise ApiError(
            400, "'stream_options' is only allowed with 'stream': true", None, "stream_options"
        )
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise ApiError(400, "'stream_options' takes only 'include_usage'", None, "stream_options")
    usage = opts.get("include_usage", False)
    if type(usage) is not bool:
        raise ApiError(
            400, "'stream_options.include_usage' must be a boolean", None, "stream_options"
        )
    return usage


def convert(url: str, body: Mapping[str, Any]) -> list[JobRequest]:
    """The body's jobs, or a 400 naming what is wrong (OpenAI answers bad parameters with 400)."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ApiError(400, "'model' must be a non-empty string", "invalid_request_error", "model")
    if body.get("stream") is not None and type(body["stream"]) is not bool:
        raise ApiError(400, "'stream' must be a boolean", "invalid_request_error", "stream")
    try:
        reqs = body_requests(url, body, online=True)
    except ValidationError as e:
        message, param = describe_validation(e)
        # The body's names, not the job's: "temperature", not "params.temperature".
        message = message.replace(": params.", ": ").replace("; params.", "; ")
        param = param.removeprefix("params.") if param else None
        raise ApiError(400, message, "invalid_request_error", param) from None
    except ValueError as e:
        raise ApiError(400, str(e), "invalid_request_error") from None
    if body.get("stream") and any(r.params.logprobs is not None for r in reqs):
        raise ApiError(400, "'logprobs' with 'stream' is not supported", None, "logprobs")
    return reqs


def _accept(url: str) -> tuple[AppState, OnlineCall, list[JobRequest], bool]:
    body = json_body(request)
    reqs = convert(url, body)
    include_usage = _stream_options(body)
    state = get_state()
    require_model(state, body["model"])
    call = OnlineCall(
        url=url,
        model=body["model"],
        job_ids=[],
        n=reqs[0].params.n,
        created=int(time.time()),
        deadline=time.monotonic() + state.config.online_timeout_s,
        include_usage=include_usage,
        gone=peer_gone(request.environ),
    )
    return state, call, reqs, bool(body.get("stream"))


def _enqueue(state: AppState, call: OnlineCall, reqs: list[JobRequest]) -> None:
    """Enqueue every job; when one is refused, cancel those already queued."""
    try:
        for req in reqs:
            call.job_ids.append(enqueue_checked(state, req)[0])
    except BaseException:
        cancel_jobs(state, call.job_ids)
        raise


def cancel_jobs(state: AppState, job_ids: list[str]) -> None:
    if job_ids:
        state.store.cancel_many(job_ids)


def wait_record(state: AppState, call: OnlineCall, job_id: str) -> JobRecord | None:
    """The job's record once it ended, or as it stands when the deadline passed (``None``: it
    expired or vanished)."""
    for item in follow_job(state, call, job_id, watch=False):  # (the answer is the record)
        if isinstance(item, Gone) or (isinstance(item, DeltaEvent) and item.type == "end"):
            break
    return state.store.get(job_id)


def job_error(rec: JobRecord | None, job_id: str) -> ApiError:
    """The error answer of a job that did not succeed."""
    if rec is None:
        return ApiError(404, f"job {job_id!r} expired before it ended", "job_not_found")
    reason = rec.error or rec.status.value
    if rec.status == JobStatus.FAILED and reason.startswith("rejected:"):
        return ApiError(400, reason.removeprefix("rejected:").strip(), "invalid_request_error")
    if rec.status in (JobStatus.CANCELLED, JobStatus.CANCELLING):
        return ApiError(409, f"job {job_id} was cancelled", "job_cancelled")
    return ApiError(500, f"job {job_id} failed: {reason}", "job_failed")


def _answer(state: AppState, call: OnlineCall) -> dict[str, Any]:
    results = []
    for jid in call.job_ids:
        rec = wait_record(state, call, jid)
        if call.gone():  # nobody to answer: the release cancels the jobs
            raise ApiError(499, "the client closed the connection", "client_closed")
        if rec is not None and not rec.status.terminal:
            raise ApiError(504, f"no answer within {state.config.online_timeout_s} s", "timeout")
        if rec is None or rec.status != JobStatus.SUCCEEDED or rec.result is None:
            raise job_error(rec, jid)
        results.append(rec.result)
    return response_body(call.url, call.model, call.job_ids[0], results, call.created)


class Release:
    """Ends an online request once, however its answer ends (finished, failed, the client gone,
    the response never iterated): gives the seat back and cancels the jobs not yet ended."""

    def __init__(self, state: AppState, call: OnlineCall, sem: threading.BoundedSemaphore):
        self.state, self.call, self.sem = state, call, sem
        self.ended: set[str] = set()
        self.done = False
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
        try:
            cancel_jobs(self.state, [j for j in self.call.job_ids if j not in self.ended])
        finally:
            self.sem.release()


def serve(url: str) -> Response | dict[str, Any]:
    state, call, reqs, stream = _accept(url)
    release = Release(state, call, take_seat(state))
    handed_over = False
    try:
        _enqueue(state, call, reqs)
        if stream:
            from api.online_stream import sse_answer

            resp = Response(
                stream_with_context(sse_answer(state, call, release)),
                mimetype="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
            resp.call_on_close(release)  # also when the client left before the first chunk
            handed_over = True
            return resp
        body = _answer(state, call)
        release.ended.update(call.job_ids)
        return body
    finally:
        if not handed_over:
            release()


@bp.post(CHAT_URL)
def chat_completions() -> Response | dict[str, Any]:
    return serve(CHAT_URL)


@bp.post(COMPLETIONS_URL)
def completions() -> Response | dict[str, Any]:
    return serve(COMPLETIONS_URL)
