"""Incremental detokenization with stop strings.

Each step decodes only a short window of recent tokens. A window whose text ends in an
incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it, so a delta never
splits a multi-byte character. With stop strings, the last ``len(longest stop) - 1`` characters are
held back too: a stop string must never reach a client, even partially, before it is recognised.

Without stop strings nothing needs the text at each token, so ``lazy`` detokenizers only keep the
ids and decode when the text is read (:meth:`IncrementalDetokenizer.sync`, ``flush``): one window
for all the tokens since the last read instead of two decodes per token. The worker and
``LLM.generate`` read their requests' text at intervals and at the end (``stream=False``); at
the tiny preset of ``bench.service`` the per-token decodes were ~5% of the worker's main thread
(py-spy), and on a GPU every step is that fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

_LOOKBACK = 6  # tokens of left context re-decoded so merges at the boundary render correctly
_HOLD_TOKENS = 8  # the most tokens held back waiting for a character to complete
_RENDERED, _EMPTY, _DANGLING = object(), object(), object()  # what `_render` did


def decoder_of(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> text``, as ``tokenizer.decode(ids, skip_special_tokens=...)`` gives it.

    For a ``transformers`` fast tokenizer that neither overrides its decoding nor cleans up
    tokenization spaces, that text is its Rust tokenizer's ``decode``: called directly, without
    the wrapper's argument conversion and dispatch (two decodes per token and step: the offline
    engine ran the tiny preset's 384 mixed requests 1.13x as fast without it). Any other
    tokenizer goes through its own ``decode``."""
    rust = getattr(tokenizer, "_tokenizer", None)
    if rust is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # another transformers layout: the tokenizer's own decode
            pass
        else:
            cls = type(tokenizer)
            if (
                isinstance(tokenizer, TokenizersBackend)
                and cls.decode is PreTrainedTokenizerBase.decode
                and cls._decode is TokenizersBackend._decode
            ):
                return partial(rust.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: Any
    prompt_tail: list[int]
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False
    skip_special_tokens: bool = True
    #: Decode when the text is read, not at every token (only without stop strings: see above).
    lazy: bool = False
    text: str = ""  # everything decoded so far (before stop-string truncation)
    emitted: int = 0  # characters of ``text`` already handed out
    _prefix: int = 0  # index into ``_ids`` where the decode window starts
    _read: int = 0  # index where the not-yet-rendered tokens start
    _decode: Callable[[list[int]], str] = field(init=False, repr=False)
    #: The prompt's tail, then every token added: the decode windows are slices of it (one
    #: list kept extended; building it anew for every token copied the whole completion).
    _ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_tail = self.prompt_tail[-_LOOKBACK:]
        self._prefix = 0
        self._read = len(self.prompt_tail)
        self._decode = decoder_of(self.tokenizer, self.skip_special_tokens)
        self._ids = list(self.prompt_tail)
        if self.lazy and self.stop:
            raise ValueError("a detokenizer with stop strings checks them at every token")

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Append tokens; return (the text safe to emit now, whether a stop string was hit).
        ``lazy``: only appended (``("", False)``); :meth:`sync` renders them."""
        self._ids.extend(token_ids)
        if self.lazy:
            return "", False
        self._render(len(self._ids))
        stopped = False
        if self.stop:
            stopped = self._truncate_at_stop()
        return self._take(final=stopped), stopped

    def sync(self) -> str:
        """Render the tokens added since the last read; the text safe to emit now (a lazy
        detokenizer's :meth:`add`, deferred)."""
        n = len(self._ids)
        if self.lazy and n > self._read and self._render(n, clean_only=True) is _DANGLING:
            # The window ends inside a character: render up to the last token that does not
            # (one token at a time, only that tail would have been held back), else as that
            # rule does: a character still incomplete after _HOLD_TOKENS tokens goes out as is.
            for end in range(n - 1, max(self._read, n - _HOLD_TOKENS - 1), -1):
                if self._render(end, clean_only=True) is _RENDERED:
                    break
            else:
                self._render(n)
        return self._take(final=False)

    def _render(self, end: int, clean_only: bool = False) -> object:
        """Append the text of ``_ids[_read:end]`` (decoded with the window's left context) to
        :attr:`text`: ``_RENDERED``, or why not (``_EMPTY``: no new text; ``_DANGLING``: an
        incomplete character at its end, held back for up to ``_HOLD_TOKENS`` tokens, or
        always with ``clean_only``)."""
        allids = self._ids
        prefix_text = self._decode(allids[self._prefix : self._read])
        new_text = self._decode(allids[self._prefix : end])
        if len(new_text) <= len(prefix_text):
            return _EMPTY
        # Hold back a dangling partial character, but not forever (a model can emit bytes that
        # never form valid UTF-8; re-decoding an ever-growing window would be quadratic).
        if new_text.endswith("\ufffd") and (clean_only or end - self._read <= _HOLD_TOKENS):
            return _DANGLING
        self.text += new_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = end
        return _RENDERED

    def flush(self) -> str:
        """At the end of generation: whatever is left (a held-back tail, a dangling byte)."""
        allids = self._ids
        rest = self._decode(allids[self._prefix :])
        head = self._decode(allids[self._prefix : self._read])
        if len(rest) > len(head):
            self.text += rest[len(head) :]
            self._prefix = self._read = len(allids)
        return self._take(final=True)

    def _truncate_at_stop(self) -> bool:
        longest = max(len(s) for s in self.stop)
        start = max(0, self.emitted - longest)
        hit = -1
        hit_len = 0
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (hit == -1 or i < hit):
                hit, hit_len = i, len(s)
        if hit == -1:
            return False
        self.text = self.text[: hit + hit_len] if self.include_stop else self.text[:hit]
        return True

    def _take(self, final: bool) -> str:
        end = len(self.text)
        if not final and self.stop:
            end = max(self.emitted, end - (max(len(s) for s in self.stop) - 1))
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
