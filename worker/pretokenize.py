"""Tokenize newly admitted jobs off the service loop's thread, and what the heartbeat says about
the served model's context.

A text prompt or chat is tokenized (chat template included) in a small thread pool; the loop hands
the finished token ids to the engine at its next iteration, so one long prompt never stalls the
steps of every running job. Hugging Face fast tokenizers run their Rust code without the GIL (a
``tokenizer.encode`` goes through ``encode_batch``), so the loop keeps stepping meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedserve.params import SamplingParams
from pagedserve.schemas import JobRequest
from pagedserve.store import Lease

#: Threads tokenizing at once (each may hold one long prompt).
TOKENIZE_THREADS = 2

Tokenize = Callable[[str | list[int] | None, list[dict] | None], tuple[str | None, list[int]]]


def max_token_bytes(tokenizer: Any) -> int | None:
    """Most UTF-8 bytes of input text one vocabulary entry can stand for, bounded above by the
    byte length of its written form (byte-level BPE writes one character per byte, SentencePiece
    writes a space as the 3-byte '▁', byte-fallback tokens as '<0xNN>'): a text of N bytes then
    has at least N / this many tokens. (Not a bound for tokenizers whose normalizer deletes
    characters, e.g. accent stripping; none of the served decoder models has one.)"""
    if tokenizer is None:
        return None
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: no bound published
        return None
    return max((len(t.encode("utf-8", "replace")) for t in vocab), default=None)


def context_info(engine: Any) -> dict[str, int]:
    """``max_model_len`` and ``max_token_bytes`` for the heartbeat (the API refuses prompts that
    cannot fit, :func:`api.jobs.check_context`)."""
    info = {"max_model_len": int(engine.max_model_len)}
    mtb = max_token_bytes(getattr(engine, "tokenizer", None))
    if mtb:
        info["max_token_bytes"] = mtb
    return info


class Pretokenizer:
    """Jobs being tokenized: ``submit`` one, ``take_done`` the finished ones (ids or error)."""

    def __init__(
        self,
        tokenize: Tokenize,
        threads: int = TOKENIZE_THREADS,
        context: dict | None = None,
        prepare: Callable[[SamplingParams], None] | None = None,
    ) -> None:
        self.tokenize = tokenize
        #: Run after tokenizing, in the same thread (the engine compiles a job's constraint).
        self.prepare = prepare
        #: What the heartbeat publishes about the context (:func:`context_info`).
        self.context: dict[str, int] = context or {}
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self.pending: dict[str, tuple[Lease, Future[tuple[str | None, list[int]]]]] = {}

    @classmethod
    def for_engine(cls, engine: Any) -> Pretokenizer:
        return cls(engine.tokenize, context=context_info(engine), prepare=engine.prepare)

    @staticmethod
    def wanted(req: JobRequest) -> bool:
        """Text and chat need tokenizing, a constraint compiling; plain token ids go to the
        engine directly."""
        return (
            req.prompt is None
            or isinstance(req.prompt, str)
            or req.params.structured_outputs is not None
        )

    def submit(self, lease: Lease) -> None:
        req = lease.request
        messages = [m.model_dump() for m in req.messages] if req.messages is not None else None
        prompt = req.prompt if messages is None else None
        job = self.pool.submit(self._run, prompt, messages, req.params)
        self.pending[lease.job_id] = (lease, job)

    def _run(
        self, prompt: str | list[int] | None, messages: list[dict] | None, params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        got = self.tokenize(prompt, messages)
        if self.prepare is not None:
            self.prepare(params)
        return got

    def take_done(self, wait_s: float = 0.0) -> list[tuple[Lease, list[int] | BaseException]]:
        """Finished tokenizations, in submission order (each returned once); with ``wait_s``,
        first waits up to that long for one to finish."""
        if wait_s > 0 and self.pending:
            futures.wait([f for _, f in self.pending.values()], wait_s, futures.FIRST_COMPLETED)
        out: list[tuple[Lease, list[int] | BaseException]] = []
        for jid, (lease, fut) in list(self.pending.items()):
            if not fut.done():
                continue
            del self.pending[jid]
            err = fut.exception()
            out.append((lease, err if err is not None else fut.result()[1]))
        return out

    def __len__(self) -> int:
        return len(self.pending)
