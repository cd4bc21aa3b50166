"""OpenAI batch JSONL output: :func:`batch_line` builds every output or error line of a batch job
(the job store calls it with the job's server-owned batch fields); :func:`line_error_line` those
of input lines rejected at validation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from pagedserve.openai_input import CHAT_URL, COMPLETIONS_URL, LineError
from pagedserve.schemas import Completion, JobResult, TokenLogprob


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _tok(token_id: int) -> str:
    # No tokenizer here: tokens are named by id, as vLLM does with return_tokens_as_token_ids.
    return f"token_id:{token_id}"


def _completion_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "tokens": [_tok(x.token_id) for x in lps],
        "token_logprobs": [x.logprob for x in lps],
        "top_logprobs": [{_tok(k): v for k, v in x.top_logprobs.items()} for x in lps],
        "text_offset": None,
    }


def _chat_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        return {"token": _tok(tid), "logprob": lp, "bytes": None}

    content = []
    for x in lps:
        top = [entry(k, v) for k, v in x.top_logprobs.items()]
        content.append({**entry(x.token_id, x.logprob), "top_logprobs": top})
    return {"content": content}


def _choice(url: str, c: Completion, index: int | None = None) -> dict[str, Any]:
    i = c.index if index is None else index
    if url == CHAT_URL:
        return {
            "index": i,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": _chat_logprobs(c.logprobs) if c.logprobs is not None else None,
            "finish_reason": c.finish_reason,
        }
    return {
        "index": i,
        "text": c.text,
        "logprobs": _completion_logprobs(c.logprobs) if c.logprobs is not None else None,
        "finish_reason": c.finish_reason,
    }


def usage(results: Sequence[JobResult]) -> dict[str, Any]:
    """OpenAI's ``usage`` over the jobs of one request; ``cached_tokens``: prompt tokens the
    worker's prefix cache served (not computed again)."""
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_prompt_tokens for r in results)},
    }


def response_id(url: str, job_id: str) -> str:
    return f"{'chatcmpl' if url == CHAT_URL else 'cmpl'}-{job_id}"


def response_body(
    url: str,
    model: str,
    job_id: str,
    result: JobResult | Sequence[JobResult],
    created: int | None = None,
) -> dict[str, Any]:
    """The ``completion`` / ``chat.completion`` object of a finished request: one job, or the
    jobs of a completions request with several prompts (prompt ``i``'s completion ``j`` is
    choice ``i * n + j``, as OpenAI numbers them)."""
    results = [result] if isinstance(result, JobResult) else list(result)
    choices = []
    for i, r in enumerate(results):
        n = len(r.completions)
        for c in sorted(r.completions, key=lambda c: c.index):
            choices.append(_choice(url, c, i * n + c.index))
    chat = url == CHAT_URL
    return {
        "id": response_id(url, job_id),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "usage": usage(results),
    }


def chunk_choice(
    url: str, index: int, text: str | None, *, role: bool = False, finish: str | None = None
) -> dict[str, Any]:
    """One choice of a streamed chunk: the role first (chat), then text deltas, then one with
    the ``finish_reason`` (and no text)."""
    if url == CHAT_URL:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}


def stream_chunk(
    url: str,
    rid: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` / ``text_completion`` chunk; the usage chunk (last, when the
    client asked for ``stream_options.include_usage``) has no choices and the usage."""
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk" if url == CHAT_URL else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_body is not None:
        chunk["usage"] = usage_body
    return chunk


def error_line(
    custom_id: str,
    request_id: str,
    code: str,
    message: str,
    status_code: int | None = 500,
) -> str:
    """The error-file line of a failed request. With ``status_code`` the error is an HTTP-like
    response (400: invalid request, 500: failed in the worker); without, a request that never
    ran (``batch_cancelled``, ``batch_expired``) with a top-level ``error``."""
    err = {"code": code, "message": message}
    if status_code is None:
        response = None
        top: dict[str, Any] | None = err
    else:
        body = {"error": {"message": message, "type": code, "param": None, "code": code}}
        response = {"status_code": status_code, "request_id": f"req_{request_id}", "body": body}
        top = None
    return _dumps(
        {
            "id": f"batch_req_{request_id}",
            "custom_id": custom_id,
            "response": response,
            "error": top,
        }
    )


def line_error_line(err: LineError, batch_id: str) -> str:
    """The error-file line of an input line rejected at validation (status 400)."""
    rid = f"{batch_id}_line{err.line}"
    return error_line(err.custom_id or "", rid, err.code, err.message, status_code=400)


#: Error codes of batch requests that ended without a worker's final write (``error`` lines
#: without a ``response``, built by :func:`batch_line` with ``code``).
DEAD_LETTERED = "dead_lettered"
BATCH_CANCELLED = "batch_cancelled"
BATCH_EXPIRED = "batch_expired"
JOB_LOST = "job_lost"


def batch_line(
    custom_id: str,
    url: str,
    model: str,
    job_id: str,
    status: str,
    result: JobResult | None = None,
    error: str | None = None,
    *,
    code: str | None = None,
) -> tuple[bool, str]:
    """``(succeeded?, line)`` of a batch job: the output line of a succeeded job; otherwise its
    error line: with ``code`` a request that never got a worker's final write (dead-lettered,
    cancelled or expired before it finished, record lost: a top-level ``error``), else a
    cancelled one (``batch_cancelled``) or a failed one (an HTTP-like 500 response)."""
    if status == "succeeded" and code is None:
        if result is None:
            raise ValueError("a succeeded job needs a result")
        body = response_body(url or COMPLETIONS_URL, model, job_id, result)
        response = {"status_code": 200, "request_id": f"req_{job_id}", "body": body}
        line = {"id": f"batch_req_{job_id}", "custom_id": custom_id, "response": response}
        return True, _dumps({**line, "error": None})
    if code is not None:
        return False, error_line(custom_id, job_id, code, error or code, status_code=None)
    if status == "cancelled":
        msg = error or "cancelled"
        return False, error_line(custom_id, job_id, BATCH_CANCELLED, msg, status_code=None)
    return False, error_line(custom_id, job_id, "server_error", error or "failed", status_code=500)
