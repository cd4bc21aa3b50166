"""Paged attention in Triton, for GPUs (and the Triton interpreter on CPUs, for tests).

The backend plans each step once on the host (which rows decode, how prefill chunks tile, how
many splits a decode gets) and launches the kernels of :mod:`kernels.triton_kernels`, whose
docstring describes the algorithms. ``INTERPRET`` comes from there: the variable must be set
before that module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.metadata import AttentionMetadata
from kernels.triton_kernels import (
    INTERPRET,
    decode_reduce_kernel,
    decode_split_kernel,
    prefill_kernel,
    write_kv_kernel,
)


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


def _decode_scratch(
    plan: _TritonPlan, parts: int, d_pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split partials (max, sum, output) of a decode: one buffer per step, for every layer."""
    scratch_key = f"decode:{parts}:{d_pad}"
    scratch = plan.scratch.get(scratch_key)
    if scratch is None:
        scratch = torch.empty(parts * (d_pad + 2), dtype=torch.float32, device=device)
        plan.scratch[scratch_key] = scratch
    return scratch[:parts], scratch[parts : 2 * parts], scratch[2 * parts :]


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
        write_kv_kernel[(num_tokens,)](
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

    def _get_plan(self, meta: AttentionMetadata, num_kv_heads: int, block_m: int) -> _TritonPlan:
        key = (num_kv_heads, block_m)
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
            plan.num_splits = _num_splits(max_decode_ctx, len(rows) * num_kv_heads)
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
        head_dim = query.shape[2]
        block_m, block_n = self._tile_sizes(head_dim)
        plan = self._get_plan(meta, k_cache.shape[2], block_m)
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
        parts = n * num_heads * splits
        part_m, part_l, part_acc = _decode_scratch(plan, parts, d_pad, query.device)
        block_n = (
            max(16, block_size) if INTERPRET else max(64 if head_dim <= 128 else 32, block_size)
        )
        group = num_heads // num_kv_heads
        decode_split_kernel[(n, num_kv_heads, splits)](
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
            NUM_HEADS=num_heads,
            GROUP=group,
            G_PAD=max(16, _next_pow2(group)),  # tl.dot's smallest M
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            BLOCK_SIZE=block_size,
            BLOCK_N=block_n,
            NUM_SPLITS=splits,
            USE_WINDOW=sliding_window is not None,
            DOT_FP32=INTERPRET or query.dtype == torch.float32,
            WHILE_LOOPS=INTERPRET,
        )
        decode_reduce_kernel[(n, num_heads)](
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
        prefill_kernel[(plan.tile_seqs.shape[0], num_heads)](
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
