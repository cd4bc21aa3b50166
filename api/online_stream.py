"""The server-sent events of a streamed online request, in OpenAI's chunk format.

Chat: one chunk with every choice's ``role`` first; then one chunk per text delta of the job's
events stream; when a job ends, a chunk with each of its choices' ``finish_reason``; a chunk with
the ``usage`` (no choices) when ``stream_options.include_usage``; then ``data: [DONE]``.
Completions: the same without the role chunk. A job that fails sends ``data: {"error": ...}``
(OpenAI's client raises it) and then ``[DONE]``.

A ``restart`` event (the job's worker died and another started it over) does not repeat text the
client has: the new run's text is compared with what was shown and only what goes beyond it is
sent (greedy and seeded runs repeat themselves); if it differs, the stream ends with an error.
The generator's end, however it comes (the client went away: the server closes it), runs the
request's :class:`~api.openai_online.Release`: the seat is freed and jobs not ended are cancelled.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from api.errors import ApiError, error_body
from api.state import AppState
from pagedserve.events import Gone, Idle, follow_events
from pagedserve.openai_input import CHAT_URL
from pagedserve.openai_output import chunk_choice, response_id, stream_chunk, usage
from pagedserve.schemas import JobResult, JobStatus

if TYPE_CHECKING:
    from api.openai_online import OnlineCall, Release

DONE = "data: [DONE]\n\n"
KEEP_ALIVE = ": keep-alive\n\n"

Chunk = Callable[..., str]


def sse_data(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


#: A waiting (non-streamed) call's longest blocking read: how soon a hang-up is noticed.
WAIT_SLICE_MS = 100


def follow_job(state: AppState, call: OnlineCall, job_id: str, watch: bool = True) -> Iterator[Any]:
    """The job's events (:func:`pagedserve.events.follow_events`) until the call's deadline,
    or until the client went away (then the request's release cancels the job); ``watch``:
    the deltas are streamed to the client (the worker writes them at the streaming pace).
    Without it the job's deltas come only every half second or so, so the reads block for at
    most :data:`WAIT_SLICE_MS`: a client that hangs up is still noticed (and its job
    cancelled) within that."""
    block = state.config.sse_block_ms if watch else min(state.config.sse_block_ms, WAIT_SLICE_MS)
    return follow_events(
        state.store,
        job_id,
        count=256,
        block_ms=lambda: block,
        keep_going=lambda: time.monotonic() < call.deadline and not call.gone(),
        watch=watch,
    )


class Diverged(Exception):
    """A restarted run produced text other than what the client was already sent."""


@dataclass
class ChoiceText:
    """What one choice has shown; after a restart, the new run's text while it catches up."""

    shown: str = ""
    redo: str | None = None

    def restart(self) -> None:
        self.redo = ""

    def feed(self, text: str) -> str:
        """The part of ``text`` (a delta) to send."""
        if self.redo is None:
            self.shown += text
            return text
        self.redo += text
        if len(self.redo) <= len(self.shown):
            if not self.shown.startswith(self.redo):
                raise Diverged
            return ""
        if not self.redo.startswith(self.shown):
            raise Diverged
        new, self.shown, self.redo = self.redo[len(self.shown) :], self.redo, None
        return new


def _error(e: ApiError) -> str:
    return sse_data(error_body(e.status, e.message, e.code, e.param))


def _follow(
    state: AppState, call: OnlineCall, job_id: str, base: int, chunk: Chunk
) -> Generator[str, None, dict[int, ChoiceText]]:
    """Chunks of one job's deltas until its end; returns each choice's shown text."""
    texts: dict[int, ChoiceText] = {}
    for item in follow_job(state, call, job_id):
        if isinstance(item, Idle):
            yield KEEP_ALIVE
        elif isinstance(item, Gone) or item.type == "end":
            break
        elif item.type == "restart":
            for t in texts.values():
                t.restart()
        elif item.text:
            new = texts.setdefault(item.index, ChoiceText()).feed(item.text)
            if new:
                yield chunk([chunk_choice(call.url, base + item.index, new)])
    return texts


def _job(
    state: AppState, call: OnlineCall, p: int, job_id: str, chunk: Chunk
) -> Generator[str, None, JobResult]:
    """Chunks of job ``p`` (its deltas, then its finish reasons); returns its result or raises
    the ApiError of a job that did not succeed."""
    from api.openai_online import job_error

    base = p * call.n
    texts = yield from _follow(state, call, job_id, base, chunk)
    rec = state.store.get(job_id)
    if rec is not None and not rec.status.terminal:
        raise ApiError(504, f"no answer within {state.config.online_timeout_s} s", "timeout")
    if rec is None or rec.status != JobStatus.SUCCEEDED or rec.result is None:
        raise job_error(rec, job_id)
    finals = []
    for c in sorted(rec.result.completions, key=lambda c: c.index):
        t = texts.get(c.index, ChoiceText())
        if t.redo is None and len(c.text) > len(t.shown) and c.text.startswith(t.shown):
            # Deltas trimmed before they were read (a capped stream): send the rest now.
            yield chunk([chunk_choice(call.url, base + c.index, c.text[len(t.shown) :])])
        finals.append(chunk_choice(call.url, base + c.index, None, finish=c.finish_reason))
    yield chunk(finals)
    return rec.result


def sse_answer(state: AppState, call: OnlineCall, release: Release) -> Iterator[str]:
    rid = response_id(call.url, call.job_ids[0])

    def chunk(choices: list[dict[str, Any]], usage_body: dict[str, Any] | None = None) -> str:
        body = stream_chunk(call.url, rid, call.model, call.created, choices, usage_body)
        return sse_data(body)

    try:
        if call.url == CHAT_URL:
            n = len(call.job_ids) * call.n
            yield chunk([chunk_choice(CHAT_URL, i, "", role=True) for i in range(n)])
        results = []
        for p, job_id in enumerate(call.job_ids):
            results.append((yield from _job(state, call, p, job_id, chunk)))
            release.ended.add(job_id)
        if call.include_usage:
            yield chunk([], usage(results))
    except Diverged:
        yield _error(ApiError(500, "the job restarted and produced other text", "job_restarted"))
    except ApiError as e:
        yield _error(e)
    finally:
        release()
    yield DONE
