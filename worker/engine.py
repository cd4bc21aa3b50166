"""The continuous-batching engine: add requests at any time, step, read what changed.

``step()`` is one iteration: the scheduler picks this step's tokens (prefill chunks and decode
tokens under one budget), the model runner computes them, the sampler draws the next token of every
sequence that reached its end, and the scheduler appends them, applies stop conditions and frees
finished sequences at once, so waiting requests join at the very next step.

A request's state is held once (``worker.request_state``): each step returns, for every request
that changed, a ``RequestOutput`` with the cumulative tokens and text of its completions and the
increments since its previous output derived from them (a request added with ``stream=False``:
only at its first token and at its end, and on demand through ``snapshot``); ``abort`` returns
the partial one. Counters and the typed heartbeat telemetry are in ``worker.engine_stats``.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any

import torch

from pagedserve.params import SamplingParams
from pagedserve.telemetry import EngineTelemetry
from scheduler.block_pool import PoolOccupancy
from scheduler.output import ScheduledSequence, SchedulerOutput
from scheduler.scheduler import Scheduler, SchedulerConfig, SequenceRejected, TokenUpdate
from scheduler.sequence import FinishReason, Priority, Sequence, StopConditions
from worker.engine_stats import EngineStats, StatsKeeper
from worker.model_runner import ModelRunner
from worker.model_source import resolve_model, served_model_name
from worker.output_text import text_read_later
from worker.outputs import EngineConfig, RequestOutput, RequestRejected
from worker.request_state import CompletionState, RequestState, new_completion
from worker.sampler import Sampler, SampleRow, greedy_tokens, has_penalties, plain_greedy
from worker.structured import ConstraintError, GrammarState, StructuredDecoding
from worker.tokenizing import load_tokenizer, tokenize

log = logging.getLogger(__name__)

#: The cyclic collector's youngest-generation threshold once the engine is loaded (see
#: ``Engine._freeze_gc``). ``bench.service --preset tiny`` (256 running sequences, Zen 4): at
#: Python's 700, ~700 collections per 6 s round took 0.25-0.33 s; at 2,000 ~20 (0.03 s), at
#: 10,000 one (0.005 s). The bench model's slower steps ran 3-6 collections either way.
GC_GEN0_THRESHOLD = 10_000

_PRIORITIES = {"interactive": Priority.INTERACTIVE, "bulk": Priority.BULK}

__all__ = ["Engine", "EngineStats"]


class Engine:
    def __init__(
        self, model_dir: str | Path, config: EngineConfig | None = None, **options: Any
    ) -> None:
        cfg = config or EngineConfig()
        for key, value in options.items():
            if not hasattr(cfg, key):
                raise TypeError(f"unknown engine option {key!r}")
            setattr(cfg, key, value)
        self.config = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        # Requests without a seed sample from torch's default generator: the engine seed makes a
        # run reproducible as a whole (each request's own seed makes it independent of the batch).
        torch.manual_seed(cfg.seed)
        # A .gguf file is converted once into a cached checkpoint directory (worker.gguf).
        self.model_dir = resolve_model(model_dir)
        self.model_name = served_model_name(model_dir, self.model_dir)
        self.runner = ModelRunner(self.model_dir, cfg, cfg.max_model_len)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.model.config.vocab_size
        self.eos_token_ids = frozenset(self.runner.model.config.eos_token_ids)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.runner.layout.num_blocks,
                block_size=cfg.block_size,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                enable_prefix_caching=cfg.enable_prefix_caching,
                kv_windows=cfg.kv_windows,
            )
        )
        self.sampler = Sampler()
        self.structured = StructuredDecoding(
            self.tokenizer, self.vocab_size, sorted(self.eos_token_ids), cfg.grammar_cache_bytes
        )
        self._requests: dict[str, RequestState] = {}
        self._by_seq: dict[int, tuple[RequestState, CompletionState]] = {}
        self._stats = StatsKeeper()
        if cfg.freeze_gc:
            self._freeze_gc()

    @staticmethod
    def _freeze_gc() -> None:
        """Collect once, then ``gc.freeze()``: what exists now (modules, the tokenizer's
        vocabulary, the model's Python objects: ~360k objects in a bench process) lives as long
        as the engine, yet every full collection that the steps' garbage triggers walked all of
        it: 0.22 s per pass in the offline engine, ~5% of a 3.7 s ``bench.service --preset
        tiny`` round, and more in the worker. Frozen objects are still freed by reference
        counting; only cycles among them stay until ``gc.unfreeze()``. vLLM freezes its heap
        after start-up for the same reason.

        Then the youngest generation's threshold goes up to :data:`GC_GEN0_THRESHOLD` (never
        down): a step over a few hundred sequences holds more than Python's default of 700 new
        containers at once (its outputs, per-sequence lists), so nearly every step ran a young
        collection that found no garbage (reference counting frees all of it). Off with
        ``freeze_gc=False`` (``--no-freeze-gc``), both."""
        gc.collect()
        gc.freeze()
        gen0, *older = gc.get_threshold()
        gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD), *older)

    # ----------------------------------------------------------------- requests
    def tokenize(
        self, prompt: str | list[int] | None, messages: list[dict] | None
    ) -> tuple[str | None, list[int]]:
        return tokenize(self.tokenizer, self.vocab_size, prompt, messages)

    def prepare(self, params: SamplingParams) -> None:
        """Work a request needs before it joins the batch, done by the caller's thread (the
        service's pretokenize pool): compiling its constraint into the grammar cache."""
        self._grammar_state(params)

    def _grammar_state(self, params: SamplingParams) -> GrammarState | None:
        try:
            return self.structured.new_state(params.structured_outputs)
        except ConstraintError as exc:
            raise RequestRejected(f"structured_outputs: {exc}") from None

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        priority: str | int = "interactive",
        messages: list[dict] | None = None,
        cache_salt: str | None = None,
        stream: bool = True,
        render_text: bool = True,
    ) -> None:
        """Queue a request; raises RequestRejected for one that can never be served.

        ``render_text=False``: a request whose text nothing here needs (:func:`text_read_later`:
        no stop strings, no grammar) gets none; its outputs carry empty text for a caller that
        renders it from the token ids with the same tokenizer (:class:`OutputText` in
        :mod:`worker.output_text`: the engine process's parent, off its stepping thread).

        ``stream=False``: :meth:`step` reports the request only at its first token and when it
        finishes, not at every step; :meth:`snapshot` gives its output (with the deltas since
        the last one) whenever the caller wants it. Why: building every running request's
        output at every step (a copy of each completion's tokens, two objects) is work a caller
        that wants only final results, or progress at intervals, never reads (the worker's loop
        and ``LLM.generate``). 384 requests of ``bench.service --preset tiny``: 52,948 outputs
        holding 4.6 M copied token ids per run, 768 and 53 K without; the engine's CPU 3.6%
        lower (median of 8 alternating rounds, 0.90-1.13 apart: a noisy host)."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt, messages)
        if not ids:
            raise RequestRejected("the prompt is empty")
        room = self.max_model_len - len(ids)
        if room <= 0:
            raise RequestRejected(
                f"prompt of {len(ids)} tokens exceeds the model's context length of "
                f"{self.max_model_len} tokens"
            )
        max_tokens = min(params.max_tokens or room, room)
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise RequestRejected(f"stop_token_ids outside the vocabulary: {bad_stop}")
        prio = _PRIORITIES.get(priority, priority) if isinstance(priority, str) else priority
        if prio not in (Priority.INTERACTIVE, Priority.BULK):
            raise RequestRejected(f"unknown priority {priority!r}; use 'interactive' or 'bulk'")
        grammar = self._grammar_state(params)  # a cache hit once prepare() has run
        stop = StopConditions(
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=frozenset(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
        )
        try:
            seq = self.scheduler.add_sequence(
                request_id, ids, stop, priority=int(prio), cache_salt=cache_salt,
                max_model_len=self.max_model_len,
            )  # fmt: skip
        except SequenceRejected as exc:
            raise RequestRejected(str(exc)) from exc
        tok = self.tokenizer if render_text or not text_read_later(params) else None
        completions = [new_completion(i, ids, params, tok) for i in range(params.n)]
        req = RequestState(
            request_id, text, ids, params, completions, time.monotonic(), stream=stream,
            greedy=plain_greedy(params) and grammar is None,
        )  # fmt: skip
        completions[0].seq_id = seq.seq_id
        completions[0].grammar = grammar
        self._requests[request_id] = req
        self._by_seq[seq.seq_id] = (req, completions[0])

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request; returns its partial output (unfinished completions end by "abort"),
        or None for an unknown or already finished one."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        for seq in self.scheduler.abort(request_id):
            self._by_seq.pop(seq.seq_id, None)
        for c in req.completions:
            if c.out.finish_reason is None:
                c.out.finish_reason = FinishReason.ABORT.value
        return req.output()

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def free_capacity(self, lookahead: int = 0) -> int:
        """How many more requests to admit now without overcommitting the KV pool.

        A request is counted as needing as many blocks as the running ones hold on average (at
        least one); requests already waiting count against the seats; ``lookahead`` more may
        wait beyond them (:meth:`Scheduler.admission_capacity`).
        """
        return self.scheduler.admission_capacity(lookahead)

    def num_waiting(self) -> int:
        """Sequences queued here and not running (new, or preempted)."""
        return self.scheduler.num_waiting

    def unstarted(self) -> list[str]:
        """Requests added and not yet scheduled once (:meth:`Scheduler.unstarted`)."""
        return self.scheduler.unstarted()

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        by_seq = self._by_seq
        greedy = all(by_seq[s.seq_id][0].greedy for s in out.scheduled if s.sample)
        logits = self.runner.execute(out, greedy)
        changed: dict[str, RequestState] = {}
        if logits is not None:
            pairs = self._sample(out, logits, changed, greedy)
            for upd in self.scheduler.postprocess(pairs):
                self._on_token(upd, changed)
        for seq in self.scheduler.take_finished():
            self._on_finished_elsewhere(seq, changed)
        self._stats.account(out)
        return [
            self._output(r)
            for r in changed.values()
            if r.stream or r.report_due  # (see add_request's ``stream``)
        ]

    def snapshot(self, request_id: str) -> RequestOutput | None:
        """A running request's output as of now (deltas since its previous output); None for
        an unknown or finished one (a finished request's output came from :meth:`step`)."""
        req = self._requests.get(request_id)
        return req.output() if req is not None else None

    def _sample(
        self,
        out: SchedulerOutput,
        logits: torch.Tensor | list[int],
        changed: dict[str, RequestState],
        greedy: bool,
    ) -> list[tuple[int, int]]:
        """``greedy``: every sampling row is ``req.greedy`` (then ``logits`` may be the tokens
        themselves: the runner's screened head, :meth:`ModelRunner.execute`)."""
        by_seq = self._by_seq
        sampled = [s for s in out.scheduled if s.sample]
        owners = [by_seq[s.seq_id] for s in sampled]
        if greedy:
            # Most batches: every row's token is its argmax; no per-row sampling state.
            tokens = logits if isinstance(logits, list) else greedy_tokens(logits)
            pairs: list[tuple[int, int]] = []
            for (req, comp), tok in zip(owners, tokens, strict=True):
                pairs.append((comp.seq_id, tok))  # type: ignore[arg-type]
                if req.first_token_at is None:
                    self._first_token(req, comp)
                changed[req.request_id] = req
            return pairs
        assert not isinstance(logits, list)  # tokens come only for a greedy batch
        return self._sample_rows(sampled, owners, logits, changed)

    def _sample_rows(
        self,
        sampled: list[ScheduledSequence],
        owners: list[tuple[RequestState, CompletionState]],
        logits: torch.Tensor,
        changed: dict[str, RequestState],
    ) -> list[tuple[int, int]]:
        """The general case: each row's own parameters, grammars, forks and logprobs."""
        rows: list[SampleRow] = []
        constrained: list[tuple[int, GrammarState]] = []
        for s, (req, comp) in zip(sampled, owners, strict=True):
            fork = req.params.n > 1 and not req.forked
            comps = req.completions if fork else [comp]
            seq = self.scheduler.get_sequence(s.seq_id)
            assert seq is not None  # scheduled this step, so still live
            if comp.grammar is not None:
                comp.grammar.sync(seq.output_token_ids)
                constrained.append((len(rows), comp.grammar))
            rows.append(
                SampleRow(
                    req.params,
                    req.prompt_token_ids,
                    seq.output_token_ids if has_penalties(req.params) else [],
                    [c.generator for c in comps],
                    n=len(comps),
                )
            )
        raw = logits
        if constrained:  # one bitmask for every constrained row, applied in one call
            if any(owners[i][0].params.logprobs is not None for i, _ in constrained):
                raw = logits.clone()  # logprobs report the model's own distribution
            self.structured.masks.apply(logits, constrained)
        tokens = self.sampler.sample(logits, rows)
        pairs: list[tuple[int, int]] = []
        for i, ((req, comp), toks) in enumerate(zip(owners, tokens, strict=True)):
            if len(toks) > 1:
                req.forked = True
                for child_comp, _ in zip(req.completions[1:], toks[1:], strict=True):
                    child = self.scheduler.fork(comp.seq_id)  # type: ignore[arg-type]
                    child_comp.seq_id = child.seq_id
                    if comp.grammar is not None:  # the parent has not consumed its token yet
                        child_comp.grammar = comp.grammar.fork()
                    self._by_seq[child.seq_id] = (req, child_comp)
                comps = req.completions
            else:
                comps = [comp]
            if req.params.logprobs is not None:
                lps = self.sampler.logprobs(raw[i], toks, req.params.logprobs)
                for c, lp in zip(comps, lps, strict=True):
                    c.out.logprobs.append(lp)  # type: ignore[union-attr]
            for c, t in zip(comps, toks, strict=True):
                pairs.append((c.seq_id, t))  # type: ignore[arg-type]
            if req.first_token_at is None:
                self._first_token(req, comp)
            changed[req.request_id] = req
        return pairs

    def _first_token(self, req: RequestState, comp: CompletionState) -> None:
        req.first_token_at = time.monotonic()
        seq = self.scheduler.get_sequence(comp.seq_id)  # type: ignore[arg-type]
        req.num_cached_tokens = seq.num_cached_tokens if seq else 0

    def _on_token(self, upd: TokenUpdate, changed: dict[str, RequestState]) -> None:
        entry = self._by_seq.get(upd.seq.seq_id)
        if entry is None:
            return
        req, comp = entry
        comp.out.token_ids.append(upd.token_id)
        if comp.grammar is not None and upd.finish_reason is not FinishReason.STOP:
            # A grammar completed by the max_tokens-th token still ends with "stop".
            ended = self._grammar_end(comp.grammar, upd.token_id)
            if ended is not None:
                if comp.detok is not None and upd.token_id not in self.eos_token_ids:
                    comp.detok.add([upd.token_id])  # the grammar's last token is text
                self.scheduler.finish(upd.seq, ended)
                self._finish_completion(req, comp, ended.value)
                return
        # A stop token (EOS, stop_token_ids) stays in token_ids but not in the text, as in vLLM.
        if comp.detok is not None and upd.finish_reason is not FinishReason.STOP:
            _, stopped = comp.detok.add([upd.token_id])
            if stopped and upd.finish_reason is None:
                self.scheduler.finish(upd.seq, FinishReason.STOP)
                self._finish_completion(req, comp, FinishReason.STOP.value)
                return
        if upd.finish_reason is not None:
            self._finish_completion(req, comp, upd.finish_reason.value)
        changed[req.request_id] = req

    @staticmethod
    def _grammar_end(grammar: GrammarState, token: int) -> FinishReason | None:
        """Feed ``token`` to the completion's matcher: STOP once the grammar has accepted its end
        (EOS) even where EOS alone would not stop (ignore_eos, min_tokens); ABORT if the matcher
        refuses a token (the mask makes that unreachable: never pass it off as valid)."""
        if not grammar.accept(token):
            log.error("a constrained completion sampled token %d outside its grammar", token)
            return FinishReason.ABORT
        return FinishReason.STOP if grammar.terminated else None

    def _on_finished_elsewhere(self, seq: Sequence, changed: dict[str, RequestState]) -> None:
        entry = self._by_seq.get(seq.seq_id)
        if entry is not None:
            req, comp = entry
            self._finish_completion(req, comp, (seq.finish_reason or FinishReason.LENGTH).value)
            changed[req.request_id] = req

    def _finish_completion(self, req: RequestState, comp: CompletionState, reason: str) -> None:
        comp.finish(reason)
        req.report_due = True  # an unstreamed request's end is reported by step
        if comp.seq_id is not None:
            self._by_seq.pop(comp.seq_id, None)

    def _output(self, req: RequestState) -> RequestOutput:
        req.report_due = False
        out = req.output()
        if out.finished:
            self._requests.pop(req.request_id, None)
            self._stats.stats.requests_finished += 1
        return out

    # -------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        return self._stats.read(self.scheduler)

    def heartbeat_stats(self) -> EngineTelemetry:
        """Counters and the pool snapshot, typed as the heartbeat publishes them."""
        per_block = self.runner.layout.bytes_per_block
        return self._stats.telemetry(self.scheduler, self.runner.kv_dtype_name, per_block)

    def occupancy(self) -> PoolOccupancy:
        """The pool snapshot with every running sequence's block table."""
        return self.scheduler.occupancy(with_tables=True)
