"""The projection GEMM in C (kernels/csrc/gemm.c) against a float64 reference.

Three builds: this machine's (16-float vectors on AVX-512, 8 elsewhere), the 8-float one AVX2
machines compile (``-DPS_WIDE_LANES=8``) and the 16-float one (``-DPS_WIDE_LANES=16``: 12 x 32
tiles; on an AVX2 machine GCC runs each 16-float vector as two, so its logic is tested here
too), at the row
counts an engine step has (1 row to a 2048-token prefill chunk, heights that leave every tile
remainder), column counts that are not a multiple of a panel, with and without bias. Each test
runs float32 panels and, where the build has AVX512-BF16 (``--weight-dtype bfloat16``'s
``vdpbf16ps`` path), bfloat16 ones, and where the CPU also has AMX the same bfloat16 panels on
its tiles (``ps_gemm_bf16_amx``: input widths in multiples of 32), against the float64 product
of the rounded operands. The SwiGLU product (``pack_glu``, float32) is checked against float64
and, bit for bit, against the plain product followed by the fused SwiGLU pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from bench.common import has_avx512
from kernels import gemm as native_gemm
from kernels import native

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler")


def emulated_wide_flags() -> list[str]:
    """The 16-float build's flags: at -O2 where the CPU lacks AVX-512. GCC splitting each 64-byte
    vector into AVX2 halves spent 59 s on it at -O3 (5 s at -O2) on a Zen 3, twice per suite (the
    plain build and the one without PS_GEMM_NEXT); only its logic is tested there, and an AVX-512
    machine's own build (``machine``) is the 16-float one at -O3."""
    flags = [*native.FLAGS, "-DPS_WIDE_LANES=16"]
    if has_avx512():
        return flags
    return ["-O2" if flag == "-O3" else flag for flag in flags]


BUILDS = {
    "machine": native.FLAGS,
    "narrow": [*native.FLAGS, "-DPS_WIDE_LANES=8"],
    "wide": emulated_wide_flags(),
}


@pytest.fixture(scope="module", params=list(BUILDS))
def gemm(request: pytest.FixtureRequest) -> native_gemm.NativeGemm:
    lib = native_gemm.load(flags=BUILDS[request.param])
    assert lib is not None
    assert lib.panel_width == {"narrow": 16, "wide": 32}.get(request.param, lib.panel_width)
    assert lib.int8_group == native_gemm.INT8_GROUP  # what quantize_int8 groups by
    return lib


def reference(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """float64 product of ``x`` and ``w`` as rounded to ``dtype`` (what the kernel multiplies)."""
    y = x.to(dtype).double() @ w.to(dtype).double().T
    return (y if b is None else y + b.double()).float()


@dataclass(frozen=True)
class Packing:
    """float32 panels (``pack``), bfloat16 ones (``pack_bf16``) or int8 ones with a scale per
    output row (``pack_int8``) of one build."""

    gemm: native_gemm.NativeGemm
    dtype: torch.dtype
    amx: bool = False

    def pack(self, w: torch.Tensor) -> native_gemm.PanelWeight:
        if self.amx and w.shape[1] % native_gemm.AMX_K:
            pytest.skip("the AMX path takes input widths in multiples of 32")
        if self.dtype == torch.int8:
            return self.gemm.pack_int8(w)
        if self.dtype == torch.bfloat16:
            packed = self.gemm.pack_bf16(w, amx=self.amx)
            assert packed.amx == self.amx
            return packed
        return self.gemm.pack(w)

    def reference(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if self.dtype == torch.int8:  # the weight it multiplies by: Q * S
            w = native_gemm.dequantize_int8(*native_gemm.quantize_int8(w))
            return reference(x, w, b)
        return reference(x, w, b, self.dtype)

    def on(self, gemm: native_gemm.NativeGemm) -> Packing:
        return Packing(gemm, self.dtype, self.amx)


@pytest.fixture(params=["float32", "bfloat16", "bfloat16-amx", "int8"])
def packing(request: pytest.FixtureRequest, gemm: native_gemm.NativeGemm) -> Packing:
    if request.param == "int8":
        return Packing(gemm, torch.int8)
    if request.param != "float32" and not gemm.bf16:
        pytest.skip("this build has no bfloat16 path (AVX-512 with AVX512-BF16)")
    amx = request.param == "bfloat16-amx"
    if amx and not gemm.amx:
        pytest.skip("no AMX tiles here (CPU, kernel or compiler)")
    return Packing(gemm, torch.float32 if request.param == "float32" else torch.bfloat16, amx)


def tolerance(k: int) -> float:
    """float32 sums of k products of N(0, 1) values: error grows like sqrt(k) ulps of sqrt(k)."""
    return 2e-6 * k


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 9, 13, 20, 33, 48, 97, 300])
@pytest.mark.parametrize("out_in", [(16, 8), (40, 24), (1000, 100), (50, 96), (96, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_float64(
    packing: Packing, rows: int, out_in: tuple[int, int], with_bias: bool
) -> None:
    n, k = out_in
    gen = torch.Generator().manual_seed(rows * 7919 + n)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(rows, k, generator=gen)
    packed = packing.pack(w)
    assert packed.panels.dtype == packing.dtype and packed.shape == (n, k)
    got = packed.matmul(x, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, packing.reference(x, w, b), rtol=0, atol=tolerance(k))


def test_large_prefill_rows_cross_the_row_chunks(packing: Packing) -> None:
    """2048 rows x K 1536: several x chunks (the kernel's L2-sized row blocks) per call."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(72, 1536, generator=gen), torch.randn(2048, 1536, generator=gen)
    torch.testing.assert_close(packing.pack(w).matmul(x), packing.reference(x, w, None), rtol=0,
                               atol=tolerance(1536))  # fmt: skip


def assert_rows_keep_their_bits(packing: Packing, n: int, k: int, rows: int, seed: int) -> None:
    """A ``rows`` x ``k`` product by an ``n``-output weight with bias: its first, middle and last
    rows equal each row computed alone (a one-row call: one pass, the decode tile), bit for
    bit; the whole product against float64."""
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    w, x = packing.pack(weight), torch.randn(rows, k, generator=gen)
    batch = w.matmul(x, bias)
    for r in (0, rows // 2, rows - 1):
        assert torch.equal(w.matmul(x[r : r + 1], bias), batch[r : r + 1])
    want = packing.reference(x, weight, bias)
    torch.testing.assert_close(batch, want, rtol=0, atol=tolerance(k))


def assert_glu_rows_keep_their_bits(
    gemm: native_gemm.NativeGemm, inter: int, k: int, rows: int, seed: int
) -> None:
    """The same for a SwiGLU product (``pack_glu``) of ``inter`` outputs."""
    gen = torch.Generator().manual_seed(seed)
    packed = gemm.pack_glu(torch.randn(2 * inter, k, generator=gen) * k**-0.5)
    x = torch.randn(rows, k, generator=gen)
    batch = packed.matmul(x)
    for r in (0, rows // 2, rows - 1):
        assert torch.equal(packed.matmul(x[r : r + 1]), batch[r : r + 1])


def test_long_k_runs_in_slices_with_the_same_sums(packing: Packing) -> None:
    """K above the kernel's one-pass limit with many rows goes in k slices through partial sums
    in y; the sums are the same additions in the same order as one pass over K: each row of a
    300-row call equals that row computed alone (one pass, 1 row), bit for bit, also in the last
    panel of an N that is not a multiple of the panel width (the one that runs K whole)."""
    assert_rows_keep_their_bits(packing, 56, 3000, 300, seed=11)


@pytest.mark.parametrize("rows", [33, 64])
def test_decode_sized_calls_over_a_long_k_keep_each_rows_bits(packing: Packing, rows: int) -> None:
    """Up to 64 rows whose x is past half the L2 (K 6144: 0.8-1.6 MB) multiply in k slices too
    (float32 calls; kernels/csrc/gemm.c ``ps_gemm_kc``): each row still equals that row alone
    (one pass), bit for bit, in the narrower last panel too; and the product against float64."""
    assert_rows_keep_their_bits(packing, 56, 6144, rows, seed=rows + 17)


def test_decode_sized_glu_calls_over_a_long_k_keep_each_rows_bits(
    gemm: native_gemm.NativeGemm,
) -> None:
    """The same for the SwiGLU product at 48 rows: its k slices carry partial sums in a buffer
    the binding sizes from ``ps_gemm_glu_partial`` (the kernel's own slicing decision)."""
    assert_glu_rows_keep_their_bits(gemm, 72, 6144, 48, seed=9)


def test_a_row_gives_the_same_bits_alone_or_in_a_batch(packing: Packing) -> None:
    """Each output is one ordered sum over k: a row's result does not depend on its batch, the
    tile it lands in or the thread count (unlike blocked BLAS kernels)."""
    gen = torch.Generator().manual_seed(5)
    w = packing.pack(torch.randn(300, 192, generator=gen))
    x = torch.randn(37, 192, generator=gen)
    batch = w.matmul(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for r in (0, 5, 36):
            assert torch.equal(w.matmul(x[r : r + 1]), batch[r : r + 1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 12, 64, 97, 256])
def test_requests_for_the_next_block_change_no_value(
    gemm: native_gemm.NativeGemm, packing: Packing, rows: int
) -> None:
    """Decode-sized calls ask for each thread's next block of weight panels while the current
    one is multiplied (``PS_GEMM_NEXT``), also across row chunks (K 1536 splits 97 and 256 rows
    into several): the same bits as a build without the requests, for both thread counts."""
    if packing.amx:
        pytest.skip("the AMX path has no PS_GEMM_NEXT requests")
    plain = native_gemm.load(flags=[*gemm_flags(gemm), "-DPS_GEMM_NEXT=0"])
    assert plain is not None
    gen = torch.Generator().manual_seed(rows)
    for n, k in ((1000, 100), (200, 1536), (3072, 576)):
        weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        x = torch.randn(rows, k, generator=gen)
        w, w_plain = packing.pack(weight), packing.on(plain).pack(weight)
        threads = torch.get_num_threads()
        try:
            for t in {1, max(2, threads)}:
                torch.set_num_threads(t)
                assert torch.equal(w.matmul(x, bias), w_plain.matmul(x, bias))
        finally:
            torch.set_num_threads(threads)


def test_prefill_sized_calls_in_runs_of_panels_change_no_value(
    gemm: native_gemm.NativeGemm, packing: Packing
) -> None:
    """Calls past the decode sizes take each thread's panels in runs, every row chunk of x over
    one run before the next (``PS_GEMM_RUN_BYTES``): runs of one block each give the bits of a
    build without runs, for plain, GLU and int8-widened products and both thread counts."""
    if packing.amx:
        pytest.skip("the AMX path has its own blocking")
    flags = gemm_flags(gemm)
    runs = native_gemm.load(flags=[*flags, "-DPS_GEMM_RUN_BYTES=1"])
    whole = native_gemm.load(flags=[*flags, "-DPS_GEMM_RUN_BYTES=0"])
    assert runs is not None and whole is not None
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(1000, 576, generator=gen), torch.randn(1000, generator=gen)
    x = torch.randn(300, 576, generator=gen)  # 300 rows: 4 chunks of x
    pairs = [(packing.on(runs).pack(weight), packing.on(whole).pack(weight), bias)]
    if packing.dtype == torch.float32:
        pairs.append((runs.pack_glu(weight), whole.pack_glu(weight), None))
    threads = torch.get_num_threads()
    try:
        for t in {1, max(2, threads)}:
            torch.set_num_threads(t)
            for a, b, c in pairs:
                assert torch.equal(a.matmul(x, c), b.matmul(x, c))
    finally:
        torch.set_num_threads(threads)


def gemm_flags(gemm: native_gemm.NativeGemm) -> list[str]:
    """The flags ``gemm`` was built with (its panel width tells the build)."""
    return BUILDS["wide"] if gemm.panel_width == 32 else BUILDS["narrow"]


def test_strided_rows_leading_dims_and_empty_input(packing: Packing) -> None:
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(24, 32, generator=gen)
    w = packing.pack(weight)
    wide = torch.randn(6, 56, generator=gen)
    x = wide[:, 8:40]  # rows 56 floats apart
    torch.testing.assert_close(w.matmul(x), packing.reference(x, weight, None), rtol=0, atol=1e-4)
    x3 = torch.randn(2, 3, 32, generator=gen)
    want = packing.reference(x3.reshape(6, 32), weight, None).reshape(2, 3, 24)
    torch.testing.assert_close(w.matmul(x3), want, rtol=0, atol=1e-4)
    assert w.matmul(torch.empty(0, 32)).shape == (0, 24)
    assert w.shape == (24, 32)


def test_bad_inputs_are_refused(packing: Packing) -> None:
    w = packing.pack(torch.randn(8, 4))
    with pytest.raises(ValueError):
        w.matmul(torch.randn(3, 5))
    with pytest.raises(ValueError):
        w.matmul(torch.randn(3, 4), torch.randn(7))
    with pytest.raises(ValueError):
        packing.pack(torch.randn(8, 4, dtype=torch.float64))
    if packing.dtype == torch.bfloat16:  # k in pairs
        with pytest.raises(ValueError, match="even number"):
            packing.pack(torch.randn(8, 5))
    if packing.dtype == torch.int8:  # k in quads
        with pytest.raises(ValueError, match="multiples of 4"):
            packing.pack(torch.randn(8, 6))


def test_int8_groups_round_to_their_own_scale() -> None:
    """``quantize_int8``: each row's runs of 32 inputs (the last one shorter: 72 = 32 + 32 + 8)
    get a scale that maps their largest magnitude to +-127; every weight lies within half a
    step of its int8 value times its group's scale; a group of zeros keeps scale 0 (and zeros)
    rather than dividing by it; and a group's scale follows its own range, not the row's."""
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(4, 72, generator=gen) * torch.tensor([1e-3, 1, 50, 1])[:, None]
    w[3, 32:64] = 0
    w[1, :32] *= 100  # an outlying group does not coarsen the rest of its row
    q, scale = native_gemm.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (4, 3)
    assert scale[3, 1] == 0 and not q[3, 32:64].any()
    groups = [q[:, :32], q[:, 32:64], q[:, 64:]]
    for g, group in enumerate(groups):
        live = scale[:, g] > 0
        assert (group[live].abs().amax(dim=1) == 127).all()
    assert scale[1, 0] > 50 * scale[1, 1]
    per_k = scale.repeat_interleave(32, dim=1)[:, :72]
    assert ((w - q.float() * per_k).abs() <= per_k / 2 * (1 + 1e-5)).all()
    assert torch.equal(native_gemm.dequantize_int8(q, scale), q.float() * per_k)


def test_a_build_grouping_int8_scales_otherwise_refuses_int8_weights() -> None:
    """The kernel's group of k steps per scale follows its run length (``PS_GEMM_KB``); a build
    with other runs would read ``quantize_int8``'s scales at the wrong steps, so it says so."""
    other = native_gemm.load(flags=[*native.FLAGS, "-DPS_GEMM_KB=4"])
    assert other is not None and other.int8_group == 16
    with pytest.raises(ValueError, match="groups int8 scales by 16, not 32"):
        other.pack_int8(torch.randn(8, 64))


def test_kernel_flags_from_the_environment_reach_every_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``PAGEDSERVE_KERNEL_FLAGS`` is appended to a build's own flags (and keys its cache file):
    the same ``-DPS_GEMM_KB=4`` as above, given through the environment, groups by 16; without
    it the default build's 32."""
    monkeypatch.setenv(native.FLAGS_ENV, "-DPS_GEMM_KB=4")
    assert native.extra_flags() == ["-DPS_GEMM_KB=4"]
    with_env = native_gemm.load(flags=native.FLAGS)
    monkeypatch.delenv(native.FLAGS_ENV)
    plain = native_gemm.load(flags=native.FLAGS)
    assert with_env is not None and plain is not None
    assert (with_env.int8_group, plain.int8_group) == (16, 32)
    assert with_env.path != plain.path


@pytest.mark.parametrize("rows", [1, 7, 32, 33, 48, 300])
def test_int8_products_are_the_float32_ones_with_the_dequantized_weight(
    gemm: native_gemm.NativeGemm, rows: int
) -> None:
    """Each int8 weight is widened and scaled in float32 as ``dequantize_int8`` does, and summed
    in the float32 path's order: the product equals, bit for bit, the float32 C GEMM's with the
    weight ``Q * S`` (so the int8 mode computes exactly a float32 model with those weights),
    at decode and prefill sizes, K with a short last group, biases and a partial last panel;
    on both sides of the row count past which a call widens each block of panels once into
    float32 ones instead of in every tile (``PS_GEMM_I8_WIDEN_ROWS``, 32)."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(72, 580, generator=gen)
    bias, x = torch.randn(72, generator=gen), torch.randn(rows, 580, generator=gen)
    dequantized = native_gemm.dequantize_int8(*native_gemm.quantize_int8(weight))
    got = gemm.pack_int8(weight).matmul(x, bias)
    assert torch.equal(got, gemm.pack(dequantized).matmul(x, bias))


def test_the_bfloat16_path_exists_where_the_cpu_has_avx512_bf16() -> None:
    """The machine's build has it exactly where torch sees AVX512-BF16 with AVX-512 vectors; the
    8-float build never, and packing for it then says why."""
    machine = native_gemm.load(flags=BUILDS["machine"])
    narrow = native_gemm.load(flags=BUILDS["narrow"])
    assert machine is not None and narrow is not None
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if probe is not None and machine.panel_width == 32:
        assert machine.bf16 == bool(probe())
    assert narrow.bf16 is False
    with pytest.raises(ValueError, match="no bfloat16 path"):
        narrow.pack_bf16(torch.randn(8, 4))


def test_the_amx_path_exists_where_the_cpu_has_amx_and_takes_widths_of_32() -> None:
    """The machine's build multiplies on AMX tiles exactly where torch sees them (Linux grants
    the tiles on request); by default a bfloat16 weight goes there when its input width is a
    multiple of 32 and through ``vdpbf16ps`` otherwise; asking for AMX elsewhere says why."""
    machine = native_gemm.load(flags=BUILDS["machine"])
    assert machine is not None
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe is not None and machine.bf16:
        assert machine.amx == bool(probe())
    if not machine.bf16:
        pytest.skip("no bfloat16 path in this build")
    assert machine.tiles_take(64) == machine.amx and not machine.tiles_take(48)
    assert machine.pack_bf16(torch.randn(8, 64)).amx == machine.amx
    assert machine.pack_bf16(torch.randn(8, 48)).amx is False
    assert machine.pack_bf16(torch.randn(8, 64), amx=False).amx is False
    if machine.amx:
        with pytest.raises(ValueError, match="multiples of 32"):
            machine.pack_bf16(torch.randn(8, 48), amx=True)
    else:
        with pytest.raises(ValueError, match="no AMX"):
            machine.pack_bf16(torch.randn(8, 64), amx=True)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 47, 300])
def test_amx_and_vdpbf16ps_paths_agree(gemm: native_gemm.NativeGemm, rows: int) -> None:
    """The two bfloat16 paths multiply the same panels: their results differ only by the order
    of float32 additions inside each tile step (row groups of 16 and 32 and their tails, a
    last panel narrower than 32 columns, bias)."""
    if not gemm.amx:
        pytest.skip("no AMX tiles here (CPU, kernel or compiler)")
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(70, 576, generator=gen), torch.randn(70, generator=gen)
    x = torch.randn(rows, 576, generator=gen)
    tiles, vdp = gemm.pack_bf16(weight, amx=True), gemm.pack_bf16(weight, amx=False)
    assert torch.equal(tiles.panels, vdp.panels)
    torch.testing.assert_close(tiles.matmul(x, bias), vdp.matmul(x, bias), rtol=0,
                               atol=tolerance(576))  # fmt: skip


def test_switch_selects_the_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGEDSERVE_NATIVE_GEMM: 0 packs for oneDNN; 1 and auto for the C GEMM on every CPU (where
    it builds: measured ahead of oneDNN on AVX2 and AVX-512 machines, kernels/gemm.py)."""
    from worker.models.layers import pack_weight

    weight = torch.randn(32, 16)
    monkeypatch.setenv("PAGEDSERVE_NATIVE_GEMM", "0")
    assert not isinstance(pack_weight(weight), native_gemm.PanelWeight)
    monkeypatch.setenv("PAGEDSERVE_NATIVE_GEMM", "1")
    assert isinstance(pack_weight(weight), native_gemm.PanelWeight)
    monkeypatch.setenv("PAGEDSERVE_NATIVE_GEMM", "auto")
    assert native_gemm.load() is not None
    assert isinstance(pack_weight(weight), native_gemm.PanelWeight)


def silu_mul_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """float64 ``silu(x @ gate.T + bg) * (x @ up.T + bu)`` for a stacked gate/up weight."""
    y = x.double() @ w.double().T
    if b is not None:
        y = y + b.double()
    gate, up = y.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).float()


@pytest.mark.parametrize("rows", [1, 5, 13, 64, 97, 300])
@pytest.mark.parametrize("inter_in", [(8, 24), (40, 96), (100, 576), (1536, 512), (24, 2000)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_glu_product_is_silu_gate_times_up(
    gemm: native_gemm.NativeGemm, rows: int, inter_in: tuple[int, int], with_bias: bool
) -> None:
    """``pack_glu`` + ``matmul``: SwiGLU's ``silu(gate) * up`` from one product, against float64,
    for intermediate sizes that leave a last panel half-empty (8, 40, 100), a K long enough to
    run in slices through partial sums at 97 and 300 rows (2000), with and without bias; and
    bit for bit what the plain product followed by the fused SwiGLU pass gives (the same sums,
    the same activation arithmetic), so packing the weight this way changes no token."""
    from kernels import fused

    inter, k = inter_in
    gen = torch.Generator().manual_seed(rows * 31 + inter)
    w = torch.randn(2 * inter, k, generator=gen) * k**-0.5
    b = torch.randn(2 * inter, generator=gen) if with_bias else None
    x = torch.randn(rows, k, generator=gen)
    packed = gemm.pack_glu(w)
    assert packed.glu and packed.out_features == inter and packed.shape == (2 * inter, k)
    got = packed.matmul(x, b)
    assert got.shape == (rows, inter) and got.dtype == torch.float32
    torch.testing.assert_close(got, silu_mul_reference(x, w, b), rtol=1e-5, atol=1e-5)
    ops = fused.load()
    if ops is not None:
        two_pass = ops.silu_mul(gemm.pack(w).matmul(x, b), inter)
        assert torch.equal(got, two_pass)


def test_glu_rows_do_not_depend_on_the_batch(gemm: native_gemm.NativeGemm) -> None:
    gen = torch.Generator().manual_seed(2)
    packed = gemm.pack_glu(torch.randn(2 * 200, 192, generator=gen))
    x = torch.randn(37, 192, generator=gen)
    batch = packed.matmul(x)
    for r in (0, 5, 36):
        assert torch.equal(packed.matmul(x[r : r + 1]), batch[r : r + 1])
    x3 = x.reshape(1, 37, 192)
    assert torch.equal(packed.matmul(x3).reshape(37, 200), batch)


@pytest.mark.parametrize("rows", [257, 1001])
def test_prefill_sized_calls_keep_each_rows_bits(packing: Packing, rows: int) -> None:
    """Calls past the decode sizes (more than 256 rows) multiply in shorter register tiles
    (10 rows on AVX-512, tails of 9; kernels/csrc/gemm.c ``PS_GEMM_MR_BIG``) and other x
    chunks: a row still gets the bits it gets alone (a one-row call, the decode path's tile),
    at the first, a middle and the last row, in a last panel narrower than the panel width
    too; and the plain product against float64."""
    assert_rows_keep_their_bits(packing, 300, 576, rows, seed=rows)


def test_prefill_sized_glu_calls_keep_each_rows_bits(gemm: native_gemm.NativeGemm) -> None:
    """The same for the SwiGLU product (``pack_glu``) at 1001 rows."""
    assert_glu_rows_keep_their_bits(gemm, 200, 576, 1001, seed=4)


def test_glu_bad_inputs_are_refused(gemm: native_gemm.NativeGemm) -> None:
    with pytest.raises(ValueError, match="even number of rows"):
        gemm.pack_glu(torch.randn(7, 4))
    with pytest.raises(ValueError, match="float32"):
        gemm.pack_glu(torch.randn(8, 4, dtype=torch.float64))
    packed = gemm.pack_glu(torch.randn(8, 4))
    with pytest.raises(ValueError):
        packed.matmul(torch.randn(3, 5))
    with pytest.raises(ValueError, match="gate and up"):
        packed.matmul(torch.randn(3, 4), torch.randn(4))


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_the_mlp_runs_swiglu_in_the_product_once_packed_for_it(mlp_bias: bool) -> None:
    """``pack_weights`` packs each layer's fused gate/up weight with ``pack_glu`` where the C
    GEMM is the float32 path; ``GatedMLP`` then takes ``silu(gate) * up`` from the product and
    gives what it gave with the plain weight (the model-level parity suites check tokens)."""
    from worker.models.config import ModelConfig
    from worker.models.layers import GatedMLP, swap_for_packed

    if native_gemm.for_packing() is None:
        pytest.skip("the C GEMM is not the float32 path here")
    cfg = ModelConfig(
        family="llama", architecture="LlamaForCausalLM", num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=12, hidden_size=48, intermediate_size=40, vocab_size=64,
        max_position_embeddings=64, rms_norm_eps=1e-6, dtype=torch.float32, mlp_bias=mlp_bias,
    )  # fmt: skip
    mlp = GatedMLP(cfg, "cpu")
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(9, 48, generator=gen)
    plain = mlp(x)
    assert swap_for_packed(mlp, "gate_up_weight", glu=True)
    assert isinstance(mlp.gate_up_weight, native_gemm.PanelWeight) and mlp.gate_up_weight.glu
    torch.testing.assert_close(mlp(x), plain, rtol=1e-5, atol=1e-5)


def test_int8_widening_scratch_is_freed_when_its_thread_ends() -> None:
    """Calls past 32 rows widen int8 panels into a scratch per calling thread (1.8 MB here: K
    4864, as Qwen2-0.5B's down projection): it is kept for the thread's next calls and freed
    when the thread ends, so threads that come and go (a thread pool calling the engine) do not
    leave their scratch behind (without the free: ~110 MB over these 60 threads)."""
    import threading

    lib = native_gemm.load()
    assert lib is not None
    gen = torch.Generator().manual_seed(6)
    w = lib.pack_int8(torch.randn(576, 4864, generator=gen) * 0.02)
    x = torch.randn(300, 4864, generator=gen)  # 3 panels of k slices of 512: 1.8 MB
    want = w.matmul(x)

    def resident_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    threads = torch.get_num_threads()
    results: list[bool] = []
    try:
        torch.set_num_threads(1)  # the calling thread widens (no OpenMP workers)
        before = resident_mb()
        for _ in range(60):
            t = threading.Thread(target=lambda: results.append(torch.equal(w.matmul(x), want)))
            t.start()
            t.join()
        grown = resident_mb() - before
    finally:
        torch.set_num_threads(threads)
    assert results == [True] * 60
    assert grown < 40, f"resident memory grew {grown:.0f} MB over 60 threads"
