"""The Triton kernels of paged attention (launched by :mod:`kernels.triton_backend`).

Three kernels:

* ``write_kv_kernel``: one program per new token copies its K and V rows to its slot;
* decode (``query_len == 1``): flash-decoding. Each (token, KV head, split) program walks its
  share of the context through the block table with an online softmax for all the query heads of
  that KV head at once (one ``tl.dot``, so each K/V row is read once per token, not once per query
  head) and writes partials (max, sum, unnormalised output); ``decode_reduce_kernel`` merges the
  splits. Splitting keeps the GPU busy when a few sequences have long contexts;
* prefill (``query_len > 1``): one program per (tile of ``BLOCK_M`` query tokens of one sequence,
  query head) walks the cached context before the chunk and the chunk itself (causal), with
  ``tl.dot`` on ``BLOCK_M x BLOCK_N`` tiles. KV tiles are gathered token by token through the block
  table, so any block size works.

GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``. Sliding window: the
query at position ``p`` sees ``p - W < k <= p`` (Hugging Face's convention). Softmax and
accumulation are fp32. Under ``TRITON_INTERPRET=1`` every tile is converted to fp32 first (the
interpreter mishandles bf16) and context loops are ``while`` loops (the interpreter cannot turn
its 1-element tensors into ``range`` bounds under numpy 2.4); compiled kernels use ``for`` loops,
which Triton can pipeline. The variable must be set before this module is imported (a test
that sets it later reloads this module, then :mod:`kernels.triton_backend`).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # negative slots mark padding tokens
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, D_PAD)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        dst = block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + d[None, :]
        k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _kv_tile_scores(
    n0, hi, q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, stride_cb, stride_cs,
    stride_ch, stride_bt, d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Context tokens ``n0 .. n0 + BLOCK_N`` (those from ``hi`` on masked) gathered through the
    block table: their positions, the mask, ``q``'s unscaled scores against their keys (rows of
    ``q`` x tokens) and their values (fp32 where ``DOT_FP32``)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    p_mask = pos < hi
    block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=p_mask, other=0)
    base = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = p_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return pos, p_mask, s, v


@triton.jit
def _weighted_values(p, v, DOT_FP32: tl.constexpr):
    """``p @ v``: fp32 weights in full precision, else rounded to the cache's type (the tensor
    cores' inputs), accumulated in fp32 either way."""
    if DOT_FP32:  # noqa: SIM108 (keep Triton's control flow explicit)
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return pv


@triton.jit
def _decode_tile(
    n0, end, q, m_run, l_run, acc, scale, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq,
    kv_head, stride_cb, stride_cs, stride_ch, stride_bt, d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """One tile of ``BLOCK_N`` context tokens for the ``G_PAD`` query heads of one KV head
    (online softmax per head): each K/V row is loaded once for the whole group."""
    _, p_mask, s, v = _kv_tile_scores(
        n0, end, q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, stride_cb,
        stride_cs, stride_ch, stride_bt, d, d_mask, BLOCK_SIZE, BLOCK_N, DOT_FP32,
    )  # fmt: skip
    s = tl.where(p_mask[None, :], s * scale, -float("inf"))  # [G_PAD, BLOCK_N]
    m_new = tl.maximum(m_run, tl.max(s, axis=1))  # finite: the tile holds a valid position
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_run - m_new)
    l_run = l_run * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _weighted_values(p, v, DOT_FP32)
    return m_new, l_run, acc


@triton.jit
def decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    token_rows_ptr,
    seq_ids_ptr,
    part_m_ptr,  # [n, H, NUM_SPLITS] fp32
    part_l_ptr,
    part_acc_ptr,  # [n, H, NUM_SPLITS, D_PAD] fp32
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
):
    """One program per (decode token, KV head, split): the GROUP query heads sharing the KV head
    are the rows of one ``tl.dot`` (padded to ``G_PAD`` >= 16), so the KV head's context is read
    once per token instead of once per query head."""
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(token_rows_ptr + i)
    seq = tl.load(seq_ids_ptr + i)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, G_PAD)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_run = tl.full([G_PAD], -float("inf"), dtype=tl.float32)
    l_run = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    if WHILE_LOOPS:
        n0 = start
        while n0 < end:
            m_run, l_run, acc = _decode_tile(
                n0, end, q, m_run, l_run, acc, scale, k_cache_ptr, v_cache_ptr,
                block_tables_ptr, seq, kv_head, stride_cb, stride_cs, stride_ch, stride_bt, d,
                d_mask, BLOCK_SIZE, BLOCK_N, DOT_FP32,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_run, l_run, acc = _decode_tile(
                n0, end, q, m_run, l_run, acc, scale, k_cache_ptr, v_cache_ptr,
                block_tables_ptr, seq, kv_head, stride_cb, stride_cs, stride_ch, stride_bt, d,
                d_mask, BLOCK_SIZE, BLOCK_N, DOT_FP32,
            )  # fmt: skip

    part = (i * NUM_HEADS + heads) * NUM_SPLITS + split  # [G_PAD]
    tl.store(part_m_ptr + part, m_run, mask=g_mask)
    tl.store(part_l_ptr + part, l_run, mask=g_mask)
    tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def decode_reduce_kernel(
    out_ptr,
    token_rows_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    row = tl.load(token_rows_ptr + i)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_PAD)
    base = (i * num_heads + h) * NUM_SPLITS
    m = tl.load(part_m_ptr + base + s)
    l_part = tl.load(part_l_ptr + base + s)
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * D_PAD + d[None, :])
    m_max = tl.max(m, axis=0)  # finite: the split holding the query's own position is non-empty
    w = tl.where(l_part > 0, tl.exp(m - m_max), 0.0)
    total = tl.sum(l_part * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(
        out_ptr + row * stride_ot + h * stride_oh + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


@triton.jit
def _prefill_tile(
    n0, hi, q, q_pos, m_run, l_run, acc, scale, window, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq, kv_head, stride_cb, stride_cs, stride_ch, stride_bt, d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_M x BLOCK_N`` tile of a prefill chunk (causal, online softmax)."""
    pos, p_mask, s, v = _kv_tile_scores(
        n0, hi, q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, stride_cb,
        stride_cs, stride_ch, stride_bt, d, d_mask, BLOCK_SIZE, BLOCK_N, DOT_FP32,
    )  # fmt: skip
    allowed = p_mask[None, :] & (pos[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
    s = tl.where(allowed, s * scale, -float("inf"))
    m_new = tl.maximum(m_run, tl.max(s, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows with nothing seen yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_run - m_safe)
    l_run = l_run * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _weighted_values(p, v, DOT_FP32)
    m_run = m_new
    return m_run, l_run, acc


@triton.jit
def prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    tile_seq_ptr,
    tile_q0_ptr,
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)  # first query of the tile, counted within the sequence
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = h // GROUP

    m_idx = q0 + tl.arange(0, BLOCK_M)
    m_mask = m_idx < q_len
    q_pos = seq_len - q_len + m_idx
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    q_mask = m_mask[:, None] & d_mask[None, :]
    q_off = (q_start + m_idx)[:, None] * stride_qt + h * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    hi = tl.minimum(seq_len - q_len + q0 + BLOCK_M, seq_len)  # past the tile's last query
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - q_len + q0 - window + 1, 0)

    m_run = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    if WHILE_LOOPS:
        n0 = lo
        while n0 < hi:
            m_run, l_run, acc = _prefill_tile(
                n0, hi, q, q_pos, m_run, l_run, acc, scale, window, k_cache_ptr, v_cache_ptr,
                block_tables_ptr, seq, kv_head, stride_cb, stride_cs, stride_ch, stride_bt,
                d, d_mask, BLOCK_SIZE, BLOCK_N, USE_WINDOW, DOT_FP32,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(lo, hi, BLOCK_N):
            m_run, l_run, acc = _prefill_tile(
                n0, hi, q, q_pos, m_run, l_run, acc, scale, window, k_cache_ptr, v_cache_ptr,
                block_tables_ptr, seq, kv_head, stride_cb, stride_cs, stride_ch, stride_bt,
                d, d_mask, BLOCK_SIZE, BLOCK_N, USE_WINDOW, DOT_FP32,
            )  # fmt: skip

    o = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    o_off = (q_start + m_idx)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=q_mask)
