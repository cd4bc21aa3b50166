"""Helpers shared by the benchmarks: every benchmark ends by printing one JSON line."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

#: CPU flags that decide our matmul and attention speed (and so compare runs across machines).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile")


def cpu_info() -> dict[str, Any]:
    """The CPU's model name and which of :data:`CPU_FLAGS` it has (Linux; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line.strip():
            break  # the first processor is enough
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name", ""), "cpu_flags": [f for f in CPU_FLAGS if f in flags]}


def emit(name: str, figures: dict[str, Any]) -> None:
    """Print the benchmark's single JSON line (figures plus where it ran)."""
    record = {
        "bench": name,
        **figures,
        "python": platform.python_version(),
        "machine": platform.machine(),
        **cpu_info(),
    }
    sys.stdout.write(json.dumps(record, sort_keys=False) + "\n")
    sys.stdout.flush()
