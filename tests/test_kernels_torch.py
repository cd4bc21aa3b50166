"""The torch (CPU) backend against the float64 dense reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import get_backend, torch_backend
from kernels import native as native_kernel
from kernels.reference import reference_paged_attention, reference_write_kv
from kernels.testing import PagedBatch, make_batch, share_prefix
from kernels.torch_backend import TorchBackend


@pytest.fixture(autouse=True, scope="module", params=["torch", "native", "native-cascade"])
def decode_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test three times: decodes in plain torch; through the C kernel (float32 only;
    other dtypes and shapes stay in torch either way) with the cascade's groups in torch's
    flash call; and through the C kernel with the groups in the tiled kernel's all-keys mode.
    Cascade groups form for every shared prefix (the C kernel's default leaves small ones to
    the kernel: tests/test_kernels_native.py). Module-scoped so hypothesis accepts it."""
    original, policy = native_kernel.load, torch_backend.cascade_policy
    if request.param != "torch" and original() is None:
        pytest.skip("the native decode kernel did not build here (no C compiler?)")
    if request.param == "torch":
        native_kernel.load = lambda kv_dtype=torch.float32: None
    # the cascade's groups and merges are checked with the C kernel too, on small prefixes
    in_kernel = request.param == "native-cascade"
    torch_backend.cascade_policy = lambda kernel: torch_backend.CascadePolicy(in_kernel=in_kernel)
    yield request.param
    native_kernel.load, torch_backend.cascade_policy = original, policy


def run_and_compare(
    batch: PagedBatch,
    sliding_window: int | None = None,
    atol: float = 2e-5,
    rtol: float = 1e-4,
    backend: TorchBackend | None = None,
) -> None:
    """write_kv then paged_attention, checked against the reference on a copy of the cache."""
    backend = backend or TorchBackend()
    scale = batch.query.shape[-1] ** -0.5
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    reference_write_kv(batch.key, batch.value, ref_k, ref_v, batch.meta.slot_mapping)
    backend.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    torch.testing.assert_close(batch.k_cache, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(batch.v_cache, ref_v, atol=0, rtol=0)
    expected = reference_paged_attention(
        batch.query.double(), ref_k.double(), ref_v.double(), batch.meta, scale, sliding_window
    )
    got = backend.paged_attention(
        batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, scale,
        sliding_window,
    )  # fmt: skip
    assert got.dtype == batch.query.dtype
    assert got.shape == batch.query.shape
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)


# (query_lens, seq_lens): the named edge cases
CASES = {
    "decode_ragged": ([1, 1, 1, 1], [1, 7, 33, 60]),
    "one_full_block": ([1, 16], [16, 16]),
    "one_past_block": ([1, 1], [17, 33]),
    "pure_prefill": ([12], [12]),
    "prefix_then_chunk": ([9], [40]),
    "mixed": ([5, 1, 20, 1, 1], [5, 30, 50, 2, 17]),
    "chunk_ends_on_boundary": ([16, 1], [32, 16]),
    "full_blocks_different_lengths": ([1, 1, 1], [16, 32, 64]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_named_cases(case: str, block_size: int) -> None:
    q_lens, s_lens = CASES[case]
    batch = make_batch(
        q_lens, s_lens, num_heads=8, num_kv_heads=4, head_dim=64, block_size=block_size
    )
    run_and_compare(batch)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 4), (8, 2), (6, 1)])
def test_heads_and_gqa(head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    batch = make_batch(
        [1, 7, 1, 3], [19, 7, 40, 25],
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
    )  # fmt: skip
    run_and_compare(batch)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window(window: int) -> None:
    batch = make_batch(
        [1, 1, 10, 30, 1], [3, 50, 45, 30, 33],
        num_heads=8, num_kv_heads=4, head_dim=32, block_size=8, seed=window,
    )  # fmt: skip
    run_and_compare(batch, sliding_window=window)


def test_sliding_window_matches_transformers_convention() -> None:
    """HF: kv_idx > q_idx - W, so each token sees itself and the W - 1 before it."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    from kernels.reference import attention_mask

    window, length = 4, 10
    hf = sliding_window_causal_mask_function(window)
    ours = attention_mask(torch.arange(length), length, window)
    for q in range(length):
        for k in range(length):
            hf_allowed = hf(0, 0, torch.tensor(q), torch.tensor(k))
            assert bool(ours[q, k]) == bool(hf_allowed), (q, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype: torch.dtype) -> None:
    batch = make_batch(
        [1, 9, 1], [30, 20, 64],
        num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
    )  # fmt: skip
    run_and_compare(batch, atol=2e-2, rtol=2e-2)


def test_float64_stays_float64() -> None:
    batch = make_batch(
        [1, 6], [21, 30], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
        dtype=torch.float64,
    )  # fmt: skip
    run_and_compare(batch, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("chunk_bytes", [1, 64 * 1024, 1 << 30])
def test_many_decodes_in_chunks(chunk_bytes: int, window: int | None) -> None:
    """Spread-out decode lengths, cut into one chunk per token, a few chunks, or one chunk."""
    gen = torch.Generator().manual_seed(7)
    s_lens = torch.randint(1, 300, (96,), generator=gen).tolist()
    q_lens = [1] * 96
    q_lens[10], s_lens[10] = 40, 200  # a prefill in the middle of the decodes
    batch = make_batch(q_lens, s_lens, num_heads=8, num_kv_heads=4, head_dim=64, block_size=16)
    run_and_compare(batch, sliding_window=window, backend=TorchBackend(chunk_bytes=chunk_bytes))


def test_plan_is_reused_across_layers_and_rebuilt_per_step() -> None:
    backend = TorchBackend()
    first = make_batch([1, 4], [20, 4], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    run_and_compare(make_batch_like(first), backend=backend)
    plan = backend._plan
    work = dict(plan.decode)  # the per-(window, dtype) work planned by the first layer
    assert len(plan.decode_seqs) == 1 and len(plan.prefill) == 1 and len(work) == 1
    run_and_compare(make_batch_like(first), backend=backend)  # a second layer, same metadata
    assert backend._plan is plan, "a later layer of the same step must reuse the plan"
    assert all(plan.decode[k] is w for k, w in work.items()) and plan.decode.keys() == work.keys()
    second = make_batch(
        [1, 1, 3], [9, 40, 12], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=3
    )
    run_and_compare(second, backend=backend)  # the next step: new metadata
    assert backend._plan is not plan, "a new step must build a new plan"
    assert len(backend._plan.decode_seqs) == 2 and len(backend._plan.prefill) == 1
    assert len(plan.decode_seqs) == 1, "the old plan is left as it was, not edited in place"


def make_batch_like(batch: PagedBatch) -> PagedBatch:
    """Same metadata object, fresh tensors (as a second layer would see)."""
    return PagedBatch(
        query=torch.randn_like(batch.query),
        key=torch.randn_like(batch.key),
        value=torch.randn_like(batch.value),
        k_cache=batch.k_cache.clone(),
        v_cache=batch.v_cache.clone(),
        meta=batch.meta,
    )


@settings(max_examples=25, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(1, 70), st.integers(0, 70), st.booleans()), min_size=1, max_size=6
    ),
    block_size=st.sampled_from([8, 16, 32]),
    gqa=st.sampled_from([(4, 4), (4, 2), (8, 2)]),
    window=st.one_of(st.none(), st.integers(1, 80)),
    seed=st.integers(0, 2**16),
)
def test_random_batches(
    data: list[tuple[int, int, bool]],
    block_size: int,
    gqa: tuple[int, int],
    window: int | None,
    seed: int,
) -> None:
    q_lens = [1 if decode else q for q, _, decode in data]
    s_lens = [q + prefix for (_, prefix, _), q in zip(data, q_lens, strict=True)]
    batch = make_batch(
        q_lens, s_lens, num_heads=gqa[0], num_kv_heads=gqa[1], head_dim=32,
        block_size=block_size, seed=seed,
    )  # fmt: skip
    run_and_compare(batch, sliding_window=window)


def test_write_kv_scatters_by_slot() -> None:
    backend = TorchBackend()
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros(4, 8, 2, 16)
    slots = torch.tensor([31, 0, 9, 17], dtype=torch.int64)
    key = torch.randn(4, 2, 16)
    value = torch.randn(4, 2, 16)
    backend.write_kv(key, value, k_cache, v_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 8, slot % 8], key[i])
        assert torch.equal(v_cache[slot // 8, slot % 8], value[i])
    written = torch.zeros(32, dtype=torch.bool)
    written[slots] = True
    assert k_cache.view(32, -1)[~written].abs().sum() == 0


def test_get_backend_picks_torch_on_cpu() -> None:
    backend = get_backend("cpu")
    assert backend.name == "torch"
    assert get_backend("cpu") is backend


# ---------------------------------------------------------------- shared prefixes (cascade)


def shared_group_sizes(backend: TorchBackend) -> list[tuple[int, int]]:
    """``(query tokens, shared blocks)`` of every shared-prefix group the last plan found."""
    return sorted(
        (g.token_idx.shape[0], g.num_blocks)
        for decode in backend._plan.decode.values()
        for g in decode.shared
    )


def groups_in_tiled_kernel(backend: TorchBackend) -> list[bool]:
    """Per planned (window, dtype) with groups: whether its groups ran in the tiled kernel."""
    return [d.shared_native is not None for d in backend._plan.decode.values() if d.shared]


def shared_batch(
    groups: list[tuple[int, int, list[int]]],
    others: list[tuple[int, int]],
    *,
    block_size: int,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    consecutive: bool = False,
) -> PagedBatch:
    """Decode groups ``(sequences, shared blocks, private tail lengths)`` plus other sequences
    ``(query_len, seq_len)``, interleaved in the flat batch."""
    q_lens: list[int] = []
    s_lens: list[int] = []
    members: list[list[int]] = []
    pending = list(others)
    for num_seqs, blocks, tails in groups:
        members.append([])
        for i in range(num_seqs):
            members[-1].append(len(q_lens))
            q_lens.append(1)
            s_lens.append(blocks * block_size + tails[i % len(tails)])
            if pending and i % 2 == 1:  # interleave the other sequences with the groups'
                q_len, s_len = pending.pop(0)
                q_lens.append(q_len)
                s_lens.append(s_len)
    for q_len, s_len in pending:
        q_lens.append(q_len)
        s_lens.append(s_len)
    batch = make_batch(
        q_lens, s_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, seed=seed,
    )  # fmt: skip
    for seqs, (_, blocks, _) in zip(members, groups, strict=True):
        batch = share_prefix(batch, seqs, blocks, consecutive=consecutive)
    return batch


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 4), (8, 2)])
@pytest.mark.parametrize(
    ("num_seqs", "blocks", "tails"),
    [(2, 1, [1, 5]), (5, 7, [1, 20, 33, 64, 3]), (40, 3, [1, 2, 9, 17]), (3, 70, [30, 1, 70])],
)
def test_shared_prefix_decode(
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    num_seqs: int,
    blocks: int,
    tails: list[int],
    decode_path: str,
) -> None:
    batch = shared_batch(
        [(num_seqs, blocks, tails)], [], block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )  # fmt: skip
    backend = TorchBackend()
    run_and_compare(batch, backend=backend)
    assert shared_group_sizes(backend) == [(num_seqs, blocks)]
    assert groups_in_tiled_kernel(backend) == [decode_path == "native-cascade"]


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_shared_prefix_with_only_partial_private_block(block_size: int) -> None:
    """Tails shorter than a block: each sequence's only private block is its last, partial one."""
    tails = [1, block_size - 1, block_size // 2, block_size]
    batch = shared_batch([(4, 5, tails)], [], block_size=block_size)
    backend = TorchBackend()
    run_and_compare(batch, backend=backend)
    assert shared_group_sizes(backend) == [(4, 5)]


def test_shared_prefix_common_only_to_part_of_some_tables() -> None:
    """Four tables share 3 blocks; two of them share 9. The group reads the common 3 once."""
    batch = make_batch(
        [1, 1, 1, 1], [9 * 16 + 4, 12 * 16, 3 * 16 + 1, 10 * 16 + 15],
        num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, seed=5,
    )  # fmt: skip
    batch = share_prefix(batch, [0, 1, 2, 3], 3)
    batch = share_prefix(batch, [0, 1, 3], 9)
    backend = TorchBackend()
    run_and_compare(batch, backend=backend)
    assert shared_group_sizes(backend) == [(4, 3)]


@pytest.mark.parametrize("chunk_bytes", [1, 64 * 1024, 1 << 30])
@pytest.mark.parametrize("consecutive", [False, True])
def test_several_groups_with_prefills_and_private_decodes(
    chunk_bytes: int, consecutive: bool
) -> None:
    others = [(1, 37), (12, 80), (1, 5), (1, 200), (30, 30), (1, 64), (1, 1)]
    batch = shared_batch(
        [(6, 4, [3, 40, 17]), (2, 11, [8, 1]), (9, 1, [1, 100, 16, 50])], others,
        block_size=16, head_dim=64, seed=11, consecutive=consecutive,
    )  # fmt: skip
    backend = TorchBackend(chunk_bytes=chunk_bytes)
    run_and_compare(batch, backend=backend)
    assert shared_group_sizes(backend) == [(2, 11), (6, 4), (9, 1)]


def test_prefill_reading_a_shared_prefix() -> None:
    """A prefill chunk after a prefix-cache hit joins the group: 1 + 20 + 1 query tokens."""
    batch = make_batch(
        [1, 20, 1], [70, 84, 50], num_heads=8, num_kv_heads=4, head_dim=32, block_size=8, seed=2
    )
    batch = share_prefix(batch, [0, 1, 2], 6)
    backend = TorchBackend(tiled_prefill=False)  # the tiled C kernel's chunks stay out of groups
    run_and_compare(batch, backend=backend)
    assert shared_group_sizes(backend) == [(22, 6)]


@pytest.mark.parametrize("window", [1, 20, 100, 10_000])
def test_shared_prefix_with_sliding_window_falls_back(window: int) -> None:
    batch = shared_batch([(5, 6, [1, 9, 30])], [(1, 40), (7, 60)], block_size=8, seed=window)
    backend = TorchBackend()
    run_and_compare(batch, sliding_window=window, backend=backend)
    assert shared_group_sizes(backend) == []


@pytest.mark.parametrize(
    ("dtype", "atol", "rtol"),
    [(torch.float64, 1e-12, 1e-10), (torch.bfloat16, 2e-2, 2e-2), (torch.float16, 2e-2, 2e-2)],
)
def test_shared_prefix_dtypes(dtype: torch.dtype, atol: float, rtol: float) -> None:
    batch = shared_batch([(4, 5, [2, 19, 40])], [(1, 33)], block_size=16, dtype=dtype)
    backend = TorchBackend()
    run_and_compare(batch, atol=atol, rtol=rtol, backend=backend)
    assert shared_group_sizes(backend) == [(4, 5)]


def test_shared_prefix_plan_reused_across_layers() -> None:
    backend = TorchBackend()
    first = shared_batch([(3, 4, [5, 20])], [(1, 9)], block_size=8)
    for _ in range(2):
        run_and_compare(make_batch_like(first), backend=backend)
    assert shared_group_sizes(backend) == [(3, 4)]
    run_and_compare(shared_batch([(2, 2, [1])], [], block_size=8, seed=4), backend=backend)
    assert shared_group_sizes(backend) == [(2, 2)]


@settings(max_examples=25, deadline=None)
@given(
    groups=st.lists(
        st.tuples(st.integers(2, 12), st.integers(1, 12), st.lists(st.integers(1, 60), min_size=1)),
        min_size=1,
        max_size=3,
    ),
    others=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 60)), max_size=4),
    block_size=st.sampled_from([8, 16, 32]),
    gqa=st.sampled_from([(4, 4), (4, 2), (8, 2)]),
    chunk_bytes=st.sampled_from([1, 64 * 1024, 1 << 30]),
    seed=st.integers(0, 2**16),
)
def test_random_shared_prefix_batches(
    groups: list[tuple[int, int, list[int]]],
    others: list[tuple[int, int]],
    block_size: int,
    gqa: tuple[int, int],
    chunk_bytes: int,
    seed: int,
) -> None:
    other_seqs = [(q, q + extra) for q, extra in others]
    batch = shared_batch(
        groups, other_seqs, block_size=block_size, num_heads=gqa[0], num_kv_heads=gqa[1],
        seed=seed,
    )  # fmt: skip
    backend = TorchBackend(chunk_bytes=chunk_bytes)
    run_and_compare(batch, backend=backend)
    found = shared_group_sizes(backend)
    assert sum(n for n, _ in found) >= sum(n for n, _, _ in groups)


@pytest.mark.parametrize("window", [None, 12, 300])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefills_sharing_a_prefix(
    window: int | None, num_heads: int, num_kv_heads: int, block_size: int
) -> None:
    """Prefill chunks after prefix-cache hits (one of them cached up to the shared prefix only)
    grouped with decodes; a window falls back to each sequence reading its own context."""
    shared = 4
    q_lens = [20, 33, 1, 7, 1, 16]
    cached = [shared * block_size, shared * block_size + 40, 170, 5 * block_size + 3, 200, 9]
    s_lens = [q + c for q, c in zip(q_lens, cached, strict=True)]
    batch = make_batch(
        q_lens, s_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32,
        block_size=block_size, seed=block_size,
    )  # fmt: skip
    batch = share_prefix(batch, [0, 1, 2, 3, 4], shared)
    backend = TorchBackend(tiled_prefill=False)  # the tiled C kernel's chunks stay out of groups
    run_and_compare(batch, sliding_window=window, backend=backend)
    assert shared_group_sizes(backend) == ([] if window else [(20 + 33 + 1 + 7 + 1, shared)])
