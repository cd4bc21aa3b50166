"""Process-wide memory settings for a worker that runs its model on the CPU.

torch has no caching allocator on the CPU: every activation comes from ``malloc`` and goes back
to it at once. Two settings make that cheap for an engine that allocates the same large buffers
every step (huge pages, malloc thresholds); both must be made before the weights load. With the
switch for weight packing (``prepack_enabled``) these are the CPU worker's memory knobs, each of
which an environment variable turns off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from pagedserve.settings import HUGE_PAGES, MALLOC_TUNING, PREPACK_WEIGHTS

log = logging.getLogger(__name__)

THP_ENV = HUGE_PAGES.name
MALLOC_ENV = MALLOC_TUNING.name

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit platforms (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD_BYTES = 32 << 20
# mallopt takes an int: the heap is trimmed only once 2 GiB lies free at its top.
TRIM_THRESHOLD_BYTES = 2**31 - 1


def prepack_enabled() -> bool:
    """Whether the CPU runner packs projection weights for oneDNN after loading (see
    ``worker.models.layers.pack_weight``); ``PAGEDSERVE_PREPACK_WEIGHTS=0`` keeps them plain."""
    return PREPACK_WEIGHTS.enabled()


def enable_huge_pages() -> None:
    """Ask torch's CPU allocator for transparent huge pages on allocations of 2 MiB and more.

    Weights (~110 MB for the bench model) and the KV cache are re-read every step, in 4 KiB
    pages a TLB miss every few rows; with ``THP_MEM_ALLOC_ENABLE=1`` torch aligns large
    allocations to 2 MiB and ``madvise``s them (``/sys/kernel/mm/transparent_hugepage/enabled`` =
    madvise): +6% on the bench's mixed run on 2 EPYC cores when added (interleaved A/B, 2 runs
    each); restored later after a silent loss (below), A/B on a Zen 4 EPYC: bench model uniform
    1.06 (paired 1.03-1.07), mixed 0.97 (0.96-0.99), SmolLM2 0.99 / 0.98 (within the spread).
    torch reads the variable once, at its **first CPU allocation of any size**, so this must run
    before any tensor exists (no module-level tensors in the engine's modules:
    :func:`huge_pages_in_effect` checks); a value already set (``0`` to opt out) is left alone.
    """
    os.environ.setdefault(THP_ENV, HUGE_PAGES.default)


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or None."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


def _vm_flags(addr: int) -> list[str] | None:
    """The ``VmFlags`` of this process's mapping that holds ``addr`` (``/proc/self/smaps``)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


def huge_pages_in_effect() -> bool | None:
    """Whether torch's large CPU allocations get transparent huge pages now: with the kernel in
    ``madvise`` mode, a fresh 4 MiB tensor's mapping must carry the ``hg`` (MADV_HUGEPAGE) flag.
    None where it cannot be told or does not apply (no THP, mode ``never``, not Linux).

    Why a check: torch reads its switch once, at its first CPU allocation of any size. A
    module-level tensor imported before the runner set it (one in ``worker.structured`` did)
    silently turned huge pages off for every worker, with nobody noticing. The runner now logs
    a warning when it happens."""
    mode = thp_mode()
    if mode is None or mode == "never":
        return None
    if mode == "always":
        return True
    import torch

    probe = torch.empty(1 << 20, dtype=torch.float32)  # 4 MiB: above torch's 2 MiB threshold
    flags = _vm_flags(probe.data_ptr())
    return None if flags is None else "hg" in flags


@dataclass(frozen=True)
class MallocTuning:
    applied: bool
    reason: str


def keep_freed_memory() -> MallocTuning:
    """Keep large freed buffers in glibc's heap instead of unmapping them.

    By default glibc serves big requests with a fresh ``mmap`` and unmaps them on ``free``, and
    gives the top of its heap back to the kernel once 128 KiB or more is free there. A prefill
    step's activations (a 2048 x 3072 float32 projection output is 25 MB) were then faulted in
    and zeroed by the kernel at every layer of every step: on the bench's ``mixed`` run that cost
    ~1 s of 11 (prefill projections 350-370 vs 440-455 GFLOP/s with the setting; 2 A/B rounds).
    Requests up to 32 MiB (glibc's ceiling for this threshold) now come from the heap, and the heap
    is trimmed only past 2 GiB free, so the process keeps its peak working set instead of
    returning it: a worker's RSS stays at its high-water mark, like a caching allocator's. Off with
    ``PAGEDSERVE_MALLOC_TUNING=0``; a no-op outside glibc.
    """
    if not MALLOC_TUNING.enabled():
        return MallocTuning(False, f"{MALLOC_ENV}=0")
    if platform.libc_ver()[0] != "glibc":
        return MallocTuning(False, "not glibc")
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return MallocTuning(False, "mallopt unavailable")
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = ok and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        log.warning("mallopt refused the CPU worker's malloc settings; running with glibc defaults")
        return MallocTuning(False, "mallopt refused")
    return MallocTuning(True, "mmap threshold 32 MiB, heap trimmed past 2 GiB free")


def warn_without_huge_pages() -> bool | None:
    """Log a warning when huge pages were asked for (the switch is 1) and are not in effect."""
    got = huge_pages_in_effect()
    if got is False and HUGE_PAGES.raw() == "1":
        log.warning(
            "transparent huge pages are not in effect: torch read %s before it was set (a CPU "
            "tensor was allocated first); set %s=1 in the environment that starts this process "
            "for weights and KV cache on 2 MiB pages", THP_ENV, THP_ENV,
        )  # fmt: skip
    return got


def configure_cpu_process() -> MallocTuning:
    """Both settings, before the weights load."""
    enable_huge_pages()
    return keep_freed_memory()
