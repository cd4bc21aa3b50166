"""The C decode kernel (kernels/csrc/paged_decode.c): build, load, and its answers against the
float64 dense reference. The whole torch-backend suite also runs through it
(tests/test_kernels_torch.py, ``decode_path`` fixture); these are the kernel's own cases."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from bench.common import has_avx512
from kernels import native, torch_plan
from kernels.reference import reference_paged_attention
from kernels.testing import PagedBatch, make_batch, share_prefix
from kernels.torch_backend import (
    NARROW_CASCADE,
    WIDE_CASCADE,
    CascadePolicy,
    TorchBackend,
    cascade_policy,
)
from tests.test_kernels_torch import run_and_compare

needs_compiler = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler on this machine"
)


def wide_build_or_skip(lanes: int) -> None:
    """Skip the 16-float build of the decode library where the CPU lacks AVX-512: no such
    machine runs it (PS_WIDE_LANES is 8 there), and GCC, splitting every 64-byte vector into AVX2
    halves, compiled it for over 300 s on an AVX2-only Zen 3 (the test's timeout)."""
    if lanes == 16 and not has_avx512():
        pytest.skip("the 16-float build needs AVX-512 to be worth compiling")


def native_plans(backend: TorchBackend) -> list[bool]:
    """Per planned (window, dtype) of the last step: whether its decodes went to the kernel."""
    return [decode.native is not None for decode in backend._plan.decode.values()]


@needs_compiler
def test_builds_once_and_loads() -> None:
    lib = native.load()
    assert lib is not None
    assert lib.path.exists()
    assert native.build() == lib.path  # cached: same file, no rebuild
    assert lib.lanes == 8 and lib.max_head_dim >= 128


@needs_compiler
def test_prebuild_builds_every_library_the_loaders_load() -> None:
    """``python -m kernels.prebuild`` (the bootstrap's step): one JSON object naming each C
    library's cached file, the very files the loaders then load (same source and flags, same
    cache key: nothing is built twice)."""
    from kernels import fused, gemm

    run = subprocess.run(
        [sys.executable, "-m", "kernels.prebuild"], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    built = {name: Path(path) for name, path in json.loads(run.stdout).items()}
    assert set(built) == {"decode-f32", "decode-bf16", "gemm", "fused"}
    loaded = {
        "decode-f32": native.load(torch.float32),
        "decode-bf16": native.load(torch.bfloat16),
        "gemm": gemm.load(),
        "fused": fused.load(),
    }
    for name, lib in loaded.items():
        assert lib is not None, name
        assert lib.path == built[name] and lib.path.exists(), name


@needs_compiler
def test_concurrent_builders_of_one_library_compile_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads here (and, through the same file lock, other processes) asking for a library
    nobody has built yet: one compiles it, the others wait and load its file. The compiler is
    the machine's, behind a script that logs each compile (not its ``--version`` probes)."""
    from kernels import fused

    real = shutil.which("cc") or shutil.which("gcc")
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cc"
    wrapper.write_text(
        f'#!/bin/sh\ncase "$1" in --version) ;; *) echo compile >> {log} ;; esac\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(
            pool.map(lambda _: native.build(source=fused.SOURCE, flags=fused.FLAGS), range(3))
        )
    assert paths[0].exists() and paths == [paths[0]] * 3
    assert log.read_text().splitlines() == ["compile"]
    assert native.build(source=fused.SOURCE, flags=fused.FLAGS) == paths[0]  # a cache hit
    assert log.read_text().splitlines() == ["compile"]


@needs_compiler
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux only")
def test_shares_torchs_openmp_runtime() -> None:
    """Two OpenMP runtimes in one process would each keep a spinning thread pool."""
    assert native.load() is not None
    maps = Path("/proc/self/maps").read_text().splitlines()
    gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1, gomp


# With block size 16, (8, 4, 64), (16, 4, 128), (9, 3, 64) (SmolLM2) and (14, 2, 64) (Qwen2-0.5B)
# take the kernel's compile-time paths (value accumulators in registers, a tile of heads at a
# time); the rest the generic one. 40 is a head size that the 16-float vectors of an AVX-512
# build do not divide (its dot products fall back to 8 floats); 96 one they do.
SHAPES = [(8, 8, 64), (8, 2, 64), (16, 1, 64), (8, 4, 64), (16, 4, 128), (9, 3, 64), (14, 2, 64),
          (6, 2, 40), (8, 1, 96)]  # fmt: skip


@needs_compiler
# 300: a window over many blocks, starting inside one
@pytest.mark.parametrize("window", [None, 1, 100, 300])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_spread_of_lengths_against_reference(
    window: int | None, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(block_size + num_heads)
    s_lens = torch.randint(1, 700, (40,), generator=gen).tolist()
    batch = make_batch(
        [1] * 40, s_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size,
    )  # fmt: skip
    backend = TorchBackend(native=True)
    run_and_compare(batch, sliding_window=window, backend=backend)
    assert native_plans(backend) == [True]


@needs_compiler
@pytest.mark.parametrize("window", [None, 40])
def test_read_blocks_sums_exactly_what_decode_reads(window: int | None) -> None:
    """The benchmark baseline (``read_blocks``): the sum of the keys and values of each row's
    context (after its first block, inside its window) and nothing else."""
    lib = native.load()
    assert lib is not None
    gen = torch.Generator().manual_seed(5)
    s_lens = [1, 17, 300, 255, 64]
    batch = make_batch([1] * 5, s_lens, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    tables = batch.meta.block_tables.to(torch.int32).contiguous()
    # integers, so that float32 sums in any order are exact
    k = torch.randint(-8, 8, batch.k_cache.shape, generator=gen).float()
    v = torch.randint(-8, 8, batch.v_cache.shape, generator=gen).float()
    first = torch.tensor([0, 1, 2, 0, 3])
    rows = native.DecodeRows(torch.arange(5), torch.arange(5), first, torch.tensor(s_lens))
    want = 0.0
    for r, s_len in enumerate(s_lens):
        lo = int(first[r]) * 16
        if window is not None:
            lo = max(lo, s_len - window)
        for p in range(lo, s_len):
            block = int(tables[r, p // 16])
            want += float(k[block, p % 16].sum() + v[block, p % 16].sum())
    assert lib.read_blocks(k, v, tables, rows, window) == want


@needs_compiler
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_narrow_vector_build_against_reference(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """The 8-float build (what an AVX2 machine compiles) against the reference wherever this
    machine's own build is the 16-float one."""
    lib = native.build(flags=[*native.FLAGS, "-DPS_WIDE_LANES=8"])
    gen = torch.Generator().manual_seed(num_heads * head_dim)
    s_lens = torch.randint(1, 400, (12,), generator=gen).tolist()
    batch = make_batch([1] * 12, s_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=16)  # fmt: skip
    backend = TorchBackend(native=True, kernel=native.NativeDecode(lib))
    run_and_compare(batch, backend=backend)
    assert native_plans(backend) == [True]


@needs_compiler
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 4), (9, 3)])
def test_prefill_chunks_run_in_the_kernel(num_heads: int, num_kv_heads: int, tiled: bool) -> None:
    """Prefill chunks (fresh prompts, and chunks after cached context) go through the C kernels
    beside the decode rows: the tiled prefill kernel up to TILED_PREFILL_MAX_LEN, or
    (``tiled_prefill=False``) one decode row per query token up to NATIVE_PREFILL_MAX_LEN; a
    longer one and a windowed step stay in torch. All against the reference."""
    limit = torch_plan.TILED_PREFILL_MAX_LEN if tiled else torch_plan.NATIVE_PREFILL_MAX_LEN
    q_lens, s_lens = [1, 37, 1, 200, 90, 5, 300], [40, 37, 700, 200, 250, limit, limit + 300]
    batch = make_batch(q_lens, s_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=64, block_size=16)  # fmt: skip
    backend = TorchBackend(native=True, tiled_prefill=tiled)
    run_and_compare(batch, backend=backend)
    (plan,) = backend._plan.decode.values()
    assert [w.native for w in plan.prefill] == [True, True, True, True, False]
    assert plan.native is not None
    in_kernel = 37 + 200 + 90 + 5
    if tiled:
        assert plan.native.rows.num_rows == 2 and plan.native.prefill is not None
        assert plan.native.prefill.query_lens.tolist() == [37, 200, 90, 5]
    else:
        assert plan.native.rows.num_rows == 2 + in_kernel and plan.native.prefill is None
    windowed = make_batch(q_lens, s_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=64, block_size=16)  # fmt: skip
    run_and_compare(windowed, sliding_window=100, backend=backend)
    (plan,) = backend._plan.decode.values()
    assert not any(w.native for w in plan.prefill) and plan.native.rows.num_rows == 2
    assert plan.native.prefill is None
    only_prefill = make_batch([37, 200], [37, 250], num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_dim=64, block_size=16)  # fmt: skip
    run_and_compare(only_prefill, backend=backend)  # a step with no decode row at all
    (plan,) = backend._plan.decode.values()
    assert plan.native is not None
    assert plan.native.rows.num_rows == (0 if tiled else 237)


# Prefill chunks for the tiled kernel: fresh prompts of 1-300 tokens (spans of 64 tokens, query
# tiles cut across tokens and heads), chunks after cached context, a chunk ending on a block
# boundary, one decode row beside them.
PREFILL_STEP = ([1, 37, 64, 65, 300, 16, 9, 120], [40, 37, 64, 65, 300, 32, 409, 130])


def prefill_plan(backend: TorchBackend) -> torch_plan.NativeWork:
    (plan,) = backend._plan.decode.values()
    assert plan.native is not None
    return plan.native


@needs_compiler
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_tiled_prefill_against_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Every head shape and block size; a head size the vectors do not divide (40 with the
    16-float build) keeps its prefill tokens as decode rows, also correct."""
    q_lens, s_lens = PREFILL_STEP
    batch = make_batch(q_lens, s_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size)  # fmt: skip
    backend = TorchBackend(native=True, tiled_prefill=True)
    run_and_compare(batch, backend=backend)
    lib = native.load()
    assert lib is not None
    work = prefill_plan(backend)
    assert (work.prefill is not None) == (head_dim % lib.prefill_lanes == 0)


@needs_compiler
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(8, 4, 64), (9, 3, 64), (14, 2, 64), (8, 1, 96)]
)
def test_tiled_prefill_narrow_vector_build(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """The 8-float build of the prefill kernel (an AVX2 machine's) against the reference."""
    lib = native.build(flags=[*native.FLAGS, "-DPS_WIDE_LANES=8"])
    kernel = native.NativeDecode(lib)
    assert kernel.prefill_lanes == 8
    q_lens, s_lens = PREFILL_STEP
    batch = make_batch(q_lens, s_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=16)  # fmt: skip
    backend = TorchBackend(native=True, kernel=kernel, tiled_prefill=True)
    run_and_compare(batch, backend=backend)
    assert prefill_plan(backend).prefill is not None


@needs_compiler
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "lanes"),
    [(9, 3, 64, 16), (14, 2, 64, 16), (16, 2, 64, 16), (16, 4, 128, 16), (9, 3, 64, 8)],
)
def test_tiled_prefill_chunks_after_a_long_context(
    num_heads: int, num_kv_heads: int, head_dim: int, lanes: int
) -> None:
    """Chunks after a long context (a prompt's suffix after a cached prefix, as in the
    ``shared-prefix`` workload: softmax updates past the fourth, tasks of 64 tokens x 8 heads)
    against the reference, in the 16- and the 8-float builds."""
    wide_build_or_skip(lanes)
    kernel = native.NativeDecode(native.build(flags=[*native.FLAGS, f"-DPS_WIDE_LANES={lanes}"]))
    batch = make_batch([40, 64, 70, 3, 1], [1064, 584, 1100, 900, 300], num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16)  # fmt: skip
    backend = TorchBackend(native=True, kernel=kernel, tiled_prefill=True)
    run_and_compare(batch, backend=backend)
    work = prefill_plan(backend)
    assert work.prefill is not None and work.prefill.query_lens.tolist() == [40, 64, 70, 3]


@needs_compiler
def test_tiled_prefill_large_scores_and_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scores hundreds apart underflow cleanly (no inf/nan) in the tiled kernel; and
    PAGEDSERVE_TILED_PREFILL=0 sends prefill tokens back to the decode kernel's rows."""
    batch = make_batch([50, 1, 130], [50, 70, 200], num_heads=4, num_kv_heads=2, head_dim=32,
                       block_size=16)  # fmt: skip
    batch.query.mul_(40.0)
    backend = TorchBackend(native=True)
    run_and_compare(batch, backend=backend, atol=1e-4, rtol=1e-4)
    assert prefill_plan(backend).prefill is not None
    monkeypatch.setenv(native.TILED_PREFILL_ENV, "0")
    off = TorchBackend(native=True)
    run_and_compare(make_batch([50, 1], [50, 70], num_heads=4, num_kv_heads=2, head_dim=32,
                               block_size=16), backend=off)  # fmt: skip
    assert prefill_plan(off).prefill is None and prefill_plan(off).rows.num_rows == 51


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's thread count (the kernel takes it at each call) set to ``n`` (None: as it is)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@needs_compiler
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize(("lens", "window"), [([333], None), ([333, 16], None),
                                              ([333, 16, 70], None), ([333, 40], 100)])  # fmt: skip
def test_fewer_rows_than_threads_split_into_runs_of_blocks(
    num_heads: int, num_kv_heads: int, head_dim: int, lens: list[int], window: int | None
) -> None:
    """Fewer rows than threads (1-3 rows on 4 threads): each row's blocks cut into up to
    ceil(threads / rows) runs (fewer where a row has fewer blocks: a 16-token row is one), each
    attended into scratch and merged by log-sum-exp; with a window, runs of the blocks it
    covers."""
    batch = make_batch(
        [1] * len(lens), lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=16,
    )  # fmt: skip
    with torch_threads(4):
        backend = TorchBackend(native=True)
        run_and_compare(batch, sliding_window=window, backend=backend)
    assert native_plans(backend) == [True]


@needs_compiler
def test_large_scores_underflow_cleanly() -> None:
    """Scores hundreds apart: most weights underflow to zero, none turns into inf/nan."""
    batch = make_batch([1, 1, 1], [50, 200, 17], num_heads=4, num_kv_heads=2, head_dim=32,
                       block_size=16)  # fmt: skip
    batch.query.mul_(40.0)
    run_and_compare(batch, backend=TorchBackend(native=True), atol=1e-4, rtol=1e-4)


@needs_compiler
@pytest.mark.parametrize("threads", [None, 8])
def test_log_sum_exp_output(threads: int | None) -> None:
    """The kernel's lse is what the shared-prefix merge relies on: check it directly (also as
    merged from runs of each row's blocks: 4 rows on 8 threads)."""
    lib = native.load()
    assert lib is not None
    s_lens = [5, 16, 17, 90]
    batch = make_batch([1] * 4, s_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    rows = native.DecodeRows(
        token_rows=torch.tensor([3, 2, 1, 0]),
        seq_index=torch.tensor([3, 2, 1, 0]),
        first_block=torch.zeros(4, dtype=torch.long),
        seq_lens=torch.tensor(s_lens[::-1]),
    )
    out = torch.empty_like(batch.query)
    lse = torch.empty(4, 4)
    scale = 32**-0.5
    with torch_threads(threads):
        lib.decode(batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables, rows,
                   scale, None, out, lse)  # fmt: skip
    table = batch.meta.block_tables.tolist()
    flat_k = batch.k_cache.double().view(-1, 2, 32)
    for r, b in enumerate([3, 2, 1, 0]):
        slots = [table[b][p // 8] * 8 + p % 8 for p in range(s_lens[b])]
        keys = flat_k[slots].repeat_interleave(2, dim=1)  # [L, H, D]
        scores = torch.einsum("hd,lhd->hl", batch.query[b].double(), keys) * scale
        torch.testing.assert_close(lse[r].double(), torch.logsumexp(scores, -1), atol=1e-5,
                                   rtol=1e-5)  # fmt: skip
    expected = reference_paged_attention(
        batch.query.double(), batch.k_cache.double(), batch.v_cache.double(), batch.meta, scale
    )
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


def _dense_prefix(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of ``query`` [S, H, D] over every key of ``blocks``: (out, lse)."""
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    ids = torch.tensor(blocks)
    keys = k_cache[ids].double().flatten(0, 1).repeat_interleave(num_heads // num_kv_heads, 1)
    values = v_cache[ids].double().flatten(0, 1).repeat_interleave(num_heads // num_kv_heads, 1)
    scores = torch.einsum("shd,lhd->shl", query.double(), keys) * scale
    out = torch.einsum("shl,lhd->shd", torch.softmax(scores, -1), values)
    return out, torch.logsumexp(scores, -1)


@needs_compiler
@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(8, 4, 64), (9, 3, 64), (14, 2, 64), (16, 4, 128), (8, 1, 96), (4, 2, 32)],
)
def test_shared_prefixes_in_the_tiled_kernel(
    num_heads: int, num_kv_heads: int, head_dim: int, narrow: bool
) -> None:
    """The tiled kernel's all-keys mode (a cascade's groups): every query row of a group sees
    all keys of its prefix, read through a table row, with no mask; out and lse match a dense
    float64 softmax. Groups of 1 to 130 rows (a task spans 64 tokens), prefixes of one block
    to past two key panels (256 keys), in both vector widths."""
    lib = native.load()
    assert lib is not None
    if narrow:
        lib = native.NativeDecode(native.build(flags=[*native.FLAGS, "-DPS_WIDE_LANES=8"]))
    gen = torch.Generator().manual_seed(num_heads * head_dim)
    block_size, pool = 16, 96
    k_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen)
    groups = [(1, 1), (7, 3), (130, 17), (40, 38)]  # (query rows, prefix blocks)
    perm = torch.randperm(pool, generator=gen).tolist()
    table = torch.zeros(len(groups), max(n for _, n in groups), dtype=torch.int32)
    rows_of = list(range(len(groups)))[::-1]  # group i reads table row rows_of[i]
    for i, (_, n) in enumerate(groups):
        table[rows_of[i], :n] = torch.tensor(perm[:n], dtype=torch.int32)  # scattered blocks
        perm = perm[n:] + perm[:n]
    sizes = [g for g, _ in groups]
    query = torch.randn(sum(sizes), num_heads, head_dim, generator=gen)
    starts = torch.tensor([sum(sizes[:i]) for i in range(len(sizes))])
    chunks = native.PrefillChunks(
        starts=starts,
        query_lens=torch.tensor(sizes),
        seq_lens=torch.tensor([n * block_size for _, n in groups]),
        seq_index=torch.tensor(rows_of),
    )
    out = torch.full_like(query, float("nan"))
    lse = torch.full((query.shape[0], num_heads), float("nan"))
    scale = head_dim**-0.5
    lib.prefill(query, k_cache, v_cache, table, chunks, scale, out, lse)
    for i, (rows, n) in enumerate(groups):
        span = slice(int(starts[i]), int(starts[i]) + rows)
        blocks = table[rows_of[i], :n].tolist()
        ref_out, ref_lse = _dense_prefix(query[span], k_cache, v_cache, blocks, scale)
        torch.testing.assert_close(out[span].double(), ref_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse[span].double(), ref_lse, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="lse"):
        lib.prefill(query, k_cache, v_cache, table, chunks, scale, out, lse[:, :1])


@needs_compiler
@pytest.mark.parametrize("threads", [None, 8])
def test_decode_rows_continue_a_prefix_result(threads: int | None) -> None:
    """A decode row given its prefix's (out, lse) and reading only its own blocks returns the
    attention over the whole context; a row with slot -1 starts empty; bad starts are refused.
    On 8 threads the rows' blocks go in runs: only each row's first run starts from the
    prefix."""
    lib = native.load()
    assert lib is not None
    s_lens = [70, 90, 33]
    batch = make_batch([1] * 3, s_lens, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
    table = batch.meta.block_tables
    scale = 32**-0.5
    expected = reference_paged_attention(
        batch.query.double(), batch.k_cache.double(), batch.v_cache.double(), batch.meta, scale
    )
    prefix = [2, 4]  # blocks of rows 0 and 1 computed as "the prefix"; row 2 reads all
    starts = []
    for b, n in enumerate(prefix):
        blocks = table[b, :n].tolist()
        starts.append(_dense_prefix(batch.query[b : b + 1], batch.k_cache, batch.v_cache, blocks,
                                    scale))  # fmt: skip
    start = native.PrefixStart(  # slots in reverse: row 0 reads slot 1, row 1 slot 0
        out=torch.cat([o for o, _ in starts[::-1]]).float(),
        lse=torch.cat([lse for _, lse in starts[::-1]]).float(),
        slots=torch.tensor([1, 0, -1]),
    )
    rows = native.DecodeRows(
        token_rows=torch.arange(3), seq_index=torch.arange(3),
        first_block=torch.tensor([*prefix, 0]), seq_lens=torch.tensor(s_lens),
    )  # fmt: skip
    out = torch.empty_like(batch.query)
    lse = torch.empty(3, 6)
    with torch_threads(threads):
        lib.decode(batch.query, batch.k_cache, batch.v_cache, table, rows, scale, None, out,
                   lse, start)  # fmt: skip
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    bad = native.PrefixStart(start.out, start.lse, torch.tensor([2, 0, -1]))  # slot 2 of 2
    with pytest.raises(ValueError, match="native decode"):
        lib.decode(batch.query, batch.k_cache, batch.v_cache, table, rows, scale, None, out,
                   lse, bad)  # fmt: skip
    with pytest.raises(ValueError, match="prefix start"):
        lib.decode(batch.query, batch.k_cache, batch.v_cache, table, rows, scale, None, out,
                   lse, native.PrefixStart(start.out.double(), start.lse, start.slots))  # fmt: skip


@needs_compiler
@pytest.mark.parametrize(
    ("head_dim", "block_size", "dtype"),
    [(36, 16, torch.float32), (32, 12, torch.float32), (32, 16, torch.float64)],
)
def test_uncovered_shapes_and_dtypes_stay_in_torch(
    head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    batch = make_batch([1, 1, 4], [30, 70, 9], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                       block_size=block_size, dtype=dtype)  # fmt: skip
    backend = TorchBackend(native=True)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    run_and_compare(batch, backend=backend, atol=tol, rtol=max(tol, 1e-10) * 5)
    assert native_plans(backend) == [False]


def test_required_but_unavailable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "load", lambda kv_dtype=torch.float32: None)
    with pytest.raises(RuntimeError, match="native CPU decode kernel"):
        TorchBackend(native=True)
    assert not TorchBackend().uses_native


def test_disabled_by_environment() -> None:
    code = "from kernels import native, torch_backend; print(native.load(), " \
           "torch_backend.TorchBackend().uses_native)"  # fmt: skip
    env = {**os.environ, native.DISABLE_ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent.parent)  # fmt: skip
    assert out.stdout.split() == ["None", "False"]


def test_no_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(native, "_LOADED", {})
    assert native.load() is None


def test_cache_dir_must_be_private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A directory others can write to is skipped: we load shared libraries from it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    private = tmp_path / "private"
    monkeypatch.setenv(native.CACHE_ENV, str(shared))
    monkeypatch.setenv("XDG_CACHE_HOME", str(private))
    chosen = native._cache_dir()
    assert chosen == private / "pagedserve" / "kernels"
    assert not chosen.stat().st_mode & 0o077
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "mine"))
    assert native._cache_dir() == tmp_path / "mine"


@needs_compiler
@pytest.mark.parametrize("tiled", [True, False])
def test_small_shared_prefixes_stay_in_the_kernels(tiled: bool) -> None:
    """With the C kernel, a shared prefix below the cascade policy's K+V bytes per layer, or
    whose group has less work (query tokens x shared tokens) than it asks, gets no cascade
    group: the decodes (and the prefill chunk, in the tiled kernel) read its blocks in place.
    At the threshold the decodes form a group; a prefill chunk the tiled kernel takes stays out
    of it, one the decode rows take joins it. Every variant matches the reference."""
    from tests.test_kernels_torch import shared_group_sizes

    shared, block_size = 4, 16

    def batch() -> PagedBatch:
        b = make_batch([1, 1, 1, 20], [130, 150, 97, 120], num_heads=8, num_kv_heads=4,
                       head_dim=64, block_size=block_size, seed=3)  # fmt: skip
        return share_prefix(b, [0, 1, 2, 3], shared)

    default = TorchBackend(native=True, tiled_prefill=tiled)
    run_and_compare(batch(), backend=default)
    assert shared_group_sizes(default) == []
    prefix_bytes = shared * block_size * 2 * 4 * 64 * 4  # blocks x tokens x (K, V) x heads x D
    grouped = [(3, shared)] if tiled else [(3 + 20, shared)]
    work = grouped[0][0] * shared * block_size  # the group's query tokens x shared tokens
    for at, above in [
        (CascadePolicy(min_bytes=prefix_bytes), CascadePolicy(min_bytes=prefix_bytes + 1)),
        (CascadePolicy(min_work=work), CascadePolicy(min_work=work + 1)),
    ]:
        backend = TorchBackend(native=True, tiled_prefill=tiled, cascade=at)
        run_and_compare(batch(), backend=backend)
        assert shared_group_sizes(backend) == grouped
        backend = TorchBackend(native=True, tiled_prefill=tiled, cascade=above)
        run_and_compare(batch(), backend=backend)
        assert shared_group_sizes(backend) == []


@needs_compiler
def test_cascade_policy_follows_the_vector_width() -> None:
    """The measured policy of each build: groups in the tiled kernel with 16-float vectors,
    in torch's flash call with 8; both from 32K query x shared tokens."""
    kernel = native.load()
    assert kernel is not None
    expected = WIDE_CASCADE if kernel.prefill_lanes == 16 else NARROW_CASCADE
    assert cascade_policy(kernel) == expected
    assert TorchBackend(native=True)._cascade == expected
    assert WIDE_CASCADE.in_kernel and not NARROW_CASCADE.in_kernel
