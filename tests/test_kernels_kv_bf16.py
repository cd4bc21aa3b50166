"""bfloat16 KV caches under float32 queries (``--kv-cache-dtype bfloat16``): the C kernels'
bfloat16 build (``-DPS_KV_BF16=1``) and the torch path, against the float64 dense reference
over the cache's own (rounded) keys and values. Every path attends over what the cache holds,
so the float32 tolerances hold: the rounding is the cache's, not the kernels'."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from kernels.testing import make_batch, share_prefix
from kernels.torch_backend import CascadePolicy, TorchBackend
from tests.test_kernels_native import (
    PREFILL_STEP,
    SHAPES,
    native_plans,
    needs_compiler,
    prefill_plan,
)
from tests.test_kernels_torch import CASES, run_and_compare, shared_group_sizes

BF16 = torch.bfloat16


def _narrow() -> native.NativeDecode:
    """The 8-float build (an AVX2 machine's) for bfloat16 caches."""
    flags = [*native.FLAGS, "-DPS_WIDE_LANES=8", *native.KV_BUILDS[BF16][0]]
    return native.NativeDecode(native.build(flags=flags), BF16)


@needs_compiler
def test_a_build_of_its_own_reads_only_bfloat16_caches() -> None:
    f32, bf16 = native.load(), native.load(BF16)
    assert f32 is not None and bf16 is not None
    assert bf16.path != f32.path and bf16.kv_dtype == BF16
    assert native.load(BF16) is bf16  # loaded once
    q = torch.zeros(1, 8, 64)
    cache = torch.zeros(4, 16, 4, 64)
    assert f32.supports(q, cache) and not f32.supports(q, cache.to(BF16))
    assert bf16.supports(q, cache.to(BF16)) and not bf16.supports(q, cache)
    assert not bf16.supports(q.to(BF16), cache.to(BF16))  # queries stay float32
    assert native.load(torch.float16) is None  # no build reads it: the torch path
    backend = TorchBackend(native=True)
    assert backend.native_for(BF16) and backend.uses_native


@needs_compiler
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_rows_against_reference(
    window: int | None, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(block_size + num_heads)
    s_lens = torch.randint(1, 600, (24,), generator=gen).tolist()
    batch = make_batch([1] * 24, s_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size, cache_dtype=BF16)  # fmt: skip
    backend = TorchBackend(native=True)
    run_and_compare(batch, sliding_window=window, backend=backend)
    assert native_plans(backend) == [True]


@needs_compiler
@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(8, 4, 64), (9, 3, 64), (14, 2, 64), (16, 4, 128)]
)
def test_tiled_prefill_and_decodes_against_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, narrow: bool
) -> None:
    """Prefill chunks in the tiled kernel (keys widened as they are transposed, values as the
    value passes load them) beside a decode row, and decode rows split by KV head (fewer rows
    than threads), in both vector widths."""
    kernel = _narrow() if narrow else None
    q_lens, s_lens = PREFILL_STEP
    batch = make_batch(q_lens, s_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=16, cache_dtype=BF16)  # fmt: skip
    backend = TorchBackend(native=True, kernel=kernel, tiled_prefill=True)
    run_and_compare(batch, backend=backend)
    assert prefill_plan(backend).prefill is not None
    few = make_batch([1, 1], [333, 70], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=16, cache_dtype=BF16)  # fmt: skip
    run_and_compare(few, backend=backend)
    assert native_plans(backend) == [True]


@needs_compiler
@pytest.mark.parametrize("narrow", [False, True])
def test_shared_prefix_groups_continue_in_the_decode_kernel(narrow: bool) -> None:
    """A cascade's group read in the tiled kernel's all-keys mode, its decode rows continuing
    the group's result over their own blocks, over a bfloat16 cache."""
    kernel = _narrow() if narrow else None
    batch = make_batch([1, 1, 1, 20], [130, 150, 97, 120], num_heads=8, num_kv_heads=4,
                       head_dim=64, block_size=16, seed=3, cache_dtype=BF16)  # fmt: skip
    batch = share_prefix(batch, [0, 1, 2, 3], 4)
    policy = CascadePolicy(in_kernel=True)
    backend = TorchBackend(native=True, kernel=kernel, tiled_prefill=True, cascade=policy)
    run_and_compare(batch, backend=backend)
    assert shared_group_sizes(backend) == [(3, 4)]


@pytest.mark.parametrize("native_kernel", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_named_cases_in_torch_and_in_the_kernels(case: str, native_kernel: bool) -> None:
    """The torch path gathers and widens the cached blocks (and rounds a fresh prompt's keys
    to the cache's dtype before attending over them); the kernels read them in place."""
    if native_kernel and native.load(BF16) is None:
        pytest.skip("the native decode kernel did not build here (no C compiler?)")
    q_lens, s_lens = CASES[case]
    batch = make_batch(q_lens, s_lens, num_heads=8, num_kv_heads=4, head_dim=64,
                       block_size=16, cache_dtype=BF16)  # fmt: skip
    backend = TorchBackend(native=native_kernel)
    run_and_compare(batch, backend=backend)
    assert backend.native_for(BF16) == native_kernel


@needs_compiler
def test_read_blocks_sums_what_decode_reads() -> None:
    """The benchmark baseline of the bfloat16 build: small integers (exact in bfloat16 and in
    any float32 summation order) summed over each row's context and nothing else."""
    lib = native.load(BF16)
    assert lib is not None
    gen = torch.Generator().manual_seed(5)
    s_lens = [1, 17, 300, 255, 64]
    batch = make_batch([1] * 5, s_lens, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    tables = batch.meta.block_tables.to(torch.int32).contiguous()
    k = torch.randint(-8, 8, batch.k_cache.shape, generator=gen).to(BF16)
    v = torch.randint(-8, 8, batch.v_cache.shape, generator=gen).to(BF16)
    first = torch.tensor([0, 1, 2, 0, 3])
    rows = native.DecodeRows(torch.arange(5), torch.arange(5), first, torch.tensor(s_lens))
    want = 0.0
    for r, s_len in enumerate(s_lens):
        for p in range(int(first[r]) * 16, s_len):
            block = int(tables[r, p // 16])
            want += float(k[block, p % 16].float().sum() + v[block, p % 16].float().sum())
    assert lib.read_blocks(k, v, tables, rows) == want
    with pytest.raises(ValueError, match="v_cache"):  # one cache of each dtype: refused
        lib.decode(batch.query, k, v.float(), tables, rows, 1.0, None,
                   torch.empty_like(batch.query), torch.empty(5, 9))  # fmt: skip
