"""Helpers shared by the benchmarks: every benchmark ends by printing one JSON line."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # torch only where an A/B runs: the Redis benches do without it
    import torch

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


def has_avx512() -> bool:
    """Whether this CPU has AVX-512F (where the kernels' 16-float builds run natively)."""
    return "avx512f" in cpu_info().get("cpu_flags", [])


def sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant figures: a tiny model on a loaded host (or a test's tiny
    case) reads K/V at a few hundredths of a GB/s, where two decimals would keep one digit."""
    return float(f"{x:.{digits}g}")


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


_Lib = TypeVar("_Lib")


def add_ab_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every A/B of a C kernel between two source trees takes."""
    ap.add_argument("--base", type=Path, required=True, help="source tree to compare against")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    flags_help = "extra compiler flags of all three builds: --flags=-mno-avx512f"
    ap.add_argument("--flags", nargs="*", default=[], help=flags_help)


def ab_builds(
    source: str,
    load: Callable[[Path], _Lib],
    base: Path,
    flags: list[str],
    base_load: Callable[[Path], _Lib] | None = None,
) -> dict[str, _Lib]:
    """The C library of ``source`` (a path in a tree, ``kernels/csrc/gemm.c``) built from the
    base tree, from this one (``ours``) and from the base again with a define no source reads
    (``control``: the same code loaded again elsewhere), each opened by ``load`` (the base's
    two by ``base_load`` where given: the base tree's own binding, for a change of the
    library's arguments)."""
    from kernels import native

    def build(tree: Path, extra: list[str], opener: Callable[[Path], _Lib]) -> _Lib:
        return opener(native.build(source=tree / source, flags=[*native.FLAGS, *flags, *extra]))

    ours = Path(__file__).resolve().parents[1]
    at_base = base_load or load
    return {"base": build(base, [], at_base), "ours": build(ours, [], load),
            "control": build(base, ["-DPS_AB_CONTROL=1"], at_base)}  # fmt: skip


def tree_module(tree: Path, relative: str, name: str) -> Any:
    """The module at ``tree / relative`` loaded under ``name`` (another checkout's copy of one
    of ours, beside ours; its own imports resolve to this tree's modules)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, tree / relative)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {tree / relative}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


#: One timed run of a build: seconds per unit of work, and its result (compared bit for bit).
Run = Callable[[], "tuple[float, torch.Tensor]"]


def ab_rounds(runs: dict[str, Run], rounds: int, work_flop: float) -> dict[str, Any]:
    """Builds ``ours``, ``base`` and ``control`` (base's source built again with a harmless
    define: the same code at other addresses, so ``control/base`` shows how far a build change
    alone moves the figure) in alternating rounds, the order rotated each round; each build's
    median ms and GFLOP/s, ``ours/base`` and ``control/base`` speeds, and whether ours and the
    control gave results bit-identical to the base's."""
    import torch

    times: dict[str, list[float]] = {name: [] for name in runs}
    results: dict[str, torch.Tensor] = {}
    names = list(runs)
    for name in names:  # untimed: the first calls paid for page faults and a cold cache
        runs[name]()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds, results[name] = runs[name]()
            times[name].append(seconds)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "ms": {name: round(s * 1e3, 3) for name, s in med.items()},
        "gflops": {name: round(work_flop / s / 1e9, 1) for name, s in med.items()},
        "ours/base": round(med["base"] / med["ours"], 3),
        "control/base": round(med["base"] / med["control"], 3),
        "bit_identical": {n: torch.equal(results[n], results["base"]) for n in ("ours", "control")},
    }
