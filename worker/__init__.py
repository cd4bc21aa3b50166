"""The worker: model families, the model runner, the engine and the Redis service loop.

``from worker import LLM, SamplingParams`` for offline generation (as with vLLM); imports are
lazy so that light entry points (``worker.make_model``) do not pay for the engine's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "CompletionOutput", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from worker.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagedserve.params import SamplingParams

        return SamplingParams
    if name == "Engine":
        from worker.engine import Engine

        return Engine
    if name in ("EngineConfig", "RequestOutput", "CompletionOutput"):
        from worker import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
