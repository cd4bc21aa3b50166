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
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import emit
from kernels import native
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
    """Alternating rounds (the order rotated each round); medians and ratios against base."""
    times: dict[str, list[float]] = {name: [] for name in kernels}
    outputs: dict[str, torch.Tensor] = {}
    names = list(kernels)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds, outputs[name] = run_once(kernels[name], case, 2)
            times[name].append(seconds)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "case": case.name,
        "ms": {name: round(s * 1e3, 3) for name, s in med.items()},
        "gflops": {name: round(case.flop / s / 1e9, 1) for name, s in med.items()},
        "ours/base": round(med["base"] / med["ours"], 3),
        "control/base": round(med["base"] / med["control"], 3),
        "bit_identical": {n: torch.equal(outputs[n], outputs["base"]) for n in ("ours", "control")},
    }


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


def build(tree: Path, flags: list[str]) -> NativeDecode:
    source = tree / "kernels" / "csrc" / "paged_decode.c"
    return NativeDecode(native.build(source=source, flags=[*native.FLAGS, *flags]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="source tree to compare against")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30, help="K/V caches cycled (from memory)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flags", nargs="*", default=[],
                    help="extra compiler flags of all three builds (-mno-avx512f)")  # fmt: skip
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ours_tree = Path(__file__).resolve().parents[1]
    kernels = {
        "base": build(args.base, args.flags),
        "ours": build(ours_tree, args.flags),
        "control": build(args.base, [*args.flags, "-DPS_AB_CONTROL=1"]),
    }
    results = [compare(kernels, case, args.rounds) for case in cases(args.layers)]
    emit("prefill_ab", {
        "base": str(args.base), "threads": args.threads, "rounds": args.rounds,
        "layers": args.layers, "flags": args.flags, "lanes": kernels["ours"].prefill_lanes,
        "results": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
