"""The text of engine outputs, rendered by whoever reads them rather than by the engine.

Why: a request without stop strings or a grammar needs no text while it generates; the engine
renders it only when its output is read (a lazy :class:`IncrementalDetokenizer`: at its first
token, at each progress snapshot, at its end). Under ``--engine-process`` that rendering ran on
the child's stepping thread, the worker's critical path: at ``bench.service --preset tiny`` its
syncs and flushes were ~1.6% of the child's CPU per round (a throwaway timer: 0.05 s of ~3.0 s,
against 0.03 s offline, where progress is not read). The loop's process reads every output
anyway, on the other core, with the same tokenizer (the class the child's ``AutoTokenizer``
chose): :class:`OutputText` renders there, from the token ids, making the same calls the
engine's detokenizer would have made at the same outputs, so the text is the same
(tests/test_output_text.py compares it with the engine's, output by output).

Torch-free: the worker's own process imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.params import SamplingParams
from worker.detokenizer import IncrementalDetokenizer
from worker.outputs import RequestOutput


def text_read_later(params: SamplingParams) -> bool:
    """Whether nothing in the engine needs a request's text as it generates: no stop strings
    (checked against the text at every token) and no grammar (whose last token the engine
    renders itself). Such text can be rendered by whoever reads the token ids
    (``Engine.add_request(render_text=False)`` and :class:`OutputText`)."""
    return not params.stop and params.structured_outputs is None


@dataclass(slots=True)
class _Completion:
    detok: IncrementalDetokenizer
    fed: int = 0  # token ids given to ``detok`` so far


class OutputText:
    """Renders the text of requests an engine left without it (``render_text=False``).

    :meth:`expect` a request when adding it; :meth:`render` each of its outputs, in the order
    the engine made them (its first token, snapshots, its end), with the output before it;
    :meth:`forget` one that left without a finished output (aborted)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, dict[int, _Completion]] = {}

    def expect(self, request_id: str) -> None:
        self._requests[request_id] = {}

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def render(self, prev: RequestOutput | None, out: RequestOutput) -> None:
        """Fill in ``out``'s text and ``num_new_chars`` (``out`` is changed in place; ``prev``:
        the request's output before it, None for its first). A finished output ends the
        request here."""
        comps = self._requests.get(out.request_id)
        if comps is None:
            return
        if out.finished:
            del self._requests[out.request_id]
        if out.error is not None:
            return
        before = {c.index: c.text for c in prev.outputs} if prev is not None else {}
        for c in out.outputs:
            st = comps.get(c.index)
            if st is None:
                st = comps[c.index] = _Completion(
                    IncrementalDetokenizer(self.tokenizer, out.prompt_token_ids, lazy=True)
                )
            # A completion that ended by "stop" without stop strings ended at a stop token
            # (EOS, stop_token_ids): kept in token_ids, never in the text (as in the engine).
            end = len(c.token_ids) - (c.finish_reason == "stop")
            if end > st.fed:
                st.detok.add(c.token_ids[st.fed : end])
                st.fed = end
            if c.finished:
                st.detok.flush()
            else:
                st.detok.sync()
            c.text = st.detok.text
            c.num_new_chars = len(c.text) - len(before.get(c.index, ""))
