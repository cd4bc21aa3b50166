"""Sampling parameters shared by clients, the job store and the engine."""

from __future__ import annotations

import numbers
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.jsonsafe import check_text


def as_int(v: Any) -> Any:
    """A Python int for an integral number of another type (NumPy's ``int64``...), so strict
    mode still accepts them from Python callers; ``bool`` and strings are left to be refused."""
    if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
        return int(v)
    return v


def as_ints(v: Any) -> Any:
    """:func:`as_int` over a list (or tuple) of token ids."""
    return [as_int(x) for x in v] if isinstance(v, (list, tuple)) else v


class SamplingParams(BaseModel):
    """How to sample one request's completions (the names vLLM users know).

    ``temperature == 0`` means greedy decoding. ``max_tokens=None`` generates until a stop
    condition or the model's context length. Types are strict: ``"16"`` or ``true`` is not an
    int (an int is accepted where a float is expected).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    n: int = Field(1, ge=1, le=64, description="number of completions sharing the prompt")
    max_tokens: int | None = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list, max_length=16)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logprobs: int | None = Field(None, ge=0, le=20, description="top-k logprobs per sampled token")

    @field_validator("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", mode="before")
    @classmethod
    def _integral(cls, v: object) -> object:
        return as_int(v)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _integral_ids(cls, v: object) -> object:
        return as_ints(v)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: object) -> object:
        if isinstance(v, str):
            return [v]
        return v if v is not None else []

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        for s in v:
            check_text(s, "a stop string")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
