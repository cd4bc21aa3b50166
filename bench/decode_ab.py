"""A/B of the C decode kernel (``kernels/csrc/paged_decode.c``) between two source trees, under
the memory traffic the engine gives it.

Why not ``bench.kernels``' cold figures: there one call follows a 128 MB flush, and on a host
whose L3 is larger (300 MB on the Xeon model 207) part of the K/V stays resident: Qwen2-0.5B's
14/2 heads read 35 GB/s there and 24.5 in the engine (``bench.profile_engine``), and a change
that helped the first did not show in the second (bench/README.md, the fiftieth session). Here
each call reads its own layer's K/V, ``--layers`` of them in turn, and before each call the
process reads ``--between-mb`` of other memory (a layer's weights: 60 MB for Qwen2-0.5B in
float32), as the engine's other work evicts a layer's K/V before its next step. This
reproduced the engine's 24 GB/s for 14/2 heads on that host.

Builds the kernel of this tree (``ours``), of ``--base DIR`` (``base``) and the base again
with a define no source reads (``control``: how far a rebuild alone moves the figure), and
times them in alternating rounds on the three shapes the engine runs (Qwen2-0.5B's, SmolLM2's
and the bench model's heads of 64), every row's blocks scattered through its pool. Prints one
JSON line: per case each build's median ms per layer call and GB/s of K/V, the same read by a
plain sum over exactly those blocks (the pool layout's ceiling, ``read_blocks``) and each
build's fraction of it, ``ours/base`` and ``control/base`` speeds, and whether ours and the
control gave outputs bit-identical to the base's (a change of the sums' order gives False).

    python -m bench.decode_ab --base /tmp/base [--rounds 7] [--layers 24] [--between-mb 60]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch

from bench.common import ab_builds, ab_rounds, add_ab_arguments, emit, sig
from bench.kernels import HeadShape, scattered_decode
from kernels.native import DecodeRows, NativeDecode

T = TypeVar("T")


@dataclass
class Case:
    """``rows`` decode rows of ``ctx`` tokens over ``layers`` pools of scattered blocks."""

    name: str
    heads: HeadShape
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    rows: DecodeRows

    @property
    def kv_bytes(self) -> int:
        """K/V bytes one call reads."""
        return int(self.rows.seq_lens.sum()) * 2 * self.heads.kv_heads * self.heads.head_dim * 4

    @property
    def flop(self) -> float:
        """Multiply-adds of the scores and the value sums, as 2 flops each."""
        return 4.0 * self.heads.heads * self.heads.head_dim * int(self.rows.seq_lens.sum())


def make_case(shape: str, rows: int, ctx: int, layers: int) -> Case:
    heads = HeadShape.parse(shape)
    pools = []
    for _ in range(layers):
        meta, k_cache, v_cache, query, _ = scattered_decode(rows, ctx, heads)
        tables = meta.block_tables.to(torch.int32).contiguous()
        pools.append((k_cache, v_cache, query, tables))
    decode_rows = DecodeRows.whole(torch.full((rows,), ctx))
    return Case(f"{shape} heads, {rows} x {ctx}", heads, pools, decode_rows)


def timed_layers(
    case: Case, between: torch.Tensor, call: Callable[..., T]
) -> tuple[float, list[T]]:
    """Seconds per layer of ``call(k, v, query, tables)`` over every layer, each after a read
    of ``between`` (not timed), and the calls' results."""
    total, results = 0.0, list[T]()
    for k_cache, v_cache, query, tables in case.layers:
        between.sum()
        t0 = time.perf_counter()
        results.append(call(k_cache, v_cache, query, tables))
        total += time.perf_counter() - t0
    return total / len(case.layers), results


def run_once(kernel: NativeDecode, case: Case, between: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Seconds per layer call, and the last layer's output with its LSEs appended."""
    scale = case.heads.head_dim**-0.5

    def call(
        k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[1])
        kernel.decode(q, k, v, tables, case.rows, scale, None, out, lse)
        return out, lse

    seconds, results = timed_layers(case, between, call)
    out, lse = results[-1]
    return seconds, torch.cat([out.flatten(), lse.flatten()])


def blocks_read_gbps(kernel: NativeDecode, case: Case, between: torch.Tensor, rounds: int) -> float:
    """GB/s of a plain sum over the blocks the kernel reads, under the same traffic."""

    def call(k: torch.Tensor, v: torch.Tensor, _q: torch.Tensor, tables: torch.Tensor) -> float:
        return kernel.read_blocks(k, v, tables, case.rows)

    seconds = statistics.median(timed_layers(case, between, call)[0] for _ in range(rounds))
    return case.kv_bytes / seconds / 1e9


def compare(
    kernels: dict[str, NativeDecode], case: Case, between: torch.Tensor, rounds: int
) -> dict[str, object]:
    runs = {name: partial(run_once, kernel, case, between) for name, kernel in kernels.items()}
    got = ab_rounds(runs, rounds, case.flop)
    gbps = {name: sig(case.kv_bytes / ms * 1e-6) for name, ms in got["ms"].items()}
    # the fractions of the figures as printed (two decimals of a tiny case's ~0.6 GB/s read
    # were off by ~1% from the unrounded rate the fractions used)
    blocks = sig(blocks_read_gbps(kernels["base"], case, between, rounds))
    return {
        "case": case.name, "kv_gbps": gbps, "blocks_read_gbps": blocks,
        "fraction_of_blocks_read": {name: round(g / blocks, 3) for name, g in gbps.items()},
        **got,
    }  # fmt: skip


#: (heads, rows, context): Qwen2-0.5B's, SmolLM2's and the bench model's heads of 64.
CASES = [("14/2/64", 48, 400), ("9/3/64", 48, 400), ("8/4/64", 64, 512)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    add_ab_arguments(ap)
    ap.add_argument("--layers", type=int, default=24, help="K/V pools read in turn")
    ap.add_argument("--between-mb", type=int, default=60, help="memory read before each call")
    ap.add_argument("--rows", type=int, default=0, help="decode rows of every case (0: its own)")
    ap.add_argument("--ctx", type=int, default=0, help="tokens of every row (0: the case's own)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = ab_builds("kernels/csrc/paged_decode.c", NativeDecode, args.base, args.flags)
    between = torch.ones(max(1, args.between_mb << 18))
    results = []
    for shape, rows, ctx in CASES:  # one case's pools at a time (1.6 GB for 8/4 at 24 layers)
        case = make_case(shape, args.rows or rows, args.ctx or ctx, args.layers)
        results.append(compare(kernels, case, between, args.rounds))
    emit("decode_ab", {
        "base": str(args.base), "threads": args.threads, "rounds": args.rounds,
        "layers": args.layers, "between_mb": args.between_mb, "flags": args.flags,
        "results": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
