"""fp32 matmul FLOP/s of this machine with torch on N threads (the MFU denominator).

python -m bench.peers.peak THREADS RESULT_JSON
"""

from __future__ import annotations

import sys
import time

from bench.peers.job import set_threads, write_result

# (rows, inner, cols): a square GEMM (the peak) and decode-shaped linears of the bench model.
SHAPES: dict[str, tuple[int, int, int]] = {
    "square_2048": (2048, 2048, 2048),
    "decode_256x512x1536": (256, 512, 1536),
    "decode_8x512x1536": (8, 512, 1536),
}


def gflops(m: int, k: int, n: int, min_seconds: float = 0.4) -> float:
    import torch

    a = torch.randn(m, k)
    b = torch.randn(k, n)
    c = torch.empty(m, n)
    for _ in range(3):
        torch.mm(a, b, out=c)
    best = 0.0
    deadline = time.perf_counter() + min_seconds
    reps = max(1, int(2e8 // (m * k * n)))
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=c)
        dt = time.perf_counter() - t0
        best = max(best, 2 * m * k * n * reps / dt / 1e9)
        if time.perf_counter() > deadline:
            return best


def main() -> None:
    threads, out = int(sys.argv[1]), sys.argv[2]
    set_threads(threads)
    figures = {name: round(gflops(*shape), 1) for name, shape in SHAPES.items()}
    peak = max(figures.values())
    write_result(out, {"threads": threads, "gflops": figures, "peak_gflops": peak})


if __name__ == "__main__":
    main()
