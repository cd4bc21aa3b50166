"""What the engine returns: per-step deltas and finished completions (the Engine's public types)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineConfig:
    """Engine options, named as vLLM users know them."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    kv_cache_memory: int | None = None  # bytes for the KV cache (CPU); default: see ModelRunner
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of free memory after profiling
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    dtype: str = "float32"  # float32 | bfloat16 | float16 ("auto" = checkpoint dtype on GPU)
    device: str = "cpu"
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU
    # Structured outputs: the LRU of compiled constraints (worker.structured) holds at most this
    # many bytes of grammar text (and at most 1024 constraints).
    grammar_cache_bytes: int = 64 << 20


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # top-k alternatives


@dataclass(slots=True)
class CompletionOutput:
    """One completion as of a step: cumulative ``token_ids`` and ``text``; the step's increments
    (what streaming clients receive) are their last ``num_new_tokens`` / ``num_new_chars``."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: list[TokenLogprob] | None = None
    num_new_tokens: int = 0
    num_new_chars: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def new_token_ids(self) -> list[int]:
        """This step's new tokens."""
        return self.token_ids[len(self.token_ids) - self.num_new_tokens :]

    @property
    def text_delta(self) -> str:
        """This step's new text (emitted text only grows: a delta is never taken back)."""
        return self.text[len(self.text) - self.num_new_chars :]


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step (returned only for requests that changed in that step): the
    one source of a request's output for callers (the service loop derives its progress deltas
    and its final or partial result from it)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    finished: bool = False
    error: str | None = None  # set when the request was rejected or failed (finished is True)
    prompt: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class RequestRejected(ValueError):
    """A request the engine can never serve (prompt too long, unknown token ids, ...)."""
