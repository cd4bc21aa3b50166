"""The engine process's output increments (worker.output_delta): for any sequence of outputs the
engine can make for a request (values that grow; see ``CompletionOutput``), the loop rebuilds each
one exactly from the increments."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.output_delta import DeltaEncoder, merge
from worker.outputs import CompletionOutput, RequestOutput, TokenLogprob

_growth = st.lists(
    st.tuples(
        st.lists(st.integers(0, 50_000), max_size=6),  # tokens gained
        st.text(max_size=8),  # text gained
        st.booleans(),  # the text shrinks instead (never done by the engine: sent whole then)
        st.booleans(),  # this completion ends here
    ),
    min_size=1,
    max_size=8,
)


def _outputs(rid: str, prompt: list[int], n: int, steps: list, logprobs: bool):
    """A request's cumulative outputs, one per step, as the engine would make them."""
    toks: list[list[int]] = [[] for _ in range(n)]
    texts = [""] * n
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    seen = [(0, 0)] * n
    for i, (gain, more, cut, ends) in enumerate(steps):
        k = i % n
        if reasons[k] is None:
            toks[k] = toks[k] + gain
            # The engine's text only grows (worker.outputs); a shrink must still arrive intact.
            texts[k] = texts[k][: len(texts[k]) // 2] if cut and texts[k] else texts[k] + more
            lps[k] = lps[k] + [TokenLogprob(t, -0.5, {t: -0.5}) for t in gain]
            reasons[k] = "stop" if ends else None
        comps = []
        for j in range(n):
            comps.append(CompletionOutput(
                j, list(toks[j]), texts[j], reasons[j], list(lps[j]) if logprobs else None,
                len(toks[j]) - seen[j][0], len(texts[j]) - seen[j][1],
            ))  # fmt: skip
            seen[j] = (len(toks[j]), len(texts[j]))
        done = all(r is not None for r in reasons)
        yield RequestOutput(rid, prompt, comps, num_cached_tokens=i, finished=done, prompt="p")
        if done:
            return


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 50_000), max_size=40),
    n=st.integers(1, 3),
    steps=_growth,
    logprobs=st.booleans(),
)
def test_merge_rebuilds_every_output(prompt, n, steps, logprobs) -> None:
    enc, prev = DeltaEncoder(), None
    for out in _outputs("r1", prompt, n, steps, logprobs):
        delta = pickle.loads(pickle.dumps(enc.encode(out)))  # as it crosses the pipe
        got = merge(prev, delta)
        assert got == out
        prev = got
    if prev is not None and prev.finished:
        assert len(enc) == 0  # a finished request's bookkeeping is gone


def test_prompt_crosses_once_and_increments_only() -> None:
    enc = DeltaEncoder()
    prompt = list(range(300))
    a = RequestOutput("r", prompt, [CompletionOutput(0, [7], "a", num_new_tokens=1)])
    b = RequestOutput("r", prompt, [CompletionOutput(0, [7, 8, 9], "abc", num_new_tokens=2)])
    da, db = enc.encode(a), enc.encode(b)
    assert da[1] == prompt and db[1] is None  # the prompt with the first output only
    assert db[6][0][2] == [8, 9] and db[6][0][4] == "bc"  # the new tokens and text only
    assert len(pickle.dumps(db)) < len(pickle.dumps(b)) // 5
    assert merge(merge(None, da), db) == b


def test_forget_sends_the_prompt_again() -> None:
    enc = DeltaEncoder()
    out = RequestOutput("r", [1, 2], [CompletionOutput(0, [3], "x", num_new_tokens=1)])
    enc.encode(out)
    enc.forget("r")  # aborted: a request of the same id later starts afresh
    assert enc.encode(out)[1] == [1, 2]


def test_merge_leaves_the_previous_output_unchanged() -> None:
    enc = DeltaEncoder()
    a = RequestOutput("r", [1], [CompletionOutput(0, [5], "a", num_new_tokens=1)])
    b = RequestOutput("r", [1], [CompletionOutput(0, [5, 6], "ab", num_new_tokens=1)])
    first = merge(None, enc.encode(a))
    merge(first, enc.encode(b))
    assert first == a  # the loop may still hold it (a job's latest output)


def test_the_loop_skips_increments_of_an_aborted_request_of_the_same_id() -> None:
    """The loop aborted a request and added another of the same id before the child's reports
    about the first one came: those increments (no prompt: not a first output) are dropped, the
    new request's first output is taken."""
    from worker.engine_process import _stale

    enc = DeltaEncoder()
    out = RequestOutput("r", [1, 2], [CompletionOutput(0, [3], "x", num_new_tokens=1)])
    first, later = enc.encode(out), enc.encode(out)
    assert not _stale(None, first) and _stale(None, later)
    assert not _stale(merge(None, first), later)
