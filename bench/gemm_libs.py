"""Projection GEMMs per library and shape: MKL (``F.linear``), oneDNN (packed and plain weights)
and our C GEMM (``native_gemm``, :mod:`kernels.gemm`, where it builds), at the row counts an
engine step has, hot and cold. Prints one JSON line.

Why: which library is faster depends on the CPU and the shape (on the AMD machines of earlier
sessions oneDNN won most decode shapes by 1.5-2x; on an Intel Xeon it did not everywhere), so
the choice is measured, not assumed. ``hot``: one weight, timed in a loop (it sits in the
cache); ``cold``: every projection of ``--layers`` layers with distinct weights in turn, as a
decode step reads them (larger than the last-level cache for SmolLM2's 30 layers). GFLOP/s
count 2 x rows x out x in per product; every path's result is checked against ``F.linear``.

    python -m bench.gemm_libs [--models bench,smollm2] [--rows 8,16,48,96,256,1024,2048]
        [--layers 30] [--threads 2] [--min-seconds 0.25] [--bf16] [--int8]

``--bf16`` adds ``onednn_bf16``: the weight rounded to bfloat16, the input cast per call, the
output cast back (other numerics: never a default, measured beside the float32 paths), and
``native_bf16``, our C GEMM's bfloat16 path where the CPU has AVX512-BF16 (its AMX tiles where
the CPU has AMX; ``native_bf16_vdp`` then is the same panels through ``vdpbf16ps``).
``--int8`` adds ``native_int8``: our C GEMM over int8 weights with a scale per 32 inputs of a row
(``--weight-dtype int8``, float32 inputs and sums; other numerics too), and in the cold pass
``int8_speedup``, the float32 C GEMM's time over its.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import emit
from kernels import gemm
from worker.models import layers
from worker.models.layers import linear

#: Projection shapes (out, in) of the fused qkv, o, fused gate/up and down products.
MODELS: dict[str, dict[str, tuple[int, int]]] = {
    "bench": {"qkv": (1024, 512), "o": (512, 512), "gate_up": (3072, 512), "down": (512, 1536)},
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    # Qwen2-0.5B (make_model's qwen2-0.5b preset): a K of 4864 in the down product
    "qwen2-0.5b": {
        "qkv": (1152, 896),
        "o": (896, 896),
        "gate_up": (9728, 896),
        "down": (896, 4864),
    },
}


def model_names(text: str) -> tuple[str, ...]:
    """``--models``' comma list, each a key of :data:`MODELS` (else SystemExit naming them)."""
    names = tuple(m for m in text.split(",") if m)
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {', '.join(unknown)} (known: {', '.join(MODELS)})")
    return names


LIBRARIES = (
    "mkl",
    "onednn_packed",
    "onednn_plain",
    "native_gemm",
    "onednn_bf16",
    "native_bf16",
    "native_bf16_vdp",
    "native_int8",
)


def best_seconds(fn: Callable[[], object], min_seconds: float) -> float:
    for _ in range(2):
        fn()
    best, deadline = float("inf"), time.perf_counter() + min_seconds
    while True:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() >= deadline:
            return best


def bf16_product(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``--bf16``: the engine's ``--weight-dtype bfloat16`` product through oneDNN
    (:class:`worker.models.layers.Bf16Weight`: AMX's ``brg_matmul`` where the CPU has it);
    None where this torch or CPU has no oneDNN bfloat16 linear."""
    packed = layers.Bf16Weight.pack(weight, use_native=False)
    return None if packed is None else packed.matmul


def products(
    weight: torch.Tensor, bf16: bool = False, int8: bool = False
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each library's ``x -> x @ weight.T`` (with ``bf16`` also :func:`bf16_product`'s, with
    ``int8`` the C GEMM's int8 weights')."""
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "mkl": lambda x: F.linear(x, weight),
        "onednn_plain": lambda x: linear(x, weight),
    }
    packed = layers.pack_for_onednn(weight)
    if packed is not None:
        out["onednn_packed"] = lambda x: linear(x, packed)
    lib = gemm.load()
    if lib is not None:
        panels = lib.pack(weight)
        out["native_gemm"] = panels.matmul
    if bf16 and (fn := bf16_product(weight)) is not None:
        out["onednn_bf16"] = fn
    if bf16 and lib is not None and lib.bf16:
        out["native_bf16"] = lib.pack_bf16(weight).matmul
    if bf16 and lib is not None and lib.amx:  # the same panels through vdpbf16ps: the A/B
        out["native_bf16_vdp"] = lib.pack_bf16(weight, amx=False).matmul
    if int8 and lib is not None:
        out["native_int8"] = lib.pack_int8(weight).matmul
    return out


def check(fns: dict[str, Callable[[torch.Tensor], torch.Tensor]], weight: torch.Tensor) -> None:
    """Every path against ``F.linear`` (bfloat16's 8-bit mantissa and int8 weights: a looser
    bound for them).

    float32 paths within 2^-17 of the largest sum of |x_k w_k| (a few ulps per term of a
    1536-term dot product summed in another order): a fixed 1e-4 was within 10% of what
    oneDNN's order gives near-zero outputs, and failed now and then."""
    x = torch.randn(5, weight.shape[1])
    want = F.linear(x, weight)
    terms = (x.abs() @ weight.abs().T).max().item()
    for name, fn in fns.items():
        lossy = "bf16" in name or "int8" in name
        tol = 5e-2 * want.abs().max().item() if lossy else 2**-17 * terms
        torch.testing.assert_close(fn(x), want, atol=tol, rtol=1e-4, msg=name)


def hot(
    model: str, rows: list[int], min_s: float, bf16: bool, int8: bool = False
) -> dict[str, dict[str, float]]:
    got: dict[str, dict[str, float]] = {}
    for proj, (n, k) in MODELS[model].items():
        weight = torch.randn(n, k)
        fns = products(weight, bf16, int8)
        check(fns, weight)
        for m in rows:
            x = torch.randn(m, k)
            gf = {lib: 2 * m * n * k / best_seconds(lambda f=f, x=x: f(x), min_s) / 1e9
                  for lib, f in fns.items()}  # fmt: skip
            got[f"{proj}.{m}"] = {lib: round(v, 1) for lib, v in gf.items()}
            got[f"{proj}.{m}"]["best"] = max(gf, key=gf.__getitem__)  # type: ignore[assignment]
    return got


def cold(
    model: str, rows: list[int], layers: int, min_s: float, bf16: bool, int8: bool = False
) -> dict[str, dict[str, float]]:
    """Milliseconds for one pass over every projection of ``layers`` layers."""
    shapes = MODELS[model]
    per_layer = [{p: products(torch.randn(n, k), bf16, int8) for p, (n, k) in shapes.items()}
                 for _ in range(layers)]  # fmt: skip
    got: dict[str, dict[str, float]] = {}
    for m in rows:
        xs = {p: torch.randn(m, k) for p, (_, k) in shapes.items()}
        got[str(m)] = {}
        for lib in LIBRARIES:
            if lib not in per_layer[0]["qkv"]:
                continue

            def one_pass(lib: str = lib, xs: dict[str, torch.Tensor] = xs) -> None:
                for layer in per_layer:
                    for p, fns in layer.items():
                        fns[lib](xs[p])

            got[str(m)][f"{lib}_ms"] = round(best_seconds(one_pass, min_s) * 1e3, 2)
        row = got[str(m)]
        if row.get("native_int8_ms"):
            row["int8_speedup"] = round(row["native_gemm_ms"] / row["native_int8_ms"], 3)
    return got


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--models", default="bench,smollm2")
    ap.add_argument("--rows", default="8,16,48,96,256,1024,2048")
    ap.add_argument("--cold-rows", default="16,48,96")
    ap.add_argument("--layers", type=int, default=30, help="layers of the cold pass")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-seconds", type=float, default=0.25, help="per timing")
    bf16 = "also bfloat16 weights and inputs through oneDNN (other numerics)"
    ap.add_argument("--bf16", action="store_true", help=bf16)
    int8 = "also int8 weights (a scale per 32 inputs of a row) through the C GEMM (other numerics)"
    ap.add_argument("--int8", action="store_true", help=int8)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(x) for x in args.rows.split(",") if x]
    cold_rows = [int(x) for x in args.cold_rows.split(",") if x]
    models = {
        model: {
            "hot_gflops": hot(model, rows, args.min_seconds, args.bf16, args.int8),
            "cold_pass": cold(
                model, cold_rows, args.layers, args.min_seconds, args.bf16, args.int8
            ),
        }
        for model in model_names(args.models)
    }
    emit("gemm_libs", {"threads": args.threads, "layers": args.layers, "models": models})


if __name__ == "__main__":
    main()
