"""A/B of the projection GEMM (``kernels/csrc/gemm.c``) between two source trees.

Builds the GEMM library of this tree (``ours``), of ``--base DIR`` (``base``) and a second build
of the base's source with a harmless extra define (``control``: the same code at other
addresses; a change smaller than ``control / base`` is not resolved). Then times, in alternating
rounds in one process, with the same weights and inputs for all three:

* ``hot``: one projection at a time (the fused qkv, fused gate/up and down shapes of
  ``--models``, :data:`bench.gemm_libs.MODELS`: by default the bench model's and SmolLM2's) at
  ``--rows`` rows (a prefill chunk: 2048), its weight in the cache;
* ``cold``: a pass over ``--layers`` layers of SmolLM2's four projections, each its own weight
  (30 layers: 424 MB in float32, past most of these machines' last-level caches), at
  ``--cold-rows`` rows (decode steps).

float32 panels, or with ``--bf16`` bfloat16 ones (on an AMX CPU its tiles, as the engine runs
them; ``--no-amx``: through ``vdpbf16ps`` there too, the path of CPUs without AMX), or with
``--int8`` int8 ones with a scale per 32 inputs (``--weight-dtype int8``). Prints one
JSON line: per case each build's median ms and GFLOP/s, ``ours/base`` and ``control/base``
speeds, and whether ours and the control give outputs bit-identical to the base's (the
kernel's sums are in a fixed order: a change in blocking or code layout keeps them).

``--swiglu``: the gate/up products end in SwiGLU, as the engine runs them: a tree whose binding
has ``pack_glu`` packs them for its SwiGLU product, one without multiplies and then runs the
fused SwiGLU pass (:mod:`kernels.fused`); GFLOP/s still count the products alone.

    python -m bench.gemm_ab --base /tmp/base [--rounds 7] [--rows 2048] [--cold-rows 16,64]
        [--layers 30] [--models bench,smollm2,qwen2-0.5b] [--bf16 [--no-amx] | --int8]
        [--swiglu] [--flags=-mno-avx512f]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from functools import partial

import torch

from bench.common import ab_builds, ab_rounds, add_ab_arguments, emit, tree_module
from bench.gemm_libs import MODELS, model_names
from kernels import fused
from kernels.gemm import NativeGemm, PanelWeight

HOT_SHAPES = ("qkv", "gate_up", "down")


@dataclass
class Case:
    """A pass over ``shapes`` (out, in) products at ``rows`` rows, ``repeats`` times a run."""

    name: str
    shapes: list[tuple[int, int]]
    rows: int
    repeats: int

    @property
    def flop(self) -> float:
        """One pass's multiply-adds, x 2."""
        return sum(2.0 * self.rows * n * k for n, k in self.shapes)


def cases(
    rows: list[int],
    cold_rows: list[int],
    layers: int,
    models: tuple[str, ...] = ("bench", "smollm2"),
) -> list[Case]:
    hot = [
        Case(f"hot {model} {name} x {m}", [MODELS[model][name]], m, 3)
        for m in rows
        for model in models
        for name in HOT_SHAPES
    ]
    smollm2 = list(MODELS["smollm2"].values())
    return hot + [Case(f"cold smollm2 {layers} layers x {m}", smollm2 * layers, m, 1)
                  for m in cold_rows]  # fmt: skip


#: The fused gate/up shapes: with ``--swiglu`` their products end in SwiGLU.
GATE_UP = {shapes["gate_up"] for shapes in MODELS.values()}


@dataclass(frozen=True)
class Product:
    """One packed weight of a build, and with ``--swiglu`` on a gate/up shape whether the build
    still needs the separate SwiGLU pass (a tree without ``NativeGemm.pack_glu``)."""

    weight: PanelWeight
    silu_after: bool = False

    def __call__(self, xs: dict[int, torch.Tensor]) -> torch.Tensor:
        y = self.weight.matmul(xs[self.weight.in_features])
        if self.silu_after:
            ops = fused.load()
            assert ops is not None, "--swiglu needs the fused ops library"
            y = ops.silu_mul(y, y.shape[1] // 2)
        return y


def pack_all(
    libs: dict[str, NativeGemm],
    case: Case,
    bf16: bool,
    amx: bool | None,
    swiglu: bool = False,
    int8: bool = False,
) -> dict[str, list[Product]]:
    """Each build's packing of the same seeded weights (one at a time: no float32 copies kept).
    ``swiglu``: gate/up weights packed for the build's SwiGLU product where it has one
    (``pack_glu``), else multiplied and then passed through the fused SwiGLU op, as that
    tree's engine ran them (float32 only)."""
    gen = torch.Generator().manual_seed(0)
    packed: dict[str, list[Product]] = {name: [] for name in libs}
    for n, k in case.shapes:
        w = torch.randn(n, k, generator=gen) * k**-0.5
        glu = swiglu and (n, k) in GATE_UP
        for name, lib in libs.items():
            if bf16:
                packed[name].append(Product(lib.pack_bf16(w, amx)))
            elif int8:
                packed[name].append(Product(lib.pack_int8(w)))
            elif glu and hasattr(lib, "pack_glu"):
                packed[name].append(Product(lib.pack_glu(w)))
            else:
                packed[name].append(Product(lib.pack(w), silu_after=glu))
    return packed


def run_once(
    products: list[Product], xs: dict[int, torch.Tensor], repeats: int
) -> tuple[float, torch.Tensor]:
    """Seconds per pass over ``products``, and the last pass's outputs (flattened, in order)."""
    outs: list[torch.Tensor] = []
    t0 = time.perf_counter()
    for _ in range(repeats):
        outs = [product(xs) for product in products]
    seconds = (time.perf_counter() - t0) / repeats
    return seconds, torch.cat([y.flatten() for y in outs])


def compare(
    libs: dict[str, NativeGemm],
    case: Case,
    rounds: int,
    bf16: bool,
    amx: bool | None,
    swiglu: bool = False,
    int8: bool = False,
) -> dict[str, object]:
    packed = pack_all(libs, case, bf16, amx, swiglu, int8)
    gen = torch.Generator().manual_seed(1)
    xs = {k: torch.randn(case.rows, k, generator=gen) for k in {k for _, k in case.shapes}}
    runs = {name: partial(run_once, packed[name], xs, case.repeats) for name in libs}
    return {"case": case.name, **ab_rounds(runs, rounds, case.flop)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    add_ab_arguments(ap)
    ap.add_argument("--rows", default="2048", help="hot products' rows, comma list")
    ap.add_argument("--cold-rows", default="16,64", help="cold passes' rows, comma list")
    ap.add_argument("--layers", type=int, default=30, help="SmolLM2 layers of a cold pass")
    ap.add_argument("--models", default="bench,smollm2", help="hot products' shapes (gemm_libs)")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 panels (AVX512-BF16 / AMX)")
    ap.add_argument("--no-amx", action="store_true", help="--bf16 through vdpbf16ps on AMX CPUs")
    ap.add_argument("--int8", action="store_true", help="int8 panels (--weight-dtype int8)")
    ap.add_argument(
        "--swiglu",
        action="store_true",
        help="gate/up products end in SwiGLU (pack_glu where a tree has it)",
    )
    args = ap.parse_args(argv)
    if args.no_amx and not args.bf16:
        ap.error("--no-amx picks a bfloat16 path: give --bf16 too")
    if args.swiglu and (args.bf16 or args.int8):
        ap.error("--swiglu is the float32 SwiGLU product: not with --bf16 or --int8")
    if args.int8 and args.bf16:
        ap.error("--int8 and --bf16 are two weight formats: one at a time")
    torch.set_num_threads(args.threads)
    base_gemm = tree_module(args.base, "kernels/gemm.py", "_ab_base_gemm").NativeGemm
    libs = ab_builds("kernels/csrc/gemm.c", NativeGemm, args.base, args.flags, base_gemm)
    if args.bf16 and not all(lib.bf16 for lib in libs.values()):
        raise SystemExit("--bf16: a build here has no bfloat16 path (AVX512-BF16)")
    rows = [int(r) for r in args.rows.split(",") if r]
    cold_rows = [int(r) for r in args.cold_rows.split(",") if r]
    todo = cases(rows, cold_rows, args.layers, model_names(args.models))
    amx = False if args.no_amx else None  # None: each build's own choice (its tiles if any)
    results = [
        compare(libs, case, args.rounds, args.bf16, amx, args.swiglu, args.int8) for case in todo
    ]
    emit("gemm_ab", {
        "base": str(args.base), "threads": args.threads, "rounds": args.rounds,
        "layers": args.layers, "flags": args.flags, "bf16": args.bf16, "swiglu": args.swiglu,
        "int8": args.int8,
        "amx": args.bf16 and not args.no_amx and libs["ours"].amx,
        "panel_width": libs["ours"].panel_width,
        "results": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
