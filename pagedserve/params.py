"""Sampling parameters shared by clients, the job store and the engine."""

from __future__ import annotations

import json
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
    """:func:`as_int` over a list (or tuple) of token ids. A list of plain ints (every prompt a
    worker leases) is returned as it is: the per-token ABC check cost a worker a few percent of
    its loop at fast steps."""
    if not isinstance(v, (list, tuple)):
        return v
    if type(v) is list and all(type(x) is int for x in v):
        return v
    return [as_int(x) for x in v]


#: Largest constraint accepted (its canonical JSON, in characters): compiling is worker time.
MAX_CONSTRAINT_CHARS = 64 * 1024
#: Most alternatives in a ``choice`` constraint.
MAX_CHOICES = 1024
#: JSON as ``json.dumps`` writes it: no free whitespace (a small model given free whitespace can
#: fill max_tokens with newlines).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputs(BaseModel):
    """A constraint on a completion's text (vLLM's ``structured_outputs``): exactly one of ``json``
    (a JSON schema, or ``True`` for any JSON object), ``regex``, ``choice`` (one of these strings)
    or ``grammar`` (EBNF, as the worker's grammar engine reads it).

    The grammar engine (llguidance, no torch) validates the constraint here too, so a client,
    the API (400) and a batch line refuse an invalid schema or regex with the engine's message,
    or one that uses a keyword it does not implement; the worker compiles it for its tokenizer.
    """

    json_: dict[str, Any] | bool | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, min_length=1)

    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, populate_by_name=True, serialize_by_alias=True
    )

    @field_validator("json_", mode="before")
    @classmethod
    def _schema_text(cls, v: object) -> object:
        """A schema given as JSON text (as vLLM allows) is parsed into its object."""
        if isinstance(v, str):
            from pagedserve import jsonsafe

            try:
                v = jsonsafe.loads(v)
            except ValueError as exc:
                raise ValueError(f"json: the schema is not valid JSON: {exc}") from None
            if not isinstance(v, dict):
                raise ValueError("json: a schema must be a JSON object")
        return v

    @field_validator("choice")
    @classmethod
    def _choices(cls, v: list[str] | None) -> list[str] | None:
        for c in v or []:
            if not c:
                raise ValueError("choice: alternatives must be non-empty strings")
            check_text(c, "a choice")
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        if self.json_ is False:
            raise ValueError("json: give a schema object, or true for any JSON object")
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar; "
                f"got {len(given)}"
            )
        for text in (self.regex, self.grammar):
            if text is not None:
                check_text(text, "a regex or grammar")
        key = self.key()
        if len(key) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"the constraint exceeds {MAX_CONSTRAINT_CHARS} characters as JSON")
        error = _validated.get(key)
        if error is None:
            import llguidance  # only for requests with a constraint (the import takes ~0.1 s)

            error = llguidance.LLMatcher.validate_grammar(constraint_grammar(self))
            _validated[key] = error
            while len(_validated) > 256:
                _validated.pop(next(iter(_validated)))
        if error:
            raise ValueError(f"{self.kind}: {error.strip()}")
        return self

    @property
    def kind(self) -> str:
        """Which constraint this is: ``json``, ``json_object`` (any object), ``regex``, ..."""
        if self.json_ is True:
            return "json_object"
        if self.json_ is not None:
            return "json"
        return "regex" if self.regex is not None else "choice" if self.choice else "grammar"

    def key(self) -> str:
        """Canonical JSON of the constraint: equal constraints (key order aside) are equal here,
        so the worker compiles each distinct one once."""
        return json.dumps(
            self.model_dump(exclude_none=True), sort_keys=True, separators=(",", ":"),
            ensure_ascii=False,
        )  # fmt: skip


#: Canonical constraint JSON -> the grammar engine's validation message ("" when valid).
_validated: dict[str, str] = {}


def constraint_grammar(so: StructuredOutputs) -> str:
    """The constraint as an llguidance grammar (JSON schema, regex, or Lark; GBNF/EBNF with
    ``::=`` rules is converted to Lark)."""
    import llguidance

    m = llguidance.LLMatcher
    if so.json_ is not None:
        schema = {"type": "object"} if so.json_ is True else so.json_
        return m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if so.regex is not None:
        return m.grammar_from_regex(so.regex)
    if so.choice is not None:
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    text = so.grammar or ""
    if "::=" in text:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        text = gbnf_to_lark(text)
    return m.grammar_from_lark(text)


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
    structured_outputs: StructuredOutputs | None = Field(
        None, description="constrain the text to a JSON schema, regex, choice or grammar"
    )

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
