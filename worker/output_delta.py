"""Request outputs sent as increments between the engine process and the service loop.

Why: an engine output (:class:`~worker.outputs.RequestOutput`) is cumulative: every completion's
tokens, text and logprobs so far, and the prompt's token ids. Under ``--engine-process`` the
child pickles each output it reports; a progress flush snapshots every running job (256 at
``bench.service --preset tiny``, every 50 ms), so the child pickled the same prompts and tokens
over and over: about half the time it spent reporting (a throwaway timer: 3-4 ms per flush).

:class:`DeltaEncoder` (the child) remembers how much of each request's output it has sent and
sends the rest: the prompt once, then only what each completion gained. :func:`merge` (the loop)
rebuilds the cumulative output from the previous one it holds, so the loop sees exactly the
outputs the engine made. The encoding keeps no assumption about the engine's own increments
(``num_new_tokens`` / ``num_new_chars`` travel as they are): what is sent is cut at what was
sent before, and a value that did not grow from it is sent whole.
"""

from __future__ import annotations

from typing import Any

from worker.outputs import CompletionOutput, RequestOutput

#: One completion's increments: index, then (start, tail) of its token ids, text and logprobs
#: (logprobs None when the request asked for none), finish reason, num_new_tokens, num_new_chars.
CompletionDelta = tuple[int, int, list[int], int, str, int, Any, str | None, int, int]
#: A request's: request id, prompt token ids and prompt (None after the first), cached tokens,
#: finished, error, completions.
OutputDelta = tuple[str, Any, Any, int, bool, Any, list[CompletionDelta]]


def _cut(value: Any, sent: int) -> tuple[int, Any]:
    """Where the unsent part starts and the part itself (all of it if the value shrank)."""
    start = sent if len(value) >= sent else 0
    return start, value[start:]


class DeltaEncoder:
    """The child's side: what each live request's outputs have carried so far."""

    def __init__(self) -> None:
        # request id -> completion index -> (token ids, chars, logprobs) sent
        self._sent: dict[str, dict[int, tuple[int, int, int]]] = {}

    def encode(self, out: RequestOutput) -> OutputDelta:
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, {})
        comps: list[CompletionDelta] = []
        for c in out.outputs:
            n_tok, n_chr, n_lp = sent.get(c.index, (0, 0, 0))
            t0, toks = _cut(c.token_ids, n_tok)
            x0, text = _cut(c.text, n_chr)
            if c.logprobs is None:
                l0, lps, n_lp_now = 0, None, 0
            else:
                (l0, lps), n_lp_now = _cut(c.logprobs, n_lp), len(c.logprobs)
            sent[c.index] = (len(c.token_ids), len(c.text), n_lp_now)
            comps.append((c.index, t0, toks, x0, text, l0, lps, c.finish_reason,
                          c.num_new_tokens, c.num_new_chars))  # fmt: skip
        if out.finished:
            del self._sent[out.request_id]
        return (out.request_id, out.prompt_token_ids if first else None,
                out.prompt if first else None, out.num_cached_tokens, out.finished, out.error,
                comps)  # fmt: skip

    def forget(self, request_id: str) -> None:
        """The request left without a finished output (aborted)."""
        self._sent.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._sent)


def merge(prev: RequestOutput | None, delta: OutputDelta) -> RequestOutput:
    """The loop's side: the output ``delta`` encodes, given the request's previous output
    (None before its first). Builds new objects: ``prev`` is left as it was."""
    rid, prompt_ids, prompt, cached, finished, error, comps = delta
    if prev is not None:
        prompt_ids, prompt = prev.prompt_token_ids, prev.prompt
        before = {c.index: c for c in prev.outputs}
    else:
        before = {}
    outs = []
    for index, t0, toks, x0, text, l0, lps, reason, new_toks, new_chars in comps:
        old = before.get(index)
        if old is None:
            outs.append(CompletionOutput(index, toks, text, reason, lps, new_toks, new_chars))
            continue
        logprobs = None
        if lps is not None:
            logprobs = (old.logprobs or [])[:l0] + lps
        outs.append(CompletionOutput(
            index, old.token_ids[:t0] + toks, old.text[:x0] + text, reason, logprobs,
            new_toks, new_chars,
        ))  # fmt: skip
    return RequestOutput(rid, prompt_ids, outs, cached, finished, error, prompt)
