"""Process-level settings that make torch's CPU path fast.

torch's CPU allocator is plain ``malloc``. With glibc's defaults, blocks above a dynamic threshold
come from ``mmap`` and freed heap tops are trimmed back to the OS, so the multi-megabyte
activations a forward pass allocates every step are page-faulted in again each time: measured
here, ``silu(gate) * up`` on a 2048-token prefill chunk took 15 ms with the defaults and 3.4 ms
after the call below. Memory a step frees stays with the process instead (its peak, not more).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit
_TRIM_THRESHOLD = 1 << 30

_done = False


def tune_glibc_malloc() -> bool:
    """Keep freed activation memory in the heap (no-op where libc is not glibc). Idempotent."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
    _done = ok
    log.debug("glibc mallopt tuning %s", "applied" if ok else "refused")
    return ok
