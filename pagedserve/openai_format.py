"""OpenAI batch JSONL: input lines -> :class:`JobRequest`, finished jobs -> output/error lines.

Input line: ``{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}``. Format errors (bad JSON, missing or duplicate ``custom_id``, wrong method or url)
fail the whole batch; request errors (unknown model, bad parameters) fail only that line, which
goes to the batch's error file.

Output side: :func:`batch_line` builds every output or error line of a batch job (the job store
calls it with the job's server-owned batch fields); :func:`line_error_line` those of input lines
rejected at validation.

The input side lives in :mod:`pagedserve.openai_input`, the output side in
:mod:`pagedserve.openai_output`; this module is the one import path for both.
"""

from __future__ import annotations

from pagedserve.openai_input import (
    CHAT_URL,
    COMPLETIONS_URL,
    ENDPOINTS,
    MAX_CUSTOM_ID,
    BatchLine,
    Endpoint,
    LineError,
    LineInvalid,
    ParsedFile,
    parse_file,
    parse_line,
)
from pagedserve.openai_output import (
    BATCH_CANCELLED,
    BATCH_EXPIRED,
    DEAD_LETTERED,
    JOB_LOST,
    batch_line,
    error_line,
    line_error_line,
    response_body,
)

__all__ = [
    "BATCH_CANCELLED",
    "BATCH_EXPIRED",
    "CHAT_URL",
    "COMPLETIONS_URL",
    "DEAD_LETTERED",
    "ENDPOINTS",
    "JOB_LOST",
    "MAX_CUSTOM_ID",
    "BatchLine",
    "Endpoint",
    "LineError",
    "LineInvalid",
    "ParsedFile",
    "batch_line",
    "error_line",
    "line_error_line",
    "parse_file",
    "parse_line",
    "response_body",
]
