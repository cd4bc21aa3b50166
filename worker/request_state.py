"""One engine request's state, held once: its completions' cumulative tokens, text and logprobs,
and how much of them the previous step's output already reported (so that each step's
:class:`~worker.outputs.RequestOutput` derives its deltas rather than carrying a second copy)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.params import SamplingParams
from worker.detokenizer import IncrementalDetokenizer
from worker.outputs import CompletionOutput, RequestOutput
from worker.structured import GrammarState


@dataclass(slots=True)
class CompletionState:
    """One of a request's ``n`` completions. ``out`` is the cumulative output (the one copy);
    ``reported_tokens`` / ``reported_chars``: how much of it earlier step outputs held."""

    index: int
    detok: IncrementalDetokenizer | None
    generator: torch.Generator | None
    out: CompletionOutput
    seq_id: int | None = None
    reported_tokens: int = 0
    reported_chars: int = 0
    grammar: GrammarState | None = None  # its matcher, when the request is constrained

    def finish(self, reason: str) -> None:
        if self.detok is not None:
            self.detok.flush()
            self.out.text = self.detok.text
        self.out.finish_reason = reason

    def snapshot(self) -> CompletionOutput:
        """The completion as of now, with the increments since the last snapshot."""
        o = self.out
        if self.detok is not None and not o.finished:
            self.detok.sync()
            o.text = self.detok.text[: self.detok.emitted]
        snap = CompletionOutput(
            o.index, list(o.token_ids), o.text, o.finish_reason,
            list(o.logprobs) if o.logprobs is not None else None,
            num_new_tokens=len(o.token_ids) - self.reported_tokens,
            num_new_chars=len(o.text) - self.reported_chars,
        )  # fmt: skip
        self.reported_tokens, self.reported_chars = len(o.token_ids), len(o.text)
        return snap


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionState]
    arrival: float
    forked: bool = False  # n > 1: children created at the parent's first sample
    first_token_at: float | None = None
    num_cached_tokens: int = 0
    #: False: the engine's step reports this request only when ``report_due`` (its first token,
    #: a completion's end); :meth:`Engine.snapshot` gives its output in between.
    stream: bool = True
    report_due: bool = True  # cleared by each step output, set again when a completion ends
    #: Every token is the logits' argmax alone (:func:`~worker.sampler.plain_greedy`, no
    #: grammar): the engine samples a batch of such requests without per-row state.
    greedy: bool = False

    @property
    def finished(self) -> bool:
        return all(c.out.finish_reason is not None for c in self.completions)

    def output(self) -> RequestOutput:
        """This step's output: the cumulative state of every completion, deltas derived (since
        the previous output of this request)."""
        return RequestOutput(
            self.request_id,
            self.prompt_token_ids,
            [c.snapshot() for c in self.completions],
            self.num_cached_tokens,
            self.finished,
            prompt=self.prompt,
        )


def new_completion(
    index: int, prompt_ids: list[int], params: SamplingParams, tokenizer: object | None
) -> CompletionState:
    """``tokenizer`` None: the completion's text stays empty (none, or rendered elsewhere)."""
    detok = None
    if tokenizer is not None:
        stop = list(params.stop)
        detok = IncrementalDetokenizer(
            tokenizer, prompt_ids, stop, params.include_stop_str_in_output, lazy=not stop
        )
    gen = None
    if params.seed is not None and not params.greedy:
        gen = torch.Generator().manual_seed(params.seed + index)
    logprobs = [] if params.logprobs is not None else None
    return CompletionState(index, detok, gen, CompletionOutput(index, logprobs=logprobs))
