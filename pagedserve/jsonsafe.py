"""Parse untrusted JSON without blowing Python's stack or storing text Redis cannot encode.

:func:`loads` parses with ``pydantic_core.from_json`` (jiter, in Rust): it does not recurse on the
Python stack, stops at :data:`MAX_DEPTH` levels of nesting ("recursion limit exceeded") instead of
raising ``RecursionError``, and refuses lone UTF-16 surrogates in ``\\u`` escapes (``"a\\ud800b"``),
which Python's ``json`` would accept and which would fail later when encoded as UTF-8. ``NaN`` and
``Infinity`` (not JSON) are refused too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic_core import from_json

#: jiter's fixed nesting limit; deeper documents are refused before anything recurses on them.
MAX_DEPTH = 200

JsonErrorCode = Literal["invalid_json", "json_too_deep", "invalid_unicode"]


class JsonInputError(ValueError):
    """Why a document was refused: ``code`` is one of :data:`JsonErrorCode`."""

    def __init__(self, code: JsonErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: JsonErrorCode = code
        self.message = message


def _classify(err: str) -> JsonInputError:
    if "recursion limit" in err:
        return JsonInputError("json_too_deep", f"JSON nested deeper than {MAX_DEPTH} levels")
    if "surrogate" in err or "hex escape" in err or "unicode" in err:
        return JsonInputError("invalid_unicode", f"invalid Unicode in a string: {err}")
    return JsonInputError("invalid_json", f"not valid JSON: {err}")


def loads(data: bytes | str) -> Any:
    """The parsed document; raises :class:`JsonInputError` (a ``ValueError``)."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonInputError("invalid_json", f"not valid JSON: not UTF-8 text: {e}") from None
    try:
        return from_json(data, allow_inf_nan=False)
    except ValueError as e:
        raise _classify(str(e)) from None


def check_text(value: str, what: str = "text") -> str:
    """``value`` if it encodes as UTF-8 (no lone surrogates), else ``ValueError``."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode (lone surrogate at {e.start})") from None
    return value
