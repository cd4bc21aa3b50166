"""Random paged batches for kernel tests and benchmarks (shared by every backend's tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    """A flat batch with its cache: old context already in the cache, new tokens not yet."""

    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata with each sequence's blocks drawn at random (distinct) from the pool."""
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    needed = sum(blocks_per_seq)
    if needed > num_blocks:
        raise ValueError(f"need {needed} blocks, pool has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_per_seq, default=1) or 1
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    used = 0
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        row = perm[used : used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        for p in range(s_len - q_len, s_len):
            slots.append(row[p // block_size] * block_size + p % block_size)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    cache_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """Random query/key/value and a cache whose old positions hold random values (the cache in
    ``cache_dtype``, default ``dtype``).

    Unused slots are filled with large values so that reading outside a sequence's context
    shows up as a wrong answer rather than passing silently.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum((s + block_size - 1) // block_size for s in seq_lens) + spare_blocks
    meta = make_metadata(query_lens, seq_lens, block_size, num_blocks, gen, device)
    total = sum(query_lens)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).mul_(1e3)
    v_cache = torch.randn(shape, generator=gen).mul_(1e3)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    table = meta.block_tables.cpu().tolist()
    old_slots = [
        table[b][p // block_size] * block_size + p % block_size
        for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True))
        for p in range(s_len - q_len)
    ]
    idx = torch.tensor(old_slots, dtype=torch.long)
    flat_k[idx] = torch.randn(len(old_slots), num_kv_heads, head_dim, generator=gen)
    flat_v[idx] = torch.randn(len(old_slots), num_kv_heads, head_dim, generator=gen)
    query = torch.randn(total, num_heads, head_dim, generator=gen)
    key = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    return PagedBatch(
        query=query.to(device=device, dtype=dtype),
        key=key.to(device=device, dtype=dtype),
        value=value.to(device=device, dtype=dtype),
        k_cache=k_cache.to(device=device, dtype=cache_dtype or dtype),
        v_cache=v_cache.to(device=device, dtype=cache_dtype or dtype),
        meta=meta,
    )


def share_prefix(
    batch: PagedBatch, seqs: list[int], num_blocks: int, consecutive: bool = False
) -> PagedBatch:
    """The batch with ``seqs`` reading the first ``num_blocks`` blocks of ``seqs[0]``'s table.

    This is what prefix caching produces: the same physical block ids at the head of several
    tables. The shared blocks must hold cached positions only (no new token of any of ``seqs``
    is written there). With ``consecutive``, physical blocks are renumbered so that the shared
    prefix occupies ids ``0 .. num_blocks-1`` (a slice of the cache).
    """
    meta = batch.meta
    block_size = batch.k_cache.shape[1]
    for b in seqs:
        cached = meta.seq_lens_host[b] - meta.query_lens_host[b]
        if num_blocks * block_size > cached:
            raise ValueError(f"sequence {b} has only {cached} cached positions")
    table = meta.block_tables.clone()
    table[seqs, :num_blocks] = table[seqs[0], :num_blocks]
    k_cache, v_cache, slots = batch.k_cache, batch.v_cache, meta.slot_mapping
    if consecutive:
        prefix = table[seqs[0], :num_blocks].to(torch.long).tolist()
        rest = [i for i in range(k_cache.shape[0]) if i not in set(prefix)]
        order = torch.tensor(prefix + rest, dtype=torch.long)
        new_id = torch.empty_like(order)
        new_id[order] = torch.arange(order.numel())
        k_cache, v_cache = k_cache[order.to(k_cache.device)], v_cache[order.to(v_cache.device)]
        table = new_id.to(table.device)[table.to(torch.long)].to(table.dtype)
        slots = new_id.to(slots.device)[slots // block_size] * block_size + slots % block_size
    new_meta = AttentionMetadata(
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        block_tables=table,
        slot_mapping=slots,
        query_lens_host=meta.query_lens_host,
        seq_lens_host=meta.seq_lens_host,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
    )
    return PagedBatch(batch.query, batch.key, batch.value, k_cache, v_cache, new_meta)
