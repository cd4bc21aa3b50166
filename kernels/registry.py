"""Backend selection: chosen once per device, then called on every layer of every step."""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # int64 [T]
    ) -> None:
        """Store each new token's key and value at its slot."""

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]: this step's keys, already written
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Causal attention of each query token over its sequence's cached context."""


_BACKENDS: dict[str, AttentionBackend] = {}


def get_backend(device: torch.device | str) -> AttentionBackend:
    """The backend for ``device``: Triton on CUDA, torch elsewhere. Chosen once, then cached."""
    dev = torch.device(device)
    key = dev.type
    if key not in _BACKENDS:
        if dev.type == "cuda":
            from kernels.triton_backend import TritonBackend

            _BACKENDS[key] = TritonBackend()
        else:
            from kernels.torch_backend import TorchBackend

            _BACKENDS[key] = TorchBackend()
    return _BACKENDS[key]
