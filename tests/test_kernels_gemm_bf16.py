"""The C GEMM's bfloat16 path (``ps_gemm_bf16`` in kernels/csrc/gemm.c, AVX512-BF16's
``vdpbf16ps``) against a float64 product of the same bfloat16-rounded weight and input.

Runs where this machine's build has the path (an AVX-512 CPU with AVX512-BF16); the 8-float
build never has it, which is checked everywhere. Shares the float32 path's blocking, so the same
properties are checked: every row count's tile remainders, a last panel narrower than 32, K in
slices through partial sums, a row's bits independent of its batch and thread count, the
requests for the next block changing no value.
"""

from __future__ import annotations

import pytest
import torch

from kernels import gemm as native_gemm
from kernels import native

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler")

NARROW = [*native.FLAGS, "-DPS_WIDE_LANES=8"]


@pytest.fixture(scope="module")
def gemm() -> native_gemm.NativeGemm:
    lib = native_gemm.load(flags=native.FLAGS)
    assert lib is not None
    if not lib.bf16:
        pytest.skip("this CPU's build has no bfloat16 path (needs AVX-512 with AVX512-BF16)")
    return lib


def rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The product of the bfloat16-rounded operands in float64 (what the path computes up to
    its float32 sums)."""
    y = rounded(x) @ rounded(w).T
    return (y if b is None else y + b.double()).float()


def tolerance(k: int) -> float:
    """float32 sums of k exact products of bfloat16 values near N(0, 1): as the float32 path."""
    return 2e-6 * k


def test_the_path_exists_where_the_cpu_has_avx512_bf16() -> None:
    """The machine's build has it exactly where torch sees AVX512-BF16 with AVX-512 vectors; the
    8-float build never, and packing for it then says why."""
    machine = native_gemm.load(flags=native.FLAGS)
    narrow = native_gemm.load(flags=NARROW)
    assert machine is not None and narrow is not None
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if probe is not None and machine.panel_width == 32:
        assert machine.bf16 == bool(probe())
    assert narrow.bf16 is False
    with pytest.raises(ValueError, match="no bfloat16 path"):
        narrow.pack_bf16(torch.randn(8, 4))


@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 20, 48, 97, 300])
@pytest.mark.parametrize("out_in", [(16, 8), (40, 24), (1000, 100), (96, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_matches_float64_of_the_rounded_operands(
    gemm: native_gemm.NativeGemm, rows: int, out_in: tuple[int, int], with_bias: bool
) -> None:
    n, k = out_in
    gen = torch.Generator().manual_seed(rows * 7919 + n)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(rows, k, generator=gen)
    packed = gemm.pack_bf16(w)
    assert packed.panels.dtype == torch.bfloat16 and packed.shape == (n, k)
    got = packed.matmul(x, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(x, w, b), rtol=0, atol=tolerance(k))


def test_bf16_long_k_runs_in_slices_with_the_same_sums(gemm: native_gemm.NativeGemm) -> None:
    """K 3000 with 300 rows goes in k slices (partial sums in y): each row equals the row alone
    (one pass), bit for bit, also in the narrow last panel (56 = 32 + 24 columns)."""
    gen = torch.Generator().manual_seed(11)
    weight, bias = torch.randn(56, 3000, generator=gen), torch.randn(56, generator=gen)
    w, x = gemm.pack_bf16(weight), torch.randn(300, 3000, generator=gen)
    batch = w.matmul(x, bias)
    for r in (0, 150, 299):
        assert torch.equal(w.matmul(x[r : r + 1], bias), batch[r : r + 1])
    torch.testing.assert_close(batch, reference(x, weight, bias), rtol=0, atol=tolerance(3000))


def test_bf16_row_gives_the_same_bits_alone_or_in_a_batch(gemm: native_gemm.NativeGemm) -> None:
    gen = torch.Generator().manual_seed(5)
    w = gemm.pack_bf16(torch.randn(300, 200, generator=gen))
    x = torch.randn(37, 200, generator=gen)
    batch = w.matmul(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for r in (0, 5, 36):
            assert torch.equal(w.matmul(x[r : r + 1]), batch[r : r + 1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 64, 256])
def test_bf16_requests_for_the_next_block_change_no_value(
    gemm: native_gemm.NativeGemm, rows: int
) -> None:
    plain = native_gemm.load(flags=[*native.FLAGS, "-DPS_GEMM_NEXT=0"])
    assert plain is not None
    gen = torch.Generator().manual_seed(rows)
    for n, k in ((1000, 100), (200, 1536), (3072, 576)):
        weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        x = torch.randn(rows, k, generator=gen)
        assert torch.equal(
            gemm.pack_bf16(weight).matmul(x, bias), plain.pack_bf16(weight).matmul(x, bias)
        )


def test_bf16_strided_rows_leading_dims_empty_input_and_refusals(
    gemm: native_gemm.NativeGemm,
) -> None:
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(24, 16, generator=gen)
    w = gemm.pack_bf16(weight)
    x = torch.randn(6, 40, generator=gen)[:, 8:24]  # rows 40 floats apart
    torch.testing.assert_close(w.matmul(x), reference(x, weight, None), rtol=0, atol=1e-4)
    x3 = torch.randn(2, 3, 16, generator=gen)
    assert w.matmul(x3).shape == (2, 3, 24)
    assert w.matmul(torch.empty(0, 16)).shape == (0, 24)
    with pytest.raises(ValueError, match="even number"):
        gemm.pack_bf16(torch.randn(8, 5))
    with pytest.raises(ValueError):
        gemm.pack_bf16(torch.randn(8, 4, dtype=torch.float64))
    with pytest.raises(ValueError):
        w.matmul(torch.randn(3, 15))
