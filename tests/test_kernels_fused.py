"""The fused C layer ops (kernels/csrc/fused_ops.c) against the torch ops they replace.

Rope must be bit-identical (both round every product, then add); SiLU (own exp) and RMSNorm
(own summation order) may differ by float32 rounding only. Sizes cover the serial path
(decode-sized) and the OpenMP one (prefill-sized), and widths that are not a multiple of 8.
The greedy sampler's argmax must give torch's tokens (the first maximum, NaN through torch).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import fused
from worker.models.layers import RMSNorm
from worker.models.rope import apply_rope

OPS = fused.load()
pytestmark = pytest.mark.skipif(OPS is None, reason="no C compiler: fused ops not built")


def _ops() -> fused.FusedOps:
    assert OPS is not None
    return OPS


@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (7, 100), (2048, 1536), (3, 4864)])
def test_silu_mul_matches_torch(rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # the exp's clamped ends
    got = _ops().silu_mul(gate_up, inter)
    gate, up = gate_up.split(inter, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)


@pytest.mark.parametrize("inter", [8, 24, 40, 1536, 1543])
def test_silu_mul_wide_and_8_float_builds_agree_bit_for_bit(inter: int) -> None:
    """The build's widest vectors (16 floats under AVX-512), then 8-float steps, then scalars:
    the same arithmetic per lane as the 8-float build (``-DPS_WIDE_LANES=8``, what an AVX2
    machine compiles), so the outputs are identical, tails included."""
    from kernels import native

    narrow = fused.FusedOps(
        native.build(source=fused.SOURCE, flags=[*fused.FLAGS, "-DPS_WIDE_LANES=8"])
    )
    g = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(5, 2 * inter, generator=g) * 8
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    assert torch.equal(_ops().silu_mul(gate_up, inter), narrow.silu_mul(gate_up, inter))


def test_silu_mul_reads_strided_rows() -> None:
    """A row-sliced projection output (rows a stride apart) is read where it lies."""
    big = torch.randn(10, 2 * 64)
    view = big[::2]
    torch.testing.assert_close(
        _ops().silu_mul(view, 64), F.silu(view[:, :64]) * view[:, 64:], rtol=4e-7, atol=0
    )


@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (5, 13), (2048, 576), (4, 896)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(rows: int, dim: int, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(dim)
    residual = torch.randn(rows, dim, generator=g) * 3
    delta = torch.randn(rows, dim, generator=g) if with_delta else None
    norm = RMSNorm(dim, 1e-5, torch.float32, "cpu")
    norm.weight.data.copy_(torch.randn(dim, generator=g))
    want_res = residual + delta if delta is not None else residual.clone()
    want = norm(want_res)
    res_after, got = norm.add_norm(residual, delta, _ops())
    assert res_after is residual  # updated in place
    assert torch.equal(residual, want_res)  # the add is the same float add
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9, 300])
def test_rope_kv_is_bit_identical_and_writes_the_slots(
    tokens: int, cache_dtype: torch.dtype
) -> None:
    """Into float32 caches the rotated k and v themselves; into bfloat16 caches
    (``--kv-cache-dtype bfloat16``) the bits of torch's ``.to(torch.bfloat16)`` of them,
    ties (round half to even), infinities and subnormals included."""
    heads, kv_heads, d, block = 9, 3, 64, 16
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    edges = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0e38, float("inf"), -float("inf"),
             1e-40, -1e-40, 0.0, -0.0, 65504.0, 2**-133]  # fmt: skip
    qkv[0, -len(edges) :] = torch.tensor(edges)  # in v: stored as they are
    positions = torch.randint(0, 1000, (tokens,), generator=g)
    angles = torch.randn(1024, 1, d // 2, generator=g)
    table = torch.cat((angles.cos(), angles.sin()), dim=1).contiguous()  # [P, 2, D/2]
    blocks = -(-tokens // block) + 2
    k_cache = torch.zeros(blocks, block, kv_heads, d, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(blocks * block, generator=g)[:tokens]
    # the torch path of PagedAttention
    cos_sin = table[positions]
    qk = apply_rope(qkv[:, : (heads + kv_heads) * d].view(tokens, -1, d),
                    cos_sin[:, 0:1], cos_sin[:, 1:2])  # fmt: skip
    want_v = qkv[:, (heads + kv_heads) * d :].reshape(tokens, kv_heads, d)
    _ops().rope_kv(qkv, heads, kv_heads, d, table, positions, k_cache, v_cache, slots)
    got = qkv[:, : (heads + kv_heads) * d].view(tokens, -1, d)
    assert torch.equal(got, qk)
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    bits = torch.int32 if cache_dtype == torch.float32 else torch.int16
    assert torch.equal(flat_k[slots].view(bits), qk[:, heads:].to(cache_dtype).view(bits))
    assert torch.equal(flat_v[slots].view(bits), want_v.to(cache_dtype).view(bits))
    untouched = torch.ones(blocks * block, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_layout_checks_refuse_what_the_kernels_cannot_read() -> None:
    with pytest.raises(ValueError):
        _ops().silu_mul(torch.randn(4, 10).t(), 2)
    with pytest.raises(ValueError):
        _ops().add_rms_norm(torch.randn(4, 8).t(), None, torch.ones(4), 1e-6)


@pytest.mark.parametrize("rows", [1, 3, 48, 300])
@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 49152, 151936])
def test_argmax_gives_torchs_tokens(rows: int, vocab: int) -> None:
    """The greedy sampler's argmax: torch's index for every row, also where the maximum repeats
    (the first one), with vocabularies shorter than a vector and not a multiple of one, on the
    serial and the OpenMP paths."""
    g = torch.Generator().manual_seed(rows * 13 + vocab)
    logits = torch.randn(rows, vocab, generator=g)
    assert _ops().argmax(logits) == torch.argmax(logits, dim=-1).tolist()
    ties = torch.randint(0, 3, (rows, vocab), generator=g).float()
    assert _ops().argmax(ties) == torch.argmax(ties, dim=-1).tolist()


def test_argmax_edge_rows_and_layouts() -> None:
    """NaN (torch counts it as the largest: the kernel hands such calls to torch), rows of
    -inf, strided rows; a layout it cannot read is refused."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 300, generator=g)
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[3, 40:60] = float("inf")
    assert _ops().argmax(logits) == torch.argmax(logits, dim=-1).tolist()
    strided = torch.randn(6, 500, generator=g)[:, 100:400]
    assert _ops().argmax(strided) == torch.argmax(strided, dim=-1).tolist()
    for bad in (torch.randn(4, 10).T, torch.randn(3, 0), torch.randn(10)):
        with pytest.raises(ValueError):
            _ops().argmax(bad)


def test_the_sampler_takes_greedy_tokens_through_the_kernel_where_it_can() -> None:
    """``greedy_tokens``: torch's tokens for float32 CPU logits (the kernel), column-strided ones
    and other dtypes (torch)."""
    from worker.sampler import greedy_tokens

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 1000, generator=g)
    want = torch.argmax(logits, dim=-1).tolist()
    assert greedy_tokens(logits) == want
    assert greedy_tokens(logits.double()) == want
    wide = torch.randn(9, 2000, generator=g)
    assert greedy_tokens(wide[:, ::2]) == torch.argmax(wide[:, ::2], dim=-1).tolist()
