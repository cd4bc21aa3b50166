"""Compile every C library of ``kernels/`` into the kernel cache ahead of use, side by side.

Each library is otherwise built at its first use (:func:`kernels.native.build`): the GEMM when a
CPU model's weights are packed, the fused ops at its first forward, each decode-attention build
(one per KV-cache dtype) when a cache of its dtype first needs it. On a 2-core machine those
builds take ~7 s, ~2 s and ~25 s each (``gcc -O3``, a Zen 4 EPYC): a fresh worker otherwise
spends them one after the other, the last in the middle of its first step, and a worker asked
for a bfloat16 cache long after setup still pays its build then. Here they run concurrently
(the compilers are child processes; the threads only wait), longest first.

What is built is what the loaders load: the same source and flags, so the same cache key
(:func:`builds`). ``python -m kernels.prebuild`` (``scripts/bootstrap.sh``) prints one JSON
object, each library's name and path, or its error; it exits 1 if any failed (no compiler: the
engine then keeps its torch paths).
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kernels import fused, gemm, native


def builds() -> dict[str, tuple[Path, list[str]]]:
    """Each library's name and its (source, flags), the longest build first."""
    out: dict[str, tuple[Path, list[str]]] = {}
    for dtype, (_, suffix) in native.KV_BUILDS.items():
        out[f"decode-{suffix}"] = (native.SOURCE, native.decode_flags(dtype))
    out["gemm"] = (gemm.SOURCE, gemm.FLAGS)
    out["fused"] = (fused.SOURCE, fused.FLAGS)
    return out


def prebuild(workers: int | None = None) -> dict[str, Path | Exception]:
    """Build (or find in the cache) every library of :func:`builds`, ``workers`` at a time
    (default: the CPUs this process may run on); each library's path, or why it failed."""
    todo = builds()
    workers = workers or len(os.sched_getaffinity(0))
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
        futures = {
            name: pool.submit(native.build, source=source, flags=flags)
            for name, (source, flags) in todo.items()
        }
    done: dict[str, Path | Exception] = {}
    for name, future in futures.items():
        try:
            done[name] = future.result()
        except (OSError, RuntimeError) as exc:  # what native.build raises
            done[name] = exc
    return done


def main() -> int:
    done = prebuild()
    print(json.dumps({name: str(value) for name, value in done.items()}))
    return 1 if any(isinstance(v, Exception) for v in done.values()) else 0


if __name__ == "__main__":  # pragma: no cover - `python -m kernels.prebuild`
    sys.exit(main())
