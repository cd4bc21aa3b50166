"""What the engine returns: per-step deltas and finished completions (the Engine's public types)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.settings import opt, parse_size


@dataclass(slots=True)
class EngineConfig:
    """Engine options, named as vLLM users know them; each is a ``pagedserve worker`` flag."""

    block_size: int = field(default=16, metadata=opt("tokens per KV block"))
    #: Overrides kv_cache_memory when set.
    num_kv_blocks: int | None = field(default=None, metadata=opt("KV blocks in the pool"))
    kv_cache_memory: int | None = field(
        default=None,
        metadata=opt(
            "bytes for the KV cache on the CPU, e.g. 512MB (default: see ModelRunner)",
            parse=parse_size,
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=opt("CUDA: fraction of free memory after profiling")
    )
    max_num_seqs: int = field(default=256, metadata=opt("most sequences in one step"))
    max_num_batched_tokens: int = field(default=2048, metadata=opt("token budget of one step"))
    max_model_len: int | None = field(
        default=None, metadata=opt("longest sequence (default: the model's positions)")
    )
    # auto: float32 on a CPU (greedy parity with transformers' float32), bfloat16 on a GPU
    # (what a GPU deployment runs; compose.yaml said so explicitly, a bare worker did not)
    dtype: str = field(
        default="auto",
        metadata=opt("float32 | bfloat16 | float16 | auto (float32 on a CPU, bfloat16 on a GPU)"),
    )
    device: str = field(default="cpu", metadata=opt("cpu | cuda[:n]"))
    # Speed modes with other numerics (never a default): worker.models.layers.Bf16Weight, and
    # kernels.gemm.NativeGemm.pack_int8
    weight_dtype: str = field(
        default="auto",
        metadata=opt(
            "auto (the weights in --dtype) | bfloat16 (CPU, float32: projection weights in "
            "bfloat16, fast with AMX or AVX512-BF16) | int8 (CPU, float32: projection weights "
            "in int8 with a scale per 32 inputs of each row, ~0.28 of the bytes: faster decode "
            "at a few sequences, slower from ~16); the last two not token-for-token float32's "
            "outputs"
        ),
    )
    # A memory / speed mode with other numerics (never a default): worker.model_runner
    kv_cache_dtype: str = field(
        default="auto",
        metadata=opt(
            "auto (the model's dtype) | float32 | bfloat16 (a float32 model's KV cache in "
            "bfloat16: twice the tokens per byte; not token-for-token float32's outputs)"
        ),
    )
    #: kernels.greedy_head: exact (the float32 head's tokens), so on by default where it applies.
    greedy_screen: bool = field(
        default=True,
        metadata=opt(
            "turn off the bfloat16 / int16 screen of greedy rows' output head (CPU, float32; "
            "its tokens are the float32 head's either way)",
            flag="--no-greedy-screen",
        ),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=opt("turn off prefix caching", flag="--no-prefix-caching")
    )
    #: scheduler.block_pool.BlockPool's windows: same tokens either way, a layout choice.
    kv_windows: bool = field(
        default=True,
        metadata=opt(
            "place each sequence's KV blocks from the first free block of the queue, not in a "
            "run of free blocks kept for it to grow into (its block table then scatters once the "
            "pool has turned over: the CPU decode kernel reads it slower)",
            flag="--no-kv-windows",
        ),
    )
    #: After loading, move every object that exists then out of the cyclic collector's sight
    #: (``gc.freeze``) and raise its youngest generation's threshold: see
    #: :meth:`worker.engine.Engine._freeze_gc`. Process-wide.
    freeze_gc: bool = field(
        default=True,
        metadata=opt(
            "turn off gc.freeze() and the raised gen-0 threshold after loading",
            flag="--no-freeze-gc",
        ),
    )
    seed: int = field(default=0, metadata=opt("seed of the generator of requests that set none"))
    num_threads: int | None = field(default=None, metadata=opt("torch intra-op threads (CPU)"))
    #: Structured outputs (worker.structured): the LRU of compiled constraints holds at most this
    #: many bytes of grammar text (and at most 1024 constraints).
    grammar_cache_bytes: int = field(
        default=64 << 20,
        metadata=opt("grammar text kept by the compiled-constraint cache", parse=parse_size),
    )


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


def refusal(exc: Exception) -> str:
    """A job's failure reason for a request the engine would not take: the refusal's own words,
    or (a tokenizer or template error, say) the error's type and text."""
    msg = str(exc) if isinstance(exc, RequestRejected) else f"{type(exc).__name__}: {exc}"
    return f"rejected: {msg}"
