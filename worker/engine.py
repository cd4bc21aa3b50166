"""The continuous-batching engine: add requests at any time, step, read what changed.

``step()`` is one iteration: the scheduler picks this step's tokens (prefill chunks and decode
tokens under one budget), the model runner computes them, the sampler draws the next token of every
sequence that reached its end, and the scheduler appends them, applies stop conditions and frees
finished sequences at once, so waiting requests join at the very next step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedserve.params import SamplingParams
from scheduler.block_pool import PoolOccupancy
from scheduler.output import SchedulerOutput
from scheduler.scheduler import Scheduler, SchedulerConfig, SequenceRejected, TokenUpdate
from scheduler.sequence import FinishReason, Priority, Sequence, StopConditions
from worker.detokenizer import IncrementalDetokenizer
from worker.model_runner import ModelRunner
from worker.model_source import resolve_model, served_model_name
from worker.outputs import (
    CompletionOutput,
    EngineConfig,
    RequestOutput,
    RequestRejected,
)
from worker.sampler import Sampler, SampleRow

log = logging.getLogger(__name__)

_PRIORITIES = {"interactive": Priority.INTERACTIVE, "bulk": Priority.BULK}


@dataclass(slots=True)
class _Completion:
    index: int
    detok: IncrementalDetokenizer | None
    generator: torch.Generator | None
    out: CompletionOutput
    seq_id: int | None = None


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    arrival: float
    forked: bool = False  # n > 1: children created at the parent's first sample
    first_token_at: float | None = None
    num_cached_tokens: int = 0


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    steps: int = 0
    preemptions: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    requests_finished: int = 0
    prefix_cache: dict[str, float] = field(default_factory=dict)
    tokens_per_second: float = 0.0


def _load_tokenizer(model_dir: Path) -> Any | None:
    if (
        not (model_dir / "tokenizer.json").exists()
        and not (model_dir / "tokenizer_config.json").exists()
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


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
        # A .gguf file is converted once into a cached checkpoint directory (worker.gguf).
        self.model_dir = resolve_model(model_dir)
        self.model_name = served_model_name(model_dir, self.model_dir)
        self.runner = ModelRunner(self.model_dir, cfg, cfg.max_model_len)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.model.config.vocab_size
        self.eos_token_ids = frozenset(self.runner.model.config.eos_token_ids)
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.runner.layout.num_blocks,
                block_size=cfg.block_size,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                enable_prefix_caching=cfg.enable_prefix_caching,
            )
        )
        self.sampler = Sampler()
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, tuple[_Request, _Completion]] = {}
        self._stats = EngineStats()
        self._recent: list[tuple[float, int]] = []  # (time, tokens) of recent steps

    # ----------------------------------------------------------------- requests
    def tokenize(
        self, prompt: str | list[int] | None, messages: list[dict] | None
    ) -> tuple[str | None, list[int]]:
        if messages is not None:
            if self.tokenizer is None:
                raise RequestRejected(
                    "this model has no tokenizer, so chat messages cannot be rendered"
                )
            try:
                text = self.tokenizer.apply_chat_template(
                    [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:  # template errors are user input errors here
                raise RequestRejected(f"chat template failed: {exc}") from exc
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this model has no tokenizer: send prompt token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            bad = [
                t
                for t in prompt
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
            ]
            if bad:
                raise RequestRejected(
                    f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}"
                )
            return None, list(prompt)
        raise RequestRejected("a request needs a prompt (text or token ids) or chat messages")

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        priority: str | int = "interactive",
        messages: list[dict] | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; raises RequestRejected for one that can never be served."""
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
        completions = [self._new_completion(i, ids, params) for i in range(params.n)]
        req = _Request(request_id, text, ids, params, completions, time.monotonic())
        completions[0].seq_id = seq.seq_id
        self._requests[request_id] = req
        self._by_seq[seq.seq_id] = (req, completions[0])

    def _new_completion(
        self, index: int, prompt_ids: list[int], params: SamplingParams
    ) -> _Completion:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, list(params.stop), params.include_stop_str_in_output
            )
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator().manual_seed(params.seed + index)
        return _Completion(
            index,
            detok,
            gen,
            CompletionOutput(index, logprobs=[] if params.logprobs is not None else None),
        )

    def abort(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        for seq in self.scheduler.abort(request_id):
            self._by_seq.pop(seq.seq_id, None)
        for c in req.completions:
            if c.out.finish_reason is None:
                c.out.finish_reason = FinishReason.ABORT.value
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def free_capacity(self) -> int:
        """How many more requests to admit now without overcommitting the KV pool.

        A request is counted as needing as many blocks as the running ones hold on average (at
        least one); requests already waiting count against the seats.
        """
        s = self.scheduler
        seats = self.config.max_num_seqs - s.num_running - s.num_waiting
        if seats <= 0:
            return 0
        used = s.pool.num_blocks - s.pool.num_free
        per_request = max(1, used // s.num_running) if s.num_running else 1
        return max(0, min(seats, s.pool.num_free // per_request - s.num_waiting))

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        logits = self.runner.execute(out)
        changed: dict[str, _Request] = {}
        if logits is not None:
            pairs = self._sample(out, logits, changed)
            for upd in self.scheduler.postprocess(pairs):
                self._on_token(upd, changed)
        for seq in self.scheduler.finished_in_schedule:
            self._on_finished_elsewhere(seq, changed)
        self.scheduler.finished_in_schedule.clear()
        self._account(out)
        return [self._output(r) for r in changed.values()]

    def _sample(
        self, out: SchedulerOutput, logits: torch.Tensor, changed: dict[str, _Request]
    ) -> list[tuple[int, int]]:
        rows: list[SampleRow] = []
        owners: list[tuple[_Request, _Completion]] = []
        for s in out.scheduled:
            if not s.sample:
                continue
            req, comp = self._by_seq[s.seq_id]
            fork = req.params.n > 1 and not req.forked
            comps = req.completions if fork else [comp]
            seq = self.scheduler.seqs[s.seq_id]
            rows.append(
                SampleRow(
                    req.params,
                    req.prompt_token_ids,
                    seq.output_token_ids,
                    [c.generator for c in comps],
                    n=len(comps),
                )
            )
            owners.append((req, comp))
        tokens = self.sampler.sample(logits, rows)
        pairs: list[tuple[int, int]] = []
        for i, ((req, comp), toks) in enumerate(zip(owners, tokens, strict=True)):
            if len(toks) > 1:
                req.forked = True
                for child_comp, _ in zip(req.completions[1:], toks[1:], strict=True):
                    child = self.scheduler.fork(comp.seq_id)  # type: ignore[arg-type]
                    child_comp.seq_id = child.seq_id
                    self._by_seq[child.seq_id] = (req, child_comp)
                comps = req.completions
            else:
                comps = [comp]
            if req.params.logprobs is not None:
                lps = self.sampler.logprobs(logits[i], toks, req.params.logprobs)
                for c, lp in zip(comps, lps, strict=True):
                    c.out.logprobs.append(lp)  # type: ignore[union-attr]
            for c, t in zip(comps, toks, strict=True):
                pairs.append((c.seq_id, t))  # type: ignore[arg-type]
            if req.first_token_at is None:
                req.first_token_at = time.monotonic()
                seq = self.scheduler.seqs.get(comp.seq_id)  # type: ignore[arg-type]
                req.num_cached_tokens = seq.num_cached_tokens if seq else 0
            changed[req.request_id] = req
        return pairs

    def _on_token(self, upd: TokenUpdate, changed: dict[str, _Request]) -> None:
        entry = self._by_seq.get(upd.seq.seq_id)
        if entry is None:
            return
        req, comp = entry
        out = comp.out
        out.token_ids.append(upd.token_id)
        out.new_token_ids.append(upd.token_id)
        # A stop token (EOS, stop_token_ids) stays in token_ids but not in the text, as in vLLM.
        if comp.detok is not None and upd.finish_reason is not FinishReason.STOP:
            delta, stopped = comp.detok.add([upd.token_id])
            out.text_delta += delta
            if stopped and upd.finish_reason is None:
                self.scheduler.finish(upd.seq, FinishReason.STOP)
                self._finish_completion(req, comp, FinishReason.STOP.value)
                return
        if upd.finish_reason is not None:
            self._finish_completion(req, comp, upd.finish_reason.value)
        changed[req.request_id] = req

    def _on_finished_elsewhere(self, seq: Sequence, changed: dict[str, _Request]) -> None:
        entry = self._by_seq.get(seq.seq_id)
        if entry is not None:
            req, comp = entry
            self._finish_completion(req, comp, (seq.finish_reason or FinishReason.LENGTH).value)
            changed[req.request_id] = req

    def _finish_completion(self, req: _Request, comp: _Completion, reason: str) -> None:
        out = comp.out
        if comp.detok is not None:
            out.text_delta += comp.detok.flush()
            out.text = comp.detok.text
        out.finish_reason = reason
        if comp.seq_id is not None:
            self._by_seq.pop(comp.seq_id, None)

    def _output(self, req: _Request) -> RequestOutput:
        finished = all(c.out.finish_reason is not None for c in req.completions)
        outs = []
        for c in req.completions:
            o = c.out
            if c.detok is not None and not o.finished:
                o.text = c.detok.text[: c.detok.emitted]
            outs.append(
                CompletionOutput(
                    o.index, list(o.token_ids), o.text, o.finish_reason,
                    list(o.logprobs) if o.logprobs is not None else None,
                    o.new_token_ids, o.text_delta,
                )
            )  # fmt: skip
            o.new_token_ids = []
            o.text_delta = ""
        if finished:
            self._requests.pop(req.request_id, None)
            self._stats.requests_finished += 1
        return RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            outs,
            req.num_cached_tokens,
            finished,
            prompt=req.prompt,
        )

    # -------------------------------------------------------------------- stats
    def _account(self, out: SchedulerOutput) -> None:
        st = self._stats
        st.steps += 1
        sampled = sum(1 for s in out.scheduled if s.sample)
        st.tokens_generated += sampled
        st.prompt_tokens += out.num_batched_tokens - sampled
        now = time.monotonic()
        self._recent.append((now, sampled))
        while self._recent and now - self._recent[0][0] > 10.0:
            self._recent.pop(0)

    def stats(self) -> EngineStats:
        st = self._stats
        s = self.scheduler
        st.running = s.num_running
        st.waiting = s.num_waiting
        st.preemptions = s.stats.num_preemptions
        ps = s.pool.stats
        st.prefix_cache = {
            "queried_tokens": ps.queried_tokens,
            "hit_tokens": ps.hit_tokens,
            "queried_blocks": ps.queried_blocks,
            "hit_blocks": ps.hit_blocks,
            "hit_rate": ps.hit_rate,
        }
        if len(self._recent) >= 2:
            span = self._recent[-1][0] - self._recent[0][0]
            st.tokens_per_second = sum(t for _, t in self._recent[1:]) / span if span > 0 else 0.0
        return st

    def heartbeat_stats(self) -> dict[str, Any]:
        """Counters and the pool snapshot in the shape of pagedserve.telemetry.WorkerHeartbeat."""
        st = self.stats()
        occ = self.scheduler.occupancy()
        return {
            "running": st.running,
            "waiting": st.waiting,
            "steps": st.steps,
            "tokens_generated": st.tokens_generated,
            "prompt_tokens": st.prompt_tokens,
            "preemptions": st.preemptions,
            "throughput_tok_s": st.tokens_per_second,
            "prefix_cache": dict(st.prefix_cache),
            "pool": {
                "num_blocks": occ.num_blocks,
                "block_size": occ.block_size,
                "free": occ.free,
                "in_use": occ.in_use,
                "cached": occ.cached_evictable,
                "shared": occ.shared,
                "tokens_stored": occ.tokens_stored,
                "fragmentation_slots": occ.fragmentation_slots,
                "usage": occ.usage,
                "block_states": "".join("0123"[b] for b in occ.block_states),
            },
        }

    def occupancy(self) -> PoolOccupancy:
        """The pool snapshot with every running sequence's block table."""
        return self.scheduler.occupancy(with_tables=True)
