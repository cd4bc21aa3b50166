"""Dense reference for paged attention: slow, obvious, used by the tests (in float64).

Masking convention (same as Hugging Face ``masking_utils``): a query at absolute position ``p``
sees cache positions ``k`` with ``k <= p`` and, when ``sliding_window`` is ``W``, ``k > p - W``;
so a token attends to itself and the ``W - 1`` tokens before it.
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Positions ``0 .. seq_len-1`` of one sequence, read through its block table.

    ``cache`` is ``[num_blocks, block_size, num_kv_heads, head_dim]``; the result is
    ``[seq_len, num_kv_heads, head_dim]``.
    """
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    blocks = block_table.to(torch.long)[positions // block_size]
    return cache[blocks, positions % block_size]


def attention_mask(
    q_positions: torch.Tensor, seq_len: int, sliding_window: int | None
) -> torch.Tensor:
    """Boolean ``[len(q_positions), seq_len]``: True where the query may attend."""
    k_positions = torch.arange(seq_len, device=q_positions.device)
    allowed = k_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        allowed &= k_positions[None, :] > q_positions[:, None] - sliding_window
    return allowed


def reference_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``[T, num_heads, head_dim]`` in ``query.dtype``, per sequence, in ``compute_dtype``."""
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for b, (q_len, seq_len) in enumerate(
        zip(meta.query_lens_host, meta.seq_lens_host, strict=True)
    ):
        if q_len == 0:
            continue
        start = starts[b]
        q = query[start : start + q_len].to(compute_dtype)  # [q, H, D]
        k = gather_context(k_cache, meta.block_tables[b], seq_len).to(compute_dtype)
        v = gather_context(v_cache, meta.block_tables[b], seq_len).to(compute_dtype)
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]: query head h uses kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = attention_mask(q_pos, seq_len, sliding_window)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def reference_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token ``i`` at slot ``slot_mapping[i]``, one token at a time."""
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        k_cache[slot // block_size, slot % block_size] = key[i]
        v_cache[slot // block_size, slot % block_size] = value[i]
