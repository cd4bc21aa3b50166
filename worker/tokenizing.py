"""A model's tokenizer and what turns a request's prompt into token ids, without torch.

The engine and the worker's side of ``--engine-process`` both use these: the worker's process
tokenizes text and chat prompts itself, and it loads the tokenizer while its engine process
loads the model, so neither waits on the other's imports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from worker.outputs import RequestRejected


def load_tokenizer(model_dir: Path) -> Any | None:
    """The checkpoint's tokenizer, or None where it ships none (token ids only)."""
    if (
        not (model_dir / "tokenizer.json").exists()
        and not (model_dir / "tokenizer_config.json").exists()
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def tokenize(
    tokenizer: Any | None,
    vocab_size: int,
    prompt: str | list[int] | None,
    messages: list[dict] | None,
) -> tuple[str | None, list[int]]:
    """A request's prompt text (None for token ids) and token ids; bad input is
    :class:`RequestRejected` with the reason."""
    if messages is not None:
        if tokenizer is None:
            raise RequestRejected(
                "this model has no tokenizer, so chat messages cannot be rendered"
            )
        try:
            text = tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # template errors are user input errors here
            raise RequestRejected(f"chat template failed: {exc}") from exc
        return text, tokenizer.encode(text, add_special_tokens=False)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestRejected("this model has no tokenizer: send prompt token ids")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, list):
        bad = [
            t
            for t in prompt
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
        ]
        if bad:
            raise RequestRejected(
                f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}"
            )
        return None, list(prompt)
    raise RequestRejected("a request needs a prompt (text or token ids) or chat messages")
