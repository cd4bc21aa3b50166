"""Paged attention in Triton, for GPUs (and the Triton interpreter on CPUs, for tests).

Three kernels:

* ``_write_kv_kernel``: one program per new token copies its K and V rows to its slot;
* decode (``query_len == 1``): flash-decoding. Each (token, query head, split) program walks
  its share of the context through the block table with an online softmax and writes a partial
  (max, sum, unnormalised output); ``_reduce_kernel`` merges the splits. Splitting keeps the GPU
  busy when a few sequences have long contexts;
* prefill (``query_len > 1``): one program per (tile of ``BLOCK_M`` query tokens of one sequence,
  query head) walks the cached context before the chunk and the chunk itself (causal), with
  ``tl.dot`` on ``BLOCK_M x BLOCK_N`` tiles. KV tiles are gathered token by token through the block
  table, so any block size works.

GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``. Sliding window: the
query at position ``p`` sees ``p - W < k <= p`` (Hugging Face's convention). Softmax and
accumulation are fp32. Under ``TRITON_INTERPRET=1`` every tile is converted to fp32 first (the
interpreter mishandles bf16) and context loops are ``while`` loops (the interpreter cannot turn
its 1-element tensors into ``range`` bounds under numpy 2.4); compiled kernels use ``for`` loops,
which Triton can pipeline. The variable must be set before this module is imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _write_kv_kernel(
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
def _decode_tile(
    n0, end, q, m_run, l_run, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head,
    stride_cb, stride_cs, stride_ch, stride_bt, d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One tile of ``BLOCK_N`` context tokens for a single-token query (online softmax)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    p_mask = pos < end
    block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=p_mask, other=0)
    base = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = p_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
    s = tl.where(p_mask, s, -float("inf"))
    m_new = tl.maximum(m_run, tl.max(s, axis=0))
    p = tl.exp(s - m_new)
    alpha = tl.exp(m_run - m_new)
    v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
    l_run = l_run * alpha + tl.sum(p, axis=0)
    m_run = m_new
    return m_run, l_run, acc


@triton.jit
def _decode_split_kernel(
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1)
    row = tl.load(token_rows_ptr + i)
    seq = tl.load(seq_ids_ptr + i)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = h // GROUP
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + h * stride_qh + d, mask=d_mask, other=0.0)
    q = q.to(tl.float32) * scale

    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_run = -float("inf")
    l_run = 0.0
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    if WHILE_LOOPS:
        n0 = start
        while n0 < end:
            m_run, l_run, acc = _decode_tile(
                n0, end, q, m_run, l_run, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                seq, kv_head, stride_cb, stride_cs, stride_ch, stride_bt, d, d_mask,
                BLOCK_SIZE, BLOCK_N,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_run, l_run, acc = _decode_tile(
                n0, end, q, m_run, l_run, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                seq, kv_head, stride_cb, stride_cs, stride_ch, stride_bt, d, d_mask,
                BLOCK_SIZE, BLOCK_N,
            )  # fmt: skip

    part = (i * num_heads + h) * NUM_SPLITS + split
    tl.store(part_m_ptr + part, m_run)
    tl.store(part_l_ptr + part, l_run)
    tl.store(part_acc_ptr + part * D_PAD + d, acc)


@triton.jit
def _decode_reduce_kernel(
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
    allowed = p_mask[None, :] & (pos[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
    s = tl.where(allowed, s * scale, -float("inf"))
    m_new = tl.maximum(m_run, tl.max(s, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows with nothing seen yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_run - m_safe)
    l_run = l_run * alpha + tl.sum(p, axis=1)
    if DOT_FP32:  # noqa: SIM108 (keep Triton's control flow explicit)
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    m_run = m_new
    return m_run, l_run, acc


@triton.jit
def _prefill_kernel(
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


@dataclass
class _TritonPlan:
    """Per-step launch data, built on the host once and reused by every layer."""

    decode_rows: torch.Tensor | None = None  # int32 [n]: flat-batch rows of decode tokens
    decode_seqs: torch.Tensor | None = None  # int32 [n]
    num_splits: int = 1
    tile_seqs: torch.Tensor | None = None  # int32 [tiles]
    tile_q0: torch.Tensor | None = None  # int32 [tiles]
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _num_splits(max_ctx: int, num_programs: int) -> int:
    """Split long contexts so that there are enough programs to fill the GPU."""
    want = max(1, min(16, (max_ctx + 255) // 256))
    while want > 1 and num_programs * want // 2 >= 1024:
        want //= 2
    return _next_pow2(want)


class TritonBackend:
    """GPU implementation of :class:`kernels.registry.AttentionBackend`."""

    name = "triton"

    def __init__(self, block_m: int | None = None, block_n: int | None = None) -> None:
        self._block_m = block_m
        self._block_n = block_n
        self._plan_meta: AttentionMetadata | None = None
        self._plan_key: tuple[int, int] = (0, 0)
        self._plan = _TritonPlan()

    # ------------------------------------------------------------------ write
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store each new token's key and value at its slot."""
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.is_contiguous()
        assert k_cache.stride() == v_cache.stride()
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        _write_kv_kernel[(num_tokens,)](
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            H_PAD=_next_pow2(num_kv_heads),
            D_PAD=_next_pow2(head_dim),
            BLOCK_SIZE=block_size,
        )

    # ------------------------------------------------------------------ plan
    def _tile_sizes(self, head_dim: int) -> tuple[int, int]:
        if INTERPRET:
            default = (16, 16)
        elif head_dim > 128:
            default = (32, 32)
        else:
            default = (64, 64)
        return self._block_m or default[0], self._block_n or default[1]

    def _get_plan(self, meta: AttentionMetadata, num_heads: int, block_m: int) -> _TritonPlan:
        key = (num_heads, block_m)
        if meta is self._plan_meta and key == self._plan_key:
            return self._plan
        device = meta.seq_lens.device
        rows: list[int] = []
        seqs: list[int] = []
        tile_seqs: list[int] = []
        tile_q0: list[int] = []
        max_decode_ctx = 0
        start = 0
        for b, (q_len, seq_len) in enumerate(
            zip(meta.query_lens_host, meta.seq_lens_host, strict=True)
        ):
            if q_len == 1:
                rows.append(start)
                seqs.append(b)
                max_decode_ctx = max(max_decode_ctx, seq_len)
            elif q_len > 1:
                for q0 in range(0, q_len, block_m):
                    tile_seqs.append(b)
                    tile_q0.append(q0)
            start += q_len
        plan = _TritonPlan()
        if rows:
            plan.decode_rows = torch.tensor(rows, dtype=torch.int32, device=device)
            plan.decode_seqs = torch.tensor(seqs, dtype=torch.int32, device=device)
            plan.num_splits = _num_splits(max_decode_ctx, len(rows) * num_heads)
        if tile_seqs:
            plan.tile_seqs = torch.tensor(tile_seqs, dtype=torch.int32, device=device)
            plan.tile_q0 = torch.tensor(tile_q0, dtype=torch.int32, device=device)
        self._plan, self._plan_meta, self._plan_key = plan, meta, key
        return plan

    # ------------------------------------------------------------------ attention
    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of each query token over its sequence's cached context."""
        out = torch.empty_like(query)
        if query.shape[0] == 0:
            return out
        assert query.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
        num_heads, head_dim = query.shape[1], query.shape[2]
        block_m, block_n = self._tile_sizes(head_dim)
        plan = self._get_plan(meta, num_heads, block_m)
        if plan.decode_rows is not None:
            self._decode(query, k_cache, v_cache, meta, plan, out, scale, sliding_window)
        if plan.tile_seqs is not None:
            self._prefill(
                query, k_cache, v_cache, meta, plan, out, scale, sliding_window, block_m, block_n
            )
        return out

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: _TritonPlan,
        out: torch.Tensor,
        scale: float,
        sliding_window: int | None,
    ) -> None:
        assert plan.decode_rows is not None and plan.decode_seqs is not None
        n = plan.decode_rows.shape[0]
        num_heads, head_dim = query.shape[1], query.shape[2]
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        d_pad = _next_pow2(head_dim)
        splits = plan.num_splits
        scratch_key = f"decode:{num_heads}:{d_pad}"
        scratch = plan.scratch.get(scratch_key)
        if scratch is None:  # one buffer per step, shared by all layers
            scratch = torch.empty(
                n * num_heads * splits * (d_pad + 2), dtype=torch.float32, device=query.device
            )
            plan.scratch[scratch_key] = scratch
        parts = n * num_heads * splits
        part_m, part_l, part_acc = scratch[:parts], scratch[parts : 2 * parts], scratch[2 * parts :]
        block_n = max(16, block_size) if INTERPRET else max(32, block_size)
        _decode_split_kernel[(n, num_heads, splits)](
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            plan.decode_rows,
            plan.decode_seqs,
            part_m,
            part_l,
            part_acc,
            scale,
            sliding_window or 0,
            query.stride(0),
            query.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            meta.block_tables.stride(0),
            GROUP=num_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            BLOCK_SIZE=block_size,
            BLOCK_N=block_n,
            NUM_SPLITS=splits,
            USE_WINDOW=sliding_window is not None,
            WHILE_LOOPS=INTERPRET,
        )
        _decode_reduce_kernel[(n, num_heads)](
            out,
            plan.decode_rows,
            part_m,
            part_l,
            part_acc,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=splits,
        )

    def _prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: _TritonPlan,
        out: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        block_m: int,
        block_n: int,
    ) -> None:
        assert plan.tile_seqs is not None and plan.tile_q0 is not None
        num_heads, head_dim = query.shape[1], query.shape[2]
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        _prefill_kernel[(plan.tile_seqs.shape[0], num_heads)](
            query,
            k_cache,
            v_cache,
            out,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            plan.tile_seqs,
            plan.tile_q0,
            scale,
            sliding_window or 0,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            meta.block_tables.stride(0),
            GROUP=num_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            D_PAD=_next_pow2(head_dim),
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            USE_WINDOW=sliding_window is not None,
            DOT_FP32=INTERPRET or query.dtype == torch.float32,
            WHILE_LOOPS=INTERPRET,
        )
