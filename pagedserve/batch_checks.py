"""OpenAI's limits on a batch input file, on top of the line-by-line checks of
:func:`pagedserve.openai_format.parse_file`: at most :data:`MAX_BATCH_LINES` requests, and one
model for the whole file. Both are format errors (the file or batch is refused), each naming the
line it is about."""

from __future__ import annotations

from pagedserve.openai_format import LineError, ParsedFile

#: Most requests in one batch input file (OpenAI's limit).
MAX_BATCH_LINES = 50_000


def count_lines(text: str) -> int:
    """Non-blank lines: the requests a file holds (before parsing any). Lines end at ``\n``
    only, as in :func:`~pagedserve.openai_format.parse_file`."""
    return sum(1 for line in text.split("\n") if line.strip())


def too_many(n: int) -> LineError | None:
    if n <= MAX_BATCH_LINES:
        return None
    msg = f"the file has {n} requests; a batch holds at most {MAX_BATCH_LINES}"
    return LineError(line=MAX_BATCH_LINES + 1, code="too_many_requests", message=msg)


def limit_errors(parsed: ParsedFile) -> list[LineError]:
    """The file's requests beyond the limit, and every line whose model differs from the first
    line's (lines that failed their own checks are not looked at)."""
    errors: list[LineError] = []
    over = too_many(parsed.total + len(parsed.format_errors))
    if over is not None:
        errors.append(over)
    if parsed.lines:
        first = parsed.lines[0]
        for x in parsed.lines[1:]:
            if x.model != first.model:
                msg = (
                    f"model {x.model!r} differs from {first.model!r} (line {first.line}); "
                    "a batch uses one model"
                )
                errors.append(
                    LineError(line=x.line, custom_id=x.custom_id, code="mixed_models", message=msg)
                )
    return errors
