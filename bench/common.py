"""Helpers shared by the benchmarks: every benchmark ends by printing one JSON line."""

from __future__ import annotations

import json
import platform
import sys
from typing import Any


def emit(name: str, figures: dict[str, Any]) -> None:
    """Print the benchmark's single JSON line (figures plus where it ran)."""
    record = {
        "bench": name,
        **figures,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    sys.stdout.write(json.dumps(record, sort_keys=False) + "\n")
    sys.stdout.flush()
