"""What the service loop keeps for one running job: its lease, its flush timer and a cursor of
what it has published. The job's tokens and text are the engine's (its latest
:class:`~worker.outputs.RequestOutput`); the progress deltas and the results are derived from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.schemas import Completion, JobResult
from pagedserve.schemas import TokenLogprob as WireLogprob
from pagedserve.store import Lease, Progress
from worker.outputs import RequestOutput


@dataclass
class JobState:
    lease: Lease
    created_at: float  # Redis clock (seconds)
    max_tokens: int | None
    #: The engine's latest output for this job (None until its first step with a change).
    latest: RequestOutput | None = None
    #: Per completion index: (tokens, characters) already published as progress.
    published: dict[int, tuple[int, int]] = field(default_factory=dict)
    first_token_seen: bool = False
    #: A reader follows the job's events (its last progress write said so): its progress goes
    #: at the streaming pace (``progress_interval_ms``), else at ``bulk_progress_interval_ms``.
    watched: bool = False

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.latest.outputs) if self.latest else 0

    def observe(self, out: RequestOutput) -> None:
        self.latest = out

    def replay(self) -> None:
        """Make everything generated so far pending again (after a ``restart`` event told
        followers to discard what they had, while this run goes on)."""
        self.published.clear()

    def take_progress(self) -> list[Progress]:
        """The unpublished increments, one :class:`Progress` per completion with anything new
        (by index); marks them sent. Called for every running job at each flush: one pass."""
        if self.latest is None:
            return []
        outputs = self.latest.outputs
        if len(outputs) > 1:
            outputs = sorted(outputs, key=lambda c: c.index)
        total = sum(len(c.token_ids) for c in outputs)
        out: list[Progress] = []
        for c in outputs:
            ntok, nchar = len(c.token_ids), len(c.text)
            toks, chars = self.published.get(c.index, (0, 0))
            if ntok > toks or nchar > chars:
                ids = tuple(c.token_ids[toks:])
                text = c.text[chars:]
                out.append(Progress(self.lease, total, text, ids, c.index, ntok + nchar))
                self.published[c.index] = (ntok, nchar)
        return out


def result_of(out: RequestOutput) -> JobResult:
    """The wire result of a finished engine request."""
    comps = []
    for c in out.outputs:
        logprobs = None
        if c.logprobs is not None:
            logprobs = [
                WireLogprob(token_id=lp.token_id, logprob=lp.logprob, top_logprobs=dict(lp.top))
                for lp in c.logprobs
            ]
        reason = c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "stop"
        comps.append(
            Completion(
                index=c.index,
                text=c.text,
                token_ids=list(c.token_ids),
                finish_reason=reason,  # type: ignore[arg-type]
                logprobs=logprobs,
            )
        )
    return JobResult(
        completions=comps,
        prompt_tokens=len(out.prompt_token_ids),
        cached_prompt_tokens=out.num_cached_tokens,
        completion_tokens=sum(len(c.token_ids) for c in out.outputs),
    )


def partial_result(out: RequestOutput | None) -> JobResult:
    """The result of a cancelled job: the completions that generated anything, as "abort" (and,
    as before the engine output was the source, no prompt token count)."""
    comps = [
        Completion(index=c.index, text=c.text, token_ids=list(c.token_ids), finish_reason="abort")
        for c in sorted(out.outputs, key=lambda c: c.index)
        if c.token_ids
    ] if out is not None else []  # fmt: skip
    return JobResult(
        completions=comps,
        prompt_tokens=0,
        completion_tokens=sum(len(c.token_ids) for c in comps),
    )
