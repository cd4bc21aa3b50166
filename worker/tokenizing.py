"""A model's tokenizer and what turns a request's prompt into token ids, without torch.

The engine and the worker's side of ``--engine-process`` both use these: the worker's process
tokenizes text and chat prompts itself, with the tokenizer class its engine process's
``AutoTokenizer`` chose (:func:`load_tokenizer_as`), so that it never imports torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from worker.outputs import RequestRejected

#: Where a class that :func:`load_tokenizer_as` loads may come from.
TOKENIZER_PACKAGE = "transformers."


def has_tokenizer(model_dir: Path) -> bool:
    return (model_dir / "tokenizer.json").exists() or (model_dir / "tokenizer_config.json").exists()


def load_tokenizer(model_dir: Path) -> Any | None:
    """The checkpoint's tokenizer, or None where it ships none (token ids only)."""
    if not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def class_path(tokenizer: Any | None) -> str | None:
    """``module:Class`` of a loaded tokenizer (None for none), for :func:`load_tokenizer_as`."""
    if tokenizer is None:
        return None
    return f"{type(tokenizer).__module__}:{type(tokenizer).__qualname__}"


def prepare_tokenizer_import() -> None:
    """Import the tokenizers' common module ahead (~1 s; no torch), e.g. while the engine's
    process loads the model, so that :func:`load_tokenizer_as` takes a fraction of a second."""
    importlib.import_module("transformers.tokenization_utils_tokenizers")


def load_tokenizer_as(model_dir: Path, path: str | None) -> Any | None:
    """The checkpoint's tokenizer as the class ``path`` (:func:`class_path`) that
    :func:`load_tokenizer` chose for it in another process (the engine's).

    Why: ``AutoTokenizer`` picks the class by heuristics over the model's config (a class the
    checkpoint names may be replaced), and its module imports torch through transformers'
    configuration code: 3.4 s and ~350 MB in the worker's process, which otherwise never needs
    torch. The same class from the same files is the same tokenizer; only ``transformers``
    classes are taken."""
    if path is None:
        return None
    module, _, name = path.partition(":")
    if not module.startswith(TOKENIZER_PACKAGE) or not name.isidentifier():
        raise ValueError(f"not a tokenizer class of {TOKENIZER_PACKAGE.rstrip('.')}: {path!r}")
    cls = getattr(importlib.import_module(module), name)
    return cls.from_pretrained(str(model_dir), local_files_only=True)


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
