"""pagedserve's public contract: what a client machine imports (no torch, no flask).

``from pagedserve import Client, SamplingParams`` (and the job and batch schemas below). Names
are resolved on first use (PEP 562), so ``import pagedserve`` itself stays as cheap as the
submodule a caller really needs (``pagedserve.keys`` is imported by every process).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

#: Public name -> the submodule that defines it.
_EXPORTS: dict[str, str] = {
    "Client": "pagedserve.client",
    "accumulate": "pagedserve.client",
    "SamplingParams": "pagedserve.params",
    "ChatMessage": "pagedserve.schemas",
    "Completion": "pagedserve.schemas",
    "DeltaEvent": "pagedserve.schemas",
    "JobRecord": "pagedserve.schemas",
    "JobRequest": "pagedserve.schemas",
    "JobResult": "pagedserve.schemas",
    "JobStatus": "pagedserve.schemas",
    "TokenLogprob": "pagedserve.schemas",
    "Batch": "pagedserve.batches",
    "BatchStatus": "pagedserve.batches",
    "BatchStore": "pagedserve.batches",
    "FileObject": "pagedserve.batches",
    "RequestCounts": "pagedserve.batches",
    "JobStore": "pagedserve.store",
}

__all__ = [
    "Batch",
    "BatchStatus",
    "BatchStore",
    "ChatMessage",
    "Client",
    "Completion",
    "DeltaEvent",
    "FileObject",
    "JobRecord",
    "JobRequest",
    "JobResult",
    "JobStatus",
    "JobStore",
    "RequestCounts",
    "SamplingParams",
    "TokenLogprob",
    "__version__",
    "accumulate",
    "package_version",
]


def package_version() -> str:
    """The installed distribution's version (``pagedserve --version``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedserve")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


if TYPE_CHECKING:
    from pagedserve.batches import Batch, BatchStatus, BatchStore, FileObject, RequestCounts
    from pagedserve.client import Client, accumulate
    from pagedserve.params import SamplingParams
    from pagedserve.schemas import (
        ChatMessage,
        Completion,
        DeltaEvent,
        JobRecord,
        JobRequest,
        JobResult,
        JobStatus,
        TokenLogprob,
    )
    from pagedserve.store import JobStore


def __getattr__(name: str) -> Any:
    if name == "__version__":
        return package_version()
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
