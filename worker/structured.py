"""Structured outputs: JSON schema, regex, choice and grammar constraints through llguidance.

Why llguidance over xgrammar (``bench.grammar_engines`` and the tests; numbers in the report):
xgrammar filled masks faster (4.5 vs 40 us median per row), but its rules for length-bounded
strings and regex character classes admitted raw control characters and invalid UTF-8, so a
sampled "valid" JSON failed to parse, and it silently ignored ``if``/``not``/``contains`` and
multi-part ``allOf``; llguidance produced only valid outputs, names the keywords it does not
implement, and validates without torch (so the contract can refuse a bad constraint up front).

- :class:`GrammarBackend` compiles each distinct constraint once into a pristine matcher (an LRU
  keyed by the constraint's canonical JSON, bounded by entries and grammar size); every
  completion starts from a copy. Thread-safe: the service compiles in its pretokenize threads.
- :class:`GrammarState` is one completion's matcher: forked for n > 1 siblings, rebuilt from the
  output tokens whenever it is out of step with them.
- :class:`TokenMasks` fills one bitmask for every constrained row of a step (one call, in
  llguidance's threads) and applies it to those rows' logits at once; rows without a constraint
  are not touched, and a step without any costs nothing.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from pagedserve.params import StructuredOutputs as Constraint
from pagedserve.params import constraint_grammar

#: Compiled constraints kept (each also counts its grammar text against ``max_bytes``).
CACHE_ENTRIES = 1024


class ConstraintError(ValueError):
    """A constraint the grammar engine refuses (invalid, or not supported), with its message."""


@dataclass(slots=True)
class StructuredStats:
    compiles: int = 0
    compile_s: float = 0.0
    cache_hits: int = 0
    mask_steps: int = 0  # steps with at least one constrained row
    mask_rows: int = 0
    mask_s: float = 0.0  # filling and applying the bitmask


class GrammarBackend:
    """Compiled constraints for one tokenizer, cached (LRU bounded by ``max_bytes``)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_ids: list[int], max_bytes: int,
        stats: StructuredStats | None = None,
    ) -> None:  # fmt: skip
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=stop_ids or None
        )
        self.max_bytes = max_bytes
        self.stats = stats or StructuredStats()
        self._cache: OrderedDict[str, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def compile(self, so: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for ``so`` (compiled once, then copied from the cache)."""
        key = so.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return hit[0].deep_copy()
        t0 = time.perf_counter()
        grammar = constraint_grammar(so)  # outside the lock: others may compile meanwhile
        proto = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if proto.is_error():
            raise ConstraintError(f"{so.kind}: {proto.get_error()}")
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_s += time.perf_counter() - t0
            if key not in self._cache:
                self._cache[key] = (proto, len(grammar))
                self._bytes += len(grammar)
            while len(self._cache) > 1 and (
                self._bytes > self.max_bytes or len(self._cache) > CACHE_ENTRIES
            ):
                _, (_, size) = self._cache.popitem(last=False)
                self._bytes -= size
        return proto.deep_copy()

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)


class GrammarState:
    """One completion's position in its grammar, kept in step with its output tokens."""

    __slots__ = ("accepted", "matcher")

    def __init__(self, matcher: llguidance.LLMatcher, accepted: int = 0) -> None:
        self.matcher = matcher
        self.accepted = accepted  # output tokens the matcher has consumed

    def accept(self, token: int) -> bool:
        ok = bool(self.matcher.consume_token(token))
        if ok:
            self.accepted += 1
        return ok

    @property
    def terminated(self) -> bool:
        """The grammar is complete: nothing but its end (EOS) can follow, or EOS was taken."""
        return bool(self.matcher.is_stopped())

    def fork(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy(), self.accepted)

    def sync(self, output_token_ids: list[int]) -> None:
        """Rebuild from the tokens when out of step with them (never on the normal path:
        preemption by recompute keeps a sequence's tokens, only its KV is dropped)."""
        if self.accepted == len(output_token_ids):
            return
        self.matcher.reset()
        self.accepted = 0
        for t in output_token_ids:
            if not self.accept(t):
                break


#: Shifts that move bit j of a bitmask word to the sign bit (then >> 31 spreads it). A NumPy
#: array, not a tensor: a module-level torch allocation at import made torch read its huge-page
#: switch before the model runner set it (see ``worker.cpu_memory.enable_huge_pages``).
_SHIFTS_NP = 31 - np.arange(32, dtype=np.int32)
#: float32 -inf as int32 bits (0xFF800000).
_NEG_INF_BITS = -8388608


def mask_rows(rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``rows[k, t]`` to -inf where bit ``t`` of ``bitmask[k]`` is clear, in place.

    float32 goes through its bits: each bitmask bit is spread to a 0 / -1 word by two shifts,
    then ``x & m | -inf & ~m`` (integer ops that vectorize, ~3x faster here than masked_fill
    with a bool mask); on CPU in NumPy, single-threaded (torch's thread pool costs more than the
    work when the 2 cores are busy). Other dtypes and devices use masked_fill."""
    n, vocab = rows.shape
    if rows.dtype == torch.float32 and rows.device.type == "cpu":
        words = (bitmask.numpy()[:, :, None] << _SHIFTS_NP) >> 31
        keep = words.reshape(n, -1)[:, :vocab]  # -1: allowed, 0: masked
        bits = rows.numpy().view(np.int32)
        bits &= keep
        bits |= ~keep & _NEG_INF_BITS
        return
    words = (bitmask.unsqueeze(-1) << torch.from_numpy(_SHIFTS_NP).to(bitmask.device)) >> 31
    rows.masked_fill_(words.view(n, -1)[:, :vocab] == 0, float("-inf"))


class TokenMasks:
    """One reusable bitmask; per step, every constrained row filled and applied at once."""

    def __init__(self, vocab_size: int, stats: StructuredStats) -> None:
        self.vocab_size = vocab_size
        self.stats = stats
        self.words = (vocab_size + 31) // 32
        self._bitmask = torch.zeros((8, self.words), dtype=torch.int32)
        self._executor: llguidance.LLExecutor | None = None

    @torch.inference_mode()  # the model's logits are inference tensors
    def apply(self, logits: torch.Tensor, rows: list[tuple[int, GrammarState]]) -> None:
        """Mask ``logits[i]`` to what ``state`` allows, for each ``(i, state)`` in ``rows``."""
        if not rows:
            return
        t0 = time.perf_counter()
        n = len(rows)
        if self._bitmask.shape[0] < n:
            self._bitmask = torch.zeros((2 * n, self.words), dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
        bitmask = self._bitmask[:n]
        self._executor.unsafe_compute_mask_ptr(
            [(s.matcher, k) for k, (_, s) in enumerate(rows)],
            bitmask.data_ptr(), self.words * 4, n,
        )  # fmt: skip
        dev = logits.device
        bitmask = bitmask.to(dev, non_blocking=True)
        idx = [i for i, _ in rows]
        if idx == list(range(logits.shape[0])):  # every row constrained: in place
            mask_rows(logits, bitmask)
        elif dev.type == "cpu":
            sub = logits[idx]  # a copy of the constrained rows
            mask_rows(sub, bitmask)
            logits[idx] = sub
        else:
            index = torch.tensor(idx, device=dev)
            sub = logits.index_select(0, index)
            mask_rows(sub, bitmask)
            logits.index_copy_(0, index, sub)
        st = self.stats
        st.mask_steps += 1
        st.mask_rows += n
        st.mask_s += time.perf_counter() - t0


class StructuredDecoding:
    """The engine's structured-output side: the backend built at the first constrained request
    (llguidance's token table for a 49k vocabulary takes ~1-4 s), and the step's mask."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], max_bytes: int):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self.max_bytes = max_bytes
        self.stats = StructuredStats()
        self.masks = TokenMasks(vocab_size, self.stats)
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def backend(self) -> GrammarBackend:
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    if self.tokenizer is None:
                        raise ConstraintError("this model has no tokenizer to constrain")
                    self._backend = GrammarBackend(
                        self.tokenizer, self.vocab_size, self.stop_ids, self.max_bytes, self.stats
                    )
        return self._backend

    def new_state(self, so: Constraint | None) -> GrammarState | None:
        """A matcher for ``so`` (None without one); raises :class:`ConstraintError`."""
        return None if so is None else GrammarState(self.backend().compile(so))
