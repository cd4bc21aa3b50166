"""Attention-kernel micro-benchmark for the torch (CPU) backend: prints one JSON line.

Per layer, fp32, 8 query heads / 4 KV heads / head_dim 64 / block_size 16 (the model the
project benchmarks):

* decode at (batch 64, ctx 512), (batch 256, ctx 256) and one sequence of 4000 tokens (batch 1:
  the C kernel splits a row's blocks into runs across the threads, while ``read_blocks`` sums a
  row on one thread, so its ``cold_fraction_of_blocks_read`` can pass 1): milliseconds,
  achieved GB/s of K/V read, and the ratio against a dense SDPA over contiguous K/V of the same
  shape (same process);
  ``ms`` is the backend as the engine runs it (the C decode kernel when it builds: ``native``),
  ``torch_path_ms`` the pure-torch path on the same batch;
* prefill of 512 fresh tokens, and a 512-token chunk after 512 cached tokens;
* ``shared_prefix``: 32 decodes sharing 1024 cached tokens (the same physical blocks) plus 32
  private tokens each, the cascade path against every sequence reading the shared blocks itself
  (``gathered_ms``: through the C kernel when it is built, else gathered in torch);
* the machine's memcpy bandwidth (bytes read per second while copying a buffer the size of the
  decode K/V) and its read bandwidth (a sum over such a buffer: ``read_gbps``; the decode's
  ``fraction_of_read`` is the K/V read rate over it), measured alongside, since the machine is
  shared and its bandwidth drifts; back to back, so a K/V near the last-level cache's size is
  partly read from there. ``cold_*``: the kernel and the sum alternating, each after a read of
  a 128 MB buffer, so both from DRAM (every layer of the engine reads its K/V cold);
  ``cold_fraction_of_read`` is the issue's measure. ``cold_blocks_read_gbps``: a plain sum over
  exactly the scattered blocks the kernel reads (same rows, order and threads, the next block
  prefetched), the ceiling the pool's layout sets; ``cold_fraction_of_blocks_read`` the
  kernel's rate over it. ``cold_inorder_kv_gbps``: the kernel over the same K/V with each row's
  blocks consecutive in the pool (a fresh pool's layout; the random one is the steady state, see
  :func:`inorder_tables`), and ``inorder_over_scattered`` the speed-up that layout gives it.

Runs with transparent huge pages on large tensors, as the engine does (``worker.cpu_memory``):
set before torch allocates anything; ``THP_MEM_ALLOC_ENABLE=0`` in the environment opts out.

With ``--triton`` (CUDA only) it times the Triton kernels instead, bf16, 32 / 8 / 128 heads: the
decode at batch 64 and 256 x contexts 1k and 4k, against a plain sum over the same number of bytes
(``fraction_of_read``) and a device-to-device copy (``d2d_copy_moved_gbps``, read + written), and
prefill chunks (``tflops``: the attention's products over the keys each query sees).

``--shapes 9/3/64,14/2/64`` adds the decode rows for other head shapes (batch 48 x 400 and
64 x 512: ``decode_by_shape``). ``--kv-bf16`` adds ``decode_bf16_cache``: per shape and size,
the C decode kernel over a float32 cache and over its bfloat16 copy (``--kv-cache-dtype
bfloat16``: the kernel's bfloat16 build), alternating, each from DRAM: milliseconds, K/V GB/s
(of each cache's own bytes), ``speedup`` (float32 time over bfloat16 time) and the bfloat16
build's plain sum over the same blocks (``bf16_fraction_of_blocks_read``). Prints the CPU kind
beside the figures (``bench.common.emit``).

Usage: ``python -m bench.kernels [--repeats N] [--threads N] [--shapes H/KV/D,...] [--kv-bf16]
[--triton]``
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from bench.common import emit
from kernels import native as native_kernel
from kernels.metadata import AttentionMetadata
from kernels.native import DecodeRows
from kernels.testing import make_batch, make_metadata, share_prefix
from kernels.torch_backend import TorchBackend
from worker.cpu_memory import enable_huge_pages, huge_pages_in_effect

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 64, 16


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def memcpy_gbps(num_bytes: int, repeats: int) -> float:
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)
    return num_bytes / median_seconds(lambda: dst.copy_(src), repeats) / 1e9


def read_gbps(num_bytes: int, repeats: int) -> float:
    """Memory-read bandwidth on a buffer as large as the K/V read (a sum: reads, no writes)."""
    src = torch.randn(num_bytes // 4)
    return num_bytes / median_seconds(src.sum, repeats) / 1e9


def cold_gbps(
    fns: dict[str, Callable[[], object]],
    num_bytes: int,
    repeats: int,
    flush_bytes: int = 128 << 20,
) -> dict[str, float]:
    """GB/s of each of ``fns`` (all reading ``num_bytes``) from DRAM: each timed call follows a
    read of an unrelated buffer larger than any last-level cache, and the calls alternate.

    Why beside the warm figures: a K/V near the L3's size stays partly resident across
    back-to-back calls (a contiguous sum's buffer more so than a scattered block pool), so the
    warm fraction compares unlike things; in the engine every layer's K/V is cold (the other
    layers' K/V and weights pass in between)."""
    flush = torch.ones(flush_bytes // 4)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats + 1):
        for name, fn in fns.items():
            flush.sum()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    rates = {}
    for name, got in times.items():
        got = sorted(got[1:])  # the first round warms code paths
        rates[name] = num_bytes / got[len(got) // 2] / 1e9
    return rates


@dataclass
class DecodeResult:
    batch: int
    ctx: int
    ms: float
    kv_gbps: float
    native: bool
    torch_path_ms: float
    dense_sdpa_ms: float
    ratio_vs_dense: float
    memcpy_gbps: float
    fraction_of_memcpy: float
    read_gbps: float
    fraction_of_read: float  # K/V read rate over the machine's read rate, both warm
    cold_kv_gbps: float  # the same two from DRAM (cold_gbps): what a layer of the engine sees
    cold_read_gbps: float
    cold_fraction_of_read: float  # the measure
    #: A sum over exactly the blocks the kernel reads, in its order and threads (the C library's
    #: ``read_blocks``), from DRAM: the pool layout's ceiling; 0 without the C kernel.
    cold_blocks_read_gbps: float
    cold_fraction_of_blocks_read: float
    #: The kernel over the same K/V with every row's blocks consecutive (:func:`inorder_tables`),
    #: from DRAM; and its speed over the scattered layout's (0 without the C kernel).
    cold_inorder_kv_gbps: float
    inorder_over_scattered: float


def inorder_tables(tables: torch.Tensor, blocks_per_row: int) -> torch.Tensor:
    """Block tables shaped like ``tables`` whose rows each take ``blocks_per_row`` consecutive
    blocks of the pool, row after row.

    Why both layouts: the random one (:func:`kernels.testing.make_metadata`) is the worst case
    and what a worker's tables looked like once its pool had turned over before tables grew in
    place (``bench.kv_layout``: the engine on five waves of the ``mixed`` workload, bench model,
    a 1,320-block pool: 2-4% of consecutive table entries adjacent from the fourth wave on; 43-45%
    since, plus 16-18% descending), so it stays the headline figure; the consecutive one
    tells how much of the gap to the read is the scatter (the hardware prefetchers restart at
    every block) rather than the kernel's own work."""
    rows = tables.shape[0]
    ids = torch.arange(rows * blocks_per_row, dtype=torch.int32).view(rows, blocks_per_row)
    out = torch.zeros_like(tables)
    out[:, :blocks_per_row] = ids
    return out.contiguous()


@dataclass(frozen=True)
class HeadShape:
    """Query heads, KV heads, head_dim of one attention layer."""

    heads: int = NUM_HEADS
    kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM

    @classmethod
    def parse(cls, text: str) -> HeadShape:
        """``"9/3/64"`` (SmolLM2), ``"14/2/64"`` (Qwen2-0.5B), ``"32/8/128"``."""
        heads, kv, dim = (int(x) for x in text.split("/"))
        if heads % kv:
            raise argparse.ArgumentTypeError(f"{text}: heads must be a multiple of KV heads")
        return cls(heads, kv, dim)


def scattered_decode(
    batch: int, ctx: int, heads: HeadShape
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    """``batch`` decode rows of ``ctx`` tokens each, their blocks scattered randomly through a
    float32 pool: (metadata, keys, values, queries, the generator for anything else)."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = batch * ((ctx + BLOCK_SIZE - 1) // BLOCK_SIZE) + 16
    meta = make_metadata([1] * batch, [ctx] * batch, BLOCK_SIZE, num_blocks, gen)
    shape = (num_blocks, BLOCK_SIZE, heads.kv_heads, heads.head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    query = torch.randn(batch, heads.heads, heads.head_dim, generator=gen)
    return meta, k_cache, v_cache, query, gen


def bench_decode(
    batch: int, ctx: int, repeats: int, heads: HeadShape = HeadShape()
) -> DecodeResult:
    """Decode tokens whose contexts are scattered randomly through a pool of blocks."""
    H, KV, D = heads.heads, heads.kv_heads, heads.head_dim
    meta, k_cache, v_cache, query, gen = scattered_decode(batch, ctx, heads)
    key = torch.randn(batch, KV, D, generator=gen)
    value = torch.randn(batch, KV, D, generator=gen)
    scale = D**-0.5

    def attention(backend: TorchBackend) -> Callable[[], torch.Tensor]:
        return lambda: backend.paged_attention(query, key, value, k_cache, v_cache, meta, scale)

    def timed(backend: TorchBackend) -> float:
        return median_seconds(attention(backend), repeats)

    backend = TorchBackend()
    ours = timed(backend)
    torch_path = timed(TorchBackend(native=False))
    k_dense = torch.randn(batch, KV, ctx, D, generator=gen)
    v_dense = torch.randn(batch, KV, ctx, D, generator=gen)
    q_dense = query.unsqueeze(2)
    dense = median_seconds(
        lambda: F.scaled_dot_product_attention(q_dense, k_dense, v_dense, enable_gqa=True),
        repeats,
    )
    kv_bytes = 2 * batch * ctx * KV * D * 4
    copy = memcpy_gbps(kv_bytes, repeats)
    read = read_gbps(kv_bytes, repeats)
    gbps = kv_bytes / ours / 1e9
    src = torch.randn(kv_bytes // 4)
    cold_fns = {"kv": attention(backend), "read": src.sum}
    kernel = native_kernel.load()
    if kernel is not None:
        rows = DecodeRows.whole(torch.full((batch,), ctx))
        tables = meta.block_tables.to(torch.int32).contiguous()
        cold_fns["blocks"] = lambda: kernel.read_blocks(k_cache, v_cache, tables, rows)
        inorder = inorder_tables(tables, (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE)
        out, lse = torch.empty_like(query), torch.empty(batch, H)
        cold_fns["inorder"] = lambda: kernel.decode(
            query, k_cache, v_cache, inorder, rows, scale, None, out, lse
        )
    cold = cold_gbps(cold_fns, kv_bytes, repeats)
    cold_kv, cold_read, blocks = cold["kv"], cold["read"], cold.get("blocks", 0.0)
    cold_inorder = cold.get("inorder", 0.0)
    return DecodeResult(
        batch=batch,
        ctx=ctx,
        ms=round(ours * 1e3, 3),
        kv_gbps=round(gbps, 2),
        native=backend.uses_native,
        torch_path_ms=round(torch_path * 1e3, 3),
        dense_sdpa_ms=round(dense * 1e3, 3),
        ratio_vs_dense=round(ours / dense, 3),
        memcpy_gbps=round(copy, 2),
        fraction_of_memcpy=round(gbps / copy, 3),
        read_gbps=round(read, 2),
        fraction_of_read=round(gbps / read, 3),
        cold_kv_gbps=round(cold_kv, 2),
        cold_read_gbps=round(cold_read, 2),
        cold_fraction_of_read=round(cold_kv / cold_read, 3),
        cold_blocks_read_gbps=round(blocks, 2),
        cold_fraction_of_blocks_read=round(cold_kv / blocks, 3) if blocks else 0.0,
        cold_inorder_kv_gbps=round(cold_inorder, 2),
        inorder_over_scattered=round(cold_inorder / cold_kv, 3) if cold_inorder else 0.0,
    )


def bench_decode_bf16_cache(
    batch: int, ctx: int, repeats: int, heads: HeadShape = HeadShape()
) -> dict[str, float | int]:
    """The C decode kernel over a float32 cache against its bfloat16 build over the same keys
    and values rounded to bfloat16 (same scattered tables, rows and threads), from DRAM."""
    f32, bf16 = native_kernel.load(), native_kernel.load(torch.bfloat16)
    if f32 is None or bf16 is None:
        return {}
    H, KV, D = heads.heads, heads.kv_heads, heads.head_dim
    meta, k32, v32, query, _ = scattered_decode(batch, ctx, heads)
    k16, v16 = k32.to(torch.bfloat16), v32.to(torch.bfloat16)
    rows = DecodeRows.whole(torch.full((batch,), ctx))
    tables = meta.block_tables.to(torch.int32).contiguous()
    out, lse = torch.empty_like(query), torch.empty(batch, H)
    scale = D**-0.5
    kv_bytes = 2 * batch * ctx * KV * D * 4  # float32's; the bfloat16 cache holds half
    cold = cold_gbps(
        {
            "f32": lambda: f32.decode(query, k32, v32, tables, rows, scale, None, out, lse),
            "bf16": lambda: bf16.decode(query, k16, v16, tables, rows, scale, None, out, lse),
            "bf16_blocks": lambda: bf16.read_blocks(k16, v16, tables, rows),
        },
        kv_bytes,
        repeats,
    )
    ms = {name: kv_bytes / rate / 1e6 for name, rate in cold.items()}
    return {
        **asdict(heads),
        "batch": batch,
        "ctx": ctx,
        "f32_ms": round(ms["f32"], 3),
        "bf16_ms": round(ms["bf16"], 3),
        "f32_kv_gbps": round(cold["f32"], 2),
        "bf16_kv_gbps": round(cold["bf16"] / 2, 2),
        "speedup": round(ms["f32"] / ms["bf16"], 3),
        "bf16_blocks_read_gbps": round(cold["bf16_blocks"] / 2, 2),
        "bf16_fraction_of_blocks_read": round(cold["bf16"] / cold["bf16_blocks"], 3),
    }


def bench_prefill(chunk: int, prefix: int, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    seq_len = prefix + chunk
    num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE + 4
    meta = make_metadata([chunk], [seq_len], BLOCK_SIZE, num_blocks, gen)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    query = torch.randn(chunk, NUM_HEADS, HEAD_DIM, generator=gen)
    key = torch.randn(chunk, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(chunk, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    backend = TorchBackend()
    scale = HEAD_DIM**-0.5
    ours = median_seconds(
        lambda: backend.paged_attention(query, key, value, k_cache, v_cache, meta, scale), repeats
    )
    q_dense = query.transpose(0, 1).unsqueeze(0).contiguous()
    k_dense = torch.randn(1, NUM_KV_HEADS, seq_len, HEAD_DIM, generator=gen)
    v_dense = torch.randn(1, NUM_KV_HEADS, seq_len, HEAD_DIM, generator=gen)
    q_pos = torch.arange(prefix, seq_len)
    mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
    dense = median_seconds(
        lambda: F.scaled_dot_product_attention(
            q_dense, k_dense, v_dense, attn_mask=mask, enable_gqa=True
        ),
        repeats,
    )
    return {"ms": round(ours * 1e3, 3), "dense_sdpa_ms": round(dense * 1e3, 3)}


def bench_shared_prefix(
    num_seqs: int, prefix: int, tail: int, repeats: int
) -> dict[str, float | int]:
    """Decode of ``num_seqs`` sequences whose first ``prefix`` tokens are the same cached blocks
    (prefix caching), each with ``tail`` private tokens: cascade vs the gathered path."""
    blocks = prefix // BLOCK_SIZE
    batch = make_batch(
        [1] * num_seqs, [prefix + tail] * num_seqs, num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE, seed=2,
    )  # fmt: skip
    batch = share_prefix(batch, list(range(num_seqs)), blocks)
    scale = HEAD_DIM**-0.5

    def timed(backend: TorchBackend) -> float:
        return median_seconds(
            lambda: backend.paged_attention(
                batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta,
                scale,
            ),
            repeats,
        )  # fmt: skip

    cascade = timed(TorchBackend())
    gathered = timed(TorchBackend(shared_prefix=False))
    return {
        "num_seqs": num_seqs,
        "shared_tokens": prefix,
        "private_tokens": tail,
        "ms": round(cascade * 1e3, 3),
        "gathered_ms": round(gathered * 1e3, 3),
        "speedup": round(gathered / cascade, 2),
    }


@dataclass(frozen=True)
class TritonCase:
    """Where and at which head shape the Triton kernels are timed: an H200 in bf16 with
    Llama-8B-like heads by default; the tests run tiny shapes on the CPU under the interpreter."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def time_attention(self, query_lens: list[int], seq_lens: list[int], repeats: int) -> float:
        """Median seconds of the Triton backend's attention over a random paged batch."""
        from kernels.triton_backend import TritonBackend

        gen = torch.Generator().manual_seed(len(seq_lens))
        bs = self.block_size
        num_blocks = sum((n + bs - 1) // bs for n in seq_lens) + 16
        meta = make_metadata(query_lens, seq_lens, bs, num_blocks, gen, self.device)
        shape = (num_blocks, bs, self.kv_heads, self.head_dim)
        k_cache = torch.randn(shape, device=self.device, dtype=self.dtype)
        v_cache = torch.randn(shape, device=self.device, dtype=self.dtype)
        rows = (sum(query_lens), self.heads, self.head_dim)
        query = torch.randn(rows, device=self.device, dtype=self.dtype)
        backend = TritonBackend()

        def run() -> None:
            backend.paged_attention(
                query, query, query, k_cache, v_cache, meta, self.head_dim**-0.5
            )
            self.sync()

        return median_seconds(run, repeats)


def bench_triton_decode(
    batch: int, ctx: int, repeats: int, case: TritonCase | None = None
) -> dict[str, float]:
    """Triton decode (one token per sequence, ``ctx`` cached), against a plain read (a sum) and
    a device-to-device copy of as many K/V bytes."""
    c = case or TritonCase()
    seconds = c.time_attention([1] * batch, [ctx] * batch, repeats)
    item = torch.empty((), dtype=c.dtype).element_size()
    kv_bytes = 2 * batch * ctx * c.kv_heads * c.head_dim * item
    src = torch.empty(kv_bytes // item, device=c.device, dtype=c.dtype)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        c.sync()

    def read() -> None:  # a plain reduction: the read-only ceiling of the same bytes
        src.sum(dtype=torch.float32)
        c.sync()

    # a copy reads and writes kv_bytes: moved = 2 x kv_bytes
    copy_gbps = 2 * kv_bytes / median_seconds(copy, repeats) / 1e9
    read_gbps = kv_bytes / median_seconds(read, repeats) / 1e9
    gbps = kv_bytes / seconds / 1e9
    return {
        "batch": batch,
        "ctx": ctx,
        "ms": round(seconds * 1e3, 3),
        "kv_gbps": round(gbps, 1),
        "sum_read_gbps": round(read_gbps, 1),
        "d2d_copy_moved_gbps": round(copy_gbps, 1),
        "fraction_of_read": round(gbps / read_gbps, 3),
    }


def bench_triton_prefill(
    seqs: int, chunk: int, cached: int, repeats: int, case: TritonCase | None = None
) -> dict[str, float]:
    """Triton prefill: ``seqs`` chunks of ``chunk`` new tokens, each after ``cached`` tokens
    already in the cache (causal). TFLOP/s counts the attention's two products over the keys
    each query sees (``4 x head_dim`` per query head and key)."""
    c = case or TritonCase()
    seconds = c.time_attention([chunk] * seqs, [cached + chunk] * seqs, repeats)
    keys_seen = seqs * sum(cached + i + 1 for i in range(chunk))  # causal: query i sees i + 1
    flops = 4 * c.head_dim * c.heads * keys_seen
    return {
        "seqs": seqs,
        "chunk": chunk,
        "cached": cached,
        "ms": round(seconds * 1e3, 3),
        "flops": flops,
        "tflops": round(flops / seconds / 1e12, 2),
    }


def triton_figures(repeats: int, case: TritonCase | None = None) -> dict[str, object]:
    """``--triton``: the decode at batch 64 / 256 x contexts 1k / 4k, and prefill chunks (8 fresh
    prompts of 512; 16 chunks of 256 after 2048 cached), at ``case``'s heads."""
    c = case or TritonCase()
    decode = [bench_triton_decode(b, n, repeats, c) for b in (64, 256) for n in (1024, 4096)]
    prefill = [
        bench_triton_prefill(s, n, k, repeats, c) for s, n, k in ((8, 512, 0), (16, 256, 2048))
    ]
    name = torch.cuda.get_device_name() if c.device.startswith("cuda") else c.device
    return {
        "bench": "kernels.triton",
        "device": name,
        "dtype": str(c.dtype).split(".")[-1],
        "heads": [c.heads, c.kv_heads, c.head_dim],
        "decode": decode,
        "prefill": prefill,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--triton", action="store_true", help="time the Triton decode on CUDA")
    parser.add_argument(
        "--shapes", default="",
        help="also decode at these heads/kv_heads/head_dim, comma-separated (e.g. "
        "9/3/64,14/2/64,32/8/128: SmolLM2, Qwen2-0.5B, Llama-8B-like)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-bf16", action="store_true",
        help="also the decode kernel over bfloat16 caches against float32 ones",
    )  # fmt: skip
    args = parser.parse_args()
    enable_huge_pages()  # before the first tensor, as the worker does
    shapes = [HeadShape.parse(x) for x in args.shapes.split(",") if x]
    if args.triton:
        print(json.dumps(triton_figures(args.repeats)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [(64, 512), (256, 256), (1, 4000)]
    decode = [asdict(bench_decode(b, c, args.repeats)) for b, c in sizes]
    result = {
        "bench": "kernels.torch",
        "threads": torch.get_num_threads(),
        "huge_pages": huge_pages_in_effect(),
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "float32",
        },
        "decode": decode,
        "prefill_512": bench_prefill(512, 0, args.repeats),
        "prefill_512_after_512_cached": bench_prefill(512, 512, args.repeats),
        "shared_prefix": bench_shared_prefix(32, 1024, 32, args.repeats),
        "decode_by_shape": [
            {**asdict(h), **asdict(bench_decode(b, c, args.repeats, h))}
            for h in shapes
            for b, c in [(48, 400), (64, 512)]
        ],
    }
    if args.kv_bf16:
        result["decode_bf16_cache"] = [
            bench_decode_bf16_cache(b, c, args.repeats, h)
            for h in [HeadShape(), *shapes]
            for b, c in [(64, 512), (256, 256)]
        ]
    emit("kernels.torch", {k: v for k, v in result.items() if k != "bench"})


if __name__ == "__main__":
    main()
