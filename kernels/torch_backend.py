"""Paged attention in plain torch, for CPUs.

Work is split by kind once per step (the plan is cached across the layers of one forward pass):

* decode tokens (``query_len == 1``) are batched: sorted by context length, cut into a few
  buckets so that padding stays small, and each bucket gathers its K/V blocks with one
  ``index_select`` into a padded ``[n, blocks * block_size, ...]`` buffer, then runs two batched
  matmuls under a length mask;
* prefill chunks (``query_len > 1``) are few per step and run one by one through
  ``scaled_dot_product_attention``: straight on the step's fresh keys/values when nothing is
  cached before the chunk, else on the context gathered from the cache.

Masking convention (Hugging Face's): the query at position ``p`` sees ``k <= p`` and, with a
sliding window ``W``, ``k > p - W``. Arithmetic is fp32 (fp64 stays fp64); output has the
query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata

# Cost model for bucketing decode tokens: one bucket costs about as much as this many padded
# context tokens of work (Python + op launch overhead against per-token gather/matmul work).
_BUCKET_OVERHEAD_TOKENS = 2048
_MAX_BUCKETS = 8


@dataclass
class _DecodeBucket:
    """Decode tokens whose contexts are padded to the same number of blocks."""

    token_idx: torch.Tensor  # int64 [n]: rows of the flat batch
    seq_lens: torch.Tensor  # int64 [n]
    block_ids: torch.Tensor  # int64 [n * num_blocks]: flattened block table slice
    num_blocks: int


@dataclass
class _Prefill:
    """One sequence computing more than one token this step."""

    start: int
    query_len: int
    seq_len: int
    seq_index: int


@dataclass
class _Plan:
    decode: list[_DecodeBucket] = field(default_factory=list)
    prefill: list[_Prefill] = field(default_factory=list)
    all_decode_contiguous: bool = False


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _split_buckets(block_counts: list[int]) -> list[tuple[int, int]]:
    """Cut an ascending list of block counts into ``[lo, hi)`` runs that minimise padded work.

    Dynamic programming over a handful of candidate cut points (quantiles), so planning stays
    cheap for a batch of hundreds of sequences.
    """
    n = len(block_counts)
    if n == 0:
        return []
    cands = sorted({0, n, *(round(n * i / 16) for i in range(1, 16))})
    best: dict[int, tuple[float, int]] = {0: (0.0, -1)}
    for j in cands[1:]:
        options = []
        for i in cands:
            if i >= j:
                break
            padded = (j - i) * block_counts[j - 1]
            options.append((best[i][0] + padded + _BUCKET_OVERHEAD_TOKENS / 16, i))
        best[j] = min(options)
    cuts: list[tuple[int, int]] = []
    j = n
    while j > 0:
        i = best[j][1]
        cuts.append((i, j))
        j = i
    cuts.reverse()
    while len(cuts) > _MAX_BUCKETS:  # merge the two cheapest neighbours
        k = min(range(len(cuts) - 1), key=lambda t: cuts[t + 1][1] - cuts[t][0])
        cuts[k : k + 2] = [(cuts[k][0], cuts[k + 1][1])]
    return cuts


class TorchBackend:
    """CPU implementation of :class:`kernels.registry.AttentionBackend`."""

    name = "torch"

    def __init__(self) -> None:
        self._plan_meta: AttentionMetadata | None = None
        self._plan_key: tuple[int, int] = (0, 0)
        self._plan = _Plan()

    # ------------------------------------------------------------------ write
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store each new token's key and value at its slot (one ``index_copy_`` each)."""
        if key.shape[0] == 0:
            return
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        slots = slot_mapping.to(torch.long)
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))

    # ------------------------------------------------------------------ plan
    def _get_plan(self, meta: AttentionMetadata, block_size: int) -> _Plan:
        """Plan once per forward pass: the same ``meta`` object comes back for every layer."""
        key = (block_size, meta.block_tables.shape[1])
        if meta is self._plan_meta and key == self._plan_key:
            return self._plan
        self._plan = self._make_plan(meta, block_size)
        self._plan_meta = meta
        self._plan_key = key
        return self._plan

    @staticmethod
    def _make_plan(meta: AttentionMetadata, block_size: int) -> _Plan:
        plan = _Plan()
        decode: list[tuple[int, int, int]] = []  # (num_blocks, seq_index, token row)
        start = 0
        for b, (q_len, seq_len) in enumerate(
            zip(meta.query_lens_host, meta.seq_lens_host, strict=True)
        ):
            if q_len == 1:
                decode.append(((seq_len + block_size - 1) // block_size, b, start))
            elif q_len > 1:
                plan.prefill.append(_Prefill(start, q_len, seq_len, b))
            start += q_len
        if not decode:
            return plan
        decode.sort()
        counts = [d[0] for d in decode]
        device = meta.block_tables.device
        seq_lens_all = meta.seq_lens_host
        for lo, hi in _split_buckets(counts):
            group = decode[lo:hi]
            nb = group[-1][0]
            seq_idx = torch.tensor([g[1] for g in group], dtype=torch.long, device=device)
            block_ids = meta.block_tables.index_select(0, seq_idx)[:, :nb].to(torch.long)
            plan.decode.append(
                _DecodeBucket(
                    token_idx=torch.tensor([g[2] for g in group], dtype=torch.long, device=device),
                    seq_lens=torch.tensor(
                        [seq_lens_all[g[1]] for g in group], dtype=torch.long, device=device
                    ),
                    block_ids=block_ids.reshape(-1),
                    num_blocks=nb,
                )
            )
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
        plan = self._get_plan(meta, k_cache.shape[1])
        for bucket in plan.decode:
            rows = self._decode_bucket(query, k_cache, v_cache, bucket, scale, sliding_window)
            out.index_copy_(0, bucket.token_idx, rows.to(query.dtype))
        for chunk in plan.prefill:
            out[chunk.start : chunk.start + chunk.query_len] = self._prefill(
                query, key, value, k_cache, v_cache, meta, chunk, scale, sliding_window
            )
        return out

    @staticmethod
    def _decode_bucket(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        bucket: _DecodeBucket,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Attention for ``n`` single-token queries over contexts padded to ``num_blocks``."""
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        num_heads = query.shape[1]
        group = num_heads // num_kv_heads
        n = bucket.token_idx.shape[0]
        length = bucket.num_blocks * block_size
        cdt = _compute_dtype(query.dtype)
        # [n, L, Hkv, D] -> [n, Hkv, L, D] views of the gathered blocks
        k = k_cache.index_select(0, bucket.block_ids).view(n, length, num_kv_heads, head_dim)
        v = v_cache.index_select(0, bucket.block_ids).view(n, length, num_kv_heads, head_dim)
        k = k.to(cdt).permute(0, 2, 1, 3)
        v = v.to(cdt).permute(0, 2, 1, 3)
        q = query.index_select(0, bucket.token_idx).to(cdt)
        q = q.view(n, num_kv_heads, group, head_dim)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [n, Hkv, G, L]
        pos = torch.arange(length, device=query.device)
        last = bucket.seq_lens - 1  # the query's position
        masked = pos[None, :] > last[:, None]
        if sliding_window is not None:
            masked |= pos[None, :] <= last[:, None] - sliding_window
        scores.masked_fill_(masked[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v).reshape(n, num_heads, head_dim)

    @staticmethod
    def _prefill(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        chunk: _Prefill,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """One prefill chunk: fresh K/V when nothing precedes it, else the gathered context."""
        cdt = _compute_dtype(query.dtype)
        s, q_len, seq_len = chunk.start, chunk.query_len, chunk.seq_len
        q = query[s : s + q_len].to(cdt).transpose(0, 1)  # [H, q, D]
        if seq_len == q_len:
            k = key[s : s + q_len]
            v = value[s : s + q_len]
        else:
            block_size = k_cache.shape[1]
            nb = (seq_len + block_size - 1) // block_size
            blocks = meta.block_tables[chunk.seq_index, :nb].to(torch.long)
            k = k_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
            v = v_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
        k = k.to(cdt).transpose(0, 1)  # [Hkv, L, D]
        v = v.to(cdt).transpose(0, 1)
        mask: torch.Tensor | None = None
        if sliding_window is not None or seq_len != q_len:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=q.shape[0] != k.shape[0],
        )
        return o[0].transpose(0, 1).to(query.dtype)
