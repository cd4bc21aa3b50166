"""torch.compile (inductor, CPU) of the layer body against our eager path, on its MLP half:
residual add + RMSNorm, the fused gate/up projection, SiLU x up and the down projection, over
every layer of a model with distinct weights (as a step reads them), at the row counts a step
has. Prints one JSON line.

Why this half: it is all a compiler could take whole. In our eager path each of those ops is
one C call (:mod:`kernels.fused`, :mod:`kernels.gemm`) with one Python dispatch per op; the
attention half calls the paged C kernels through ctypes, which a graph cannot contain (it would
break there), so compiling it would leave the same calls. Three ways, same inputs, alternating:
``ours`` (the engine's modules, weights packed as the model packs them: the C GEMM where it
builds, fused add + RMSNorm and SiLU x up), ``eager`` (the same
block in plain torch: ``F.linear`` on MKL, ``F.rms_norm``, ``F.silu``) and ``inductor``
(``torch.compile`` of that plain block, ``fullgraph``, ``dynamic=False``: one graph per row
count, the fixed buckets an engine would compile; ``freezing`` on, so that the weights are
constants it may prepack). GFLOP/s count the two projections; ``max_abs_diff`` is against
``eager`` (float32).

    python -m bench.inductor_mlp [--models bench,smollm2] [--rows 4,32,2048] [--repeats 10]
        [--layers N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import emit, sig
from kernels import fused
from worker.models.config import ModelConfig
from worker.models.layers import GatedMLP, RMSNorm, swap_for_packed

#: hidden size, intermediate size, layers
MODELS: dict[str, tuple[int, int, int]] = {"bench": (512, 1536, 8), "smollm2": (576, 1536, 30)}
EPS = 1e-5


class MLPBlock(nn.Module):
    """One layer's MLP half in plain torch: ``(r + delta, down(silu(gate) * up))``."""

    def __init__(self, hidden: int, inter: int, gen: torch.Generator) -> None:
        super().__init__()
        self.inter = inter
        self.norm_w = nn.Parameter(torch.rand(hidden, generator=gen) + 0.5, requires_grad=False)
        self.gate_up = nn.Parameter(
            torch.randn(2 * inter, hidden, generator=gen) * 0.02, requires_grad=False
        )
        self.down = nn.Parameter(
            torch.randn(hidden, inter, generator=gen) * 0.02, requires_grad=False
        )

    def forward(self, r: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = r + delta
        h = F.rms_norm(r, (r.shape[-1],), self.norm_w, EPS)
        gate, up = F.linear(h, self.gate_up).split(self.inter, dim=-1)
        return r, F.linear(F.silu(gate) * up, self.down)


class MLPStack(nn.Module):
    def __init__(self, hidden: int, inter: int, layers: int, gen: torch.Generator) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(hidden, inter, gen) for _ in range(layers))

    def forward(self, r: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            r, delta = block(r, delta)
        return r, delta


def ours_fn(stack: MLPStack) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The engine's own modules on the same weights: :class:`RMSNorm` (``add_norm``) and
    :class:`GatedMLP`, their projections packed as the model packs them, the fused C ops on."""
    ops = fused.load()
    if ops is None:
        raise SystemExit("the fused C ops did not build: nothing to compare (a C compiler?)")
    hidden, inter = stack.blocks[0].down.shape
    cfg = ModelConfig(
        family="llama", architecture="inductor_mlp", num_layers=len(stack.blocks), num_heads=1,
        num_kv_heads=1, head_dim=hidden, hidden_size=hidden, intermediate_size=inter,
        vocab_size=1, max_position_embeddings=1, rms_norm_eps=EPS, dtype=torch.float32,
    )  # fmt: skip
    layers: list[tuple[RMSNorm, GatedMLP]] = []
    for b in stack.blocks:
        norm, mlp = RMSNorm(hidden, EPS, torch.float32, "cpu"), GatedMLP(cfg, "cpu")
        norm.weight.data.copy_(b.norm_w)
        mlp.gate_up_weight.data.copy_(b.gate_up)
        mlp.down_weight.data.copy_(b.down)
        swap_for_packed(mlp, "gate_up_weight", glu=True)  # as the engine packs it
        swap_for_packed(mlp, "down_weight")
        layers.append((norm, mlp))

    def run(r: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        r = r.clone()  # add_norm adds in place into a residual it owns
        for norm, mlp in layers:
            r, h = norm.add_norm(r, delta, ops)
            delta = mlp(h, ops)
        return delta

    return run


def measure(model: str, rows: int, layers: int, repeats: int) -> dict[str, object]:
    import torch._inductor.config as inductor_config

    hidden, inter, _ = MODELS[model]
    gen = torch.Generator().manual_seed(0)
    stack = MLPStack(hidden, inter, layers, gen).eval()
    r0 = torch.randn(rows, hidden, generator=gen)
    d0 = torch.randn(rows, hidden, generator=gen) * 0.1
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled = torch.compile(stack, dynamic=False, fullgraph=True)
        with inductor_config.patch(freezing=True):  # compiled at the first call
            compiled(r0, d0)
        compile_s = time.perf_counter() - t0
        ours = ours_fn(stack)
        fns: dict[str, Callable[[], torch.Tensor]] = {
            "ours": lambda: ours(r0, d0),
            "eager": lambda: stack(r0, d0)[1],
            "inductor": lambda: compiled(r0, d0)[1],
        }
        ref = fns["eager"]()
        diff = {n: float((f() - ref).abs().max()) for n, f in fns.items() if n != "eager"}
        times: dict[str, list[float]] = {n: [] for n in fns}
        names = list(fns)
        for rep in range(repeats + 2):  # the first two rounds warm up
            for name in names[rep % 3 :] + names[: rep % 3]:
                t = time.perf_counter()
                fns[name]()
                if rep >= 2:
                    times[name].append(time.perf_counter() - t)
    ms = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    flops = 2 * rows * layers * 3 * hidden * inter
    return {
        "model": model,
        "rows": rows,
        "layers": layers,
        "ms": {n: round(v, 3) for n, v in ms.items()},
        "gflops": {n: round(flops / v / 1e6, 1) for n, v in ms.items()},
        "ours_over_inductor": round(ms["inductor"] / ms["ours"], 2),
        "inductor_over_eager": round(ms["eager"] / ms["inductor"], 2),
        "compile_s": round(compile_s, 1),
        "max_abs_diff": {n: sig(v, 3) for n, v in diff.items()},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bench,smollm2")
    ap.add_argument("--rows", default="4,32,2048")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--layers", type=int, help="instead of the model's own count")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [
        measure(model, int(rows), args.layers or MODELS[model][2], args.repeats)
        for model in args.models.split(",")
        for rows in args.rows.split(",")
    ]
    emit("inductor_mlp", {"threads": args.threads, "results": results})


if __name__ == "__main__":
    main()
