"""The job/result protocol shared by the peer scripts that run in this repository's venv."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class Job:
    model: str
    prompts: list[list[int]]
    max_tokens: list[int]
    threads: int
    warmup_prompt: list[int]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def load_job(path: str | Path) -> Job:
    raw = json.loads(Path(path).read_text())
    return Job(**raw)


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    torch.set_num_interop_threads(1)


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(result))


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def main_args() -> tuple[Job, str]:
    """``python -m bench.peers.X JOB_JSON RESULT_JSON``"""
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} JOB_JSON RESULT_JSON")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return load_job(sys.argv[1]), sys.argv[2]


def base_result(job: Job, system: str, wall: float) -> dict[str, Any]:
    return {
        "system": system,
        "wall_s": round(wall, 3),
        "prompt_tokens": job.prompt_tokens,
        "output_tokens": job.output_tokens,
        "output_tok_s": round(job.output_tokens / wall, 1),
    }
