"""fp32 matmul FLOP/s of this machine with torch on N threads (the MFU denominator).

Each shape is timed through torch's default GEMM (``torch.mm``), through oneDNN with a packed
weight (``_onednn``) and through our C GEMM (``_gemm``, :mod:`kernels.gemm`, where it builds);
the peak is the best of all, so that MFU is measured against the fastest matmul this machine
showed, not the slower of the libraries (on AMD CPUs oneDNN was 2-2.7x faster than the default;
our GEMM beat oneDNN at decode shapes on an AVX2 EPYC and lost at a 2048 square).

python -m bench.peers.peak THREADS RESULT_JSON
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from bench.peers.job import set_threads, write_result

# (rows, inner, cols): a square GEMM (the peak) and decode-shaped linears of the bench model.
SHAPES: dict[str, tuple[int, int, int]] = {
    "square_2048": (2048, 2048, 2048),
    "decode_256x512x1536": (256, 512, 1536),
    "decode_8x512x1536": (8, 512, 1536),
}


def matmul_call(m: int, k: int, n: int, library: str) -> Callable[[], object]:
    """A closure computing one [m, k] x [k, n] product with ``library`` ("mm", "onednn" or
    "gemm")."""
    import torch

    from kernels import gemm
    from worker.models import layers

    a = torch.randn(m, k)
    if library == "mm":
        b, c = torch.randn(k, n), torch.empty(m, n)
        return lambda: torch.mm(a, b, out=c)
    weight = torch.randn(n, k)  # nn.Linear layout, as the engine's projections hold it
    if library == "gemm":
        lib = gemm.load()
        assert lib is not None
        packed = lib.pack(weight)
        return lambda: packed.matmul(a)
    packed_dnn = layers.pack_for_onednn(weight)
    assert packed_dnn is not None
    return lambda: layers.linear(a, packed_dnn)


def gflops(m: int, k: int, n: int, library: str = "mm", min_seconds: float = 0.4) -> float:
    call = matmul_call(m, k, n, library)
    for _ in range(3):
        call()
    best = 0.0
    deadline = time.perf_counter() + min_seconds
    reps = max(1, int(2e8 // (m * k * n)))
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        dt = time.perf_counter() - t0
        best = max(best, 2 * m * k * n * reps / dt / 1e9)
        if time.perf_counter() > deadline:
            return best


def libraries() -> list[str]:
    import torch

    from kernels import gemm
    from worker.models import layers

    libs = ["mm"]
    if layers.pack_for_onednn(torch.zeros(8, 8)) is not None:
        libs.append("onednn")
    if gemm.load() is not None:
        libs.append("gemm")
    return libs


def main() -> None:
    threads, out = int(sys.argv[1]), sys.argv[2]
    set_threads(threads)
    figures = {
        name if lib == "mm" else f"{name}_{lib}": round(gflops(*shape, library=lib), 1)
        for lib in libraries()
        for name, shape in SHAPES.items()
    }
    peak = max(figures.values())
    write_result(out, {"threads": threads, "gflops": figures, "peak_gflops": peak})


if __name__ == "__main__":
    main()
