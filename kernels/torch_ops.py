"""The CPU backend's per-layer attention over a planned step: decode chunks and prefill chunks.

Each function runs one piece of a :class:`kernels.torch_plan.DecodePlan` with the CPU flash
kernel, gathering cached blocks into a reused :class:`Workspace`; see :mod:`kernels.torch_backend`
for why the work is cut this way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata
from kernels.torch_plan import DecodeChunk, Prefill, PrefillWork


def flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention returning ``(output, logsumexp)``: ``[B, H, q, D]`` queries against
    ``[B, Hkv, L, D]`` keys/values (query head ``h`` reads KV head ``h // (H / Hkv)``), additive
    float mask broadcast to ``[B, H, q, L]``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=mask, scale=scale
    )


class Workspace:
    """Two reusable gather buffers (K and V) per dtype, grown on demand."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        numel = 1
        for s in shape:
            numel *= s
        key = (dtype, device)
        bufs = self._bufs.get(key)
        if bufs is None or bufs[0].numel() < numel:
            bufs = (
                torch.empty(numel, dtype=dtype, device=device),
                torch.empty(numel, dtype=dtype, device=device),
            )
            self._bufs[key] = bufs
        return bufs[0][:numel].view(shape), bufs[1][:numel].view(shape)


def decode_chunk(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: DecodeChunk,
    scale: float,
    cdt: torch.dtype,
    workspace: Workspace,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([n, H, D], [n, H])``: single-token queries over contexts padded to ``num_blocks``.

    The CPU flash kernel reads KV head ``h // (H / Hkv)`` for query head ``h`` (no expansion)
    and returns the log-sum-exp that the shared-prefix merge needs.
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    n = chunk.token_idx.shape[0]
    length = chunk.num_blocks * block_size
    k_buf, v_buf = workspace.get(
        (n * chunk.num_blocks, block_size, num_kv_heads, head_dim),
        k_cache.dtype,
        k_cache.device,
    )
    torch.index_select(k_cache, 0, chunk.block_ids, out=k_buf)
    torch.index_select(v_cache, 0, chunk.block_ids, out=v_buf)
    # [n, L, Hkv, D] -> strided [n, Hkv, L, D] views: the kernel reads them without a copy
    k = k_buf.view(n, length, num_kv_heads, head_dim).to(cdt).transpose(1, 2)
    v = v_buf.view(n, length, num_kv_heads, head_dim).to(cdt).transpose(1, 2)
    q = query.index_select(0, chunk.token_idx).to(cdt).unsqueeze(2)  # [n, H, 1, D]
    o, lse = flash(q, k, v, chunk.mask, scale)
    return o.reshape(n, num_heads, head_dim), lse.reshape(n, num_heads).to(cdt)


def prefill_chunk(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    pre: Prefill,
    work: PrefillWork,
    scale: float,
    cdt: torch.dtype,
    workspace: Workspace,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One prefill chunk: ``([q, H, D], [q, H] log-sum-exp or None)`` in ``cdt``.

    Fresh K/V when nothing precedes the chunk (rounded to the cache's dtype first, so that
    every path attends over what the cache holds), else the context gathered from the cache
    from ``work.first_block`` on (after a shared prefix, or where the window starts).
    """
    s, q_len, seq_len = pre.start, pre.query_len, pre.seq_len
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    if seq_len == q_len:
        k, v = key[s : s + q_len], value[s : s + q_len]
        if k_cache.dtype != k.dtype:  # e.g. a bfloat16 cache under float32 activations
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    else:
        nb = (seq_len + block_size - 1) // block_size
        blocks = meta.block_tables[pre.seq_index, work.first_block : nb].to(torch.long)
        k_buf, v_buf = workspace.get(
            (nb - work.first_block, block_size, num_kv_heads, head_dim),
            k_cache.dtype,
            k_cache.device,
        )
        torch.index_select(k_cache, 0, blocks, out=k_buf)
        torch.index_select(v_cache, 0, blocks, out=v_buf)
        length = seq_len - work.first_block * block_size
        k, v = k_buf.flatten(0, 1)[:length], v_buf.flatten(0, 1)[:length]
    k = k.to(cdt).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    v = v.to(cdt).transpose(0, 1).unsqueeze(0)
    q = query[s : s + q_len].to(cdt)
    if work.mask is None:  # fresh, no window: plain causal
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k, v, is_causal=True, scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # fmt: skip
        return o[0].transpose(0, 1), None
    o, lse = flash(q.transpose(0, 1).unsqueeze(0), k, v, work.mask, scale)
    return o[0].transpose(0, 1), lse[0].transpose(0, 1).to(cdt)
