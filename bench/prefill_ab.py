"""A/B of the tiled prefill kernel (``kernels/csrc/paged_prefill.h``) between two source trees.

Builds the C kernel library of this tree (``ours``), of ``--base DIR`` (``base``) and a second
build of the base's source with a harmless extra define (``control``: the same code at other
addresses; on these machines two builds of one source have differed by a few percent, so a
change smaller than ``control / base`` is not resolved). Then times, in alternating rounds in
one process, the kernel's two modes on shapes the engine runs:

* ``causal``: prefill chunks (fresh prompts, and short chunks after a long cached context: the
  suffixes of ``shared-prefix`` prompts);
* ``shared``: a cascade group (decode rows that all see one shared prefix, ``all_keys``).

K/V are cycled over ``--layers`` separate caches (as each layer's come from memory in the
engine). Prints one JSON line: per case the median ms of each build, GFLOP/s of attention
(4 x heads x head_dim per query-key pair), ``ours/base`` and ``control/base`` speeds, and
whether ours and the control give outputs bit-identical to the base's.

    python -m bench.prefill_ab --base /tmp/base [--rounds 7] [--layers 30] [--flags ...]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from functools import partial

import torch

from bench.common import ab_builds, ab_rounds, add_ab_arguments, emit
from kernels.native import NativeDecode, PrefillChunks
from kernels.testing import make_metadata

BLOCK_SIZE = 16


@dataclass
class Case:
    """One kernel call's inputs, with ``layers`` K/V caches to cycle through."""

    name: str
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    table: torch.Tensor
    query: torch.Tensor
    chunks: PrefillChunks
    flop: float
    query_rows: torch.Tensor | None = None  # shared mode only


def _tables(
    query_lens: list[int], seq_lens: list[int], gen: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Block tables over shuffled block ids (the pool's order after a while), and the pool size."""
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 4
    meta = make_metadata(query_lens, seq_lens, BLOCK_SIZE, num_blocks, gen)
    return meta.block_tables, num_blocks


def _caches(
    num_blocks: int, kv_heads: int, head_dim: int, layers: int, gen: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
            for _ in range(layers)]  # fmt: skip


def causal_case(
    name: str, q_lens: list[int], ctx: list[int], heads: tuple[int, int, int], layers: int
) -> Case:
    """Chunks of ``q_lens`` tokens after ``ctx`` cached tokens each."""
    num_heads, kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(0)
    seq = [q + c for q, c in zip(q_lens, ctx, strict=True)]
    table, num_blocks = _tables(q_lens, seq, gen)
    starts = [0]
    for n in q_lens[:-1]:
        starts.append(starts[-1] + n)
    chunks = PrefillChunks(
        starts=torch.tensor(starts), query_lens=torch.tensor(q_lens),
        seq_lens=torch.tensor(seq), seq_index=torch.arange(len(q_lens)),
    )  # fmt: skip
    pairs = sum(q * c + q * (q + 1) // 2 for q, c in zip(q_lens, ctx, strict=True))
    return Case(
        name, _caches(num_blocks, kv_heads, head_dim, layers, gen), table,
        torch.randn(sum(q_lens), num_heads, head_dim, generator=gen), chunks,
        4.0 * num_heads * head_dim * pairs,
    )  # fmt: skip


def shared_case(
    name: str, rows: int, prefix: int, heads: tuple[int, int, int], layers: int
) -> Case:
    """``rows`` decode rows (every other row of the batch) over one ``prefix``-token prefix."""
    num_heads, kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(1)
    table, num_blocks = _tables([rows], [prefix], gen)
    chunks = PrefillChunks(
        starts=torch.tensor([0]), query_lens=torch.tensor([rows]),
        seq_lens=torch.tensor([prefix]), seq_index=torch.tensor([0]),
    )  # fmt: skip
    return Case(
        name, _caches(num_blocks, kv_heads, head_dim, layers, gen), table,
        torch.randn(2 * rows, num_heads, head_dim, generator=gen), chunks,
        4.0 * num_heads * head_dim * rows * prefix, torch.arange(0, 2 * rows, 2),
    )  # fmt: skip


def run_once(kernel: NativeDecode, case: Case, repeats: int) -> tuple[float, torch.Tensor]:
    """Seconds per call (every layer ``repeats`` times) and the last output (with the LSEs
    appended in shared mode)."""
    q = case.query
    rows = q.shape[0] if case.query_rows is None else case.query_rows.shape[0]
    out = torch.empty(rows, q.shape[1], q.shape[2])
    lse = None if case.query_rows is None else torch.empty(rows, q.shape[1])
    scale = q.shape[2] ** -0.5
    t0 = time.perf_counter()
    for _ in range(repeats):
        for k_cache, v_cache in case.caches:
            kernel.prefill(q, k_cache, v_cache, case.table, case.chunks, scale, out, lse,
                           case.query_rows)  # fmt: skip
    seconds = (time.perf_counter() - t0) / repeats / len(case.caches)
    return seconds, out if lse is None else torch.cat([out.flatten(), lse.flatten()])


def compare(kernels: dict[str, NativeDecode], case: Case, rounds: int) -> dict[str, object]:
    """Alternating rounds (:func:`bench.common.ab_rounds`); medians and ratios against base."""
    runs = {name: partial(run_once, kernel, case, 2) for name, kernel in kernels.items()}
    return {"case": case.name, **ab_rounds(runs, rounds, case.flop)}


def cases(layers: int) -> list[Case]:
    smol, bench = (9, 3, 64), (8, 4, 64)
    return [
        causal_case("causal 4 x 512 fresh, 9/3", [512] * 4, [0] * 4, smol, max(4, layers // 4)),
        causal_case("causal 16 x 128 fresh, 8/4", [128] * 16, [0] * 16, bench, layers),
        causal_case("causal 48 x 40 after 1024, 9/3", [40] * 48, [1024] * 48, smol, layers),
        causal_case("causal 96 x 40 after 1024, 8/4", [40] * 96, [1024] * 96, bench, layers),
        shared_case("shared 48 rows x 1024, 9/3", 48, 1024, smol, layers),
        shared_case("shared 96 rows x 1024, 8/4", 96, 1024, bench, layers),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    add_ab_arguments(ap)
    ap.add_argument("--layers", type=int, default=30, help="K/V caches cycled (from memory)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = ab_builds("kernels/csrc/paged_decode.c", NativeDecode, args.base, args.flags)
    results = [compare(kernels, case, args.rounds) for case in cases(args.layers)]
    emit("prefill_ab", {
        "base": str(args.base), "threads": args.threads, "rounds": args.rounds,
        "layers": args.layers, "flags": args.flags, "lanes": kernels["ours"].prefill_lanes,
        "results": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
