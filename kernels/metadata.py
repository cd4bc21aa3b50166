"""Per-step attention metadata, built once per forward pass by the model runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes one flat batch of B sequences and T query tokens.

    Device tensors feed the kernels; the ``*_host`` lists carry the same numbers on the host so a
    CPU backend can plan its work without reading tensors back (and a GPU backend can size grids
    without a device sync).
    """

    query_start_loc: torch.Tensor  # int32 [B + 1], cumulative query lengths, starts at 0
    seq_lens: torch.Tensor  # int32 [B], context length after this step (cached + new)
    block_tables: torch.Tensor  # int32 [B, max_blocks], rows padded with 0
    slot_mapping: torch.Tensor  # int64 [T]
    query_lens_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_host))
