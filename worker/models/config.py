"""The model description shared by the model modules, the loader and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about a decoder-only model, family-independent.

    ``layer_sliding_windows[i]`` is layer ``i``'s window (``None``: full attention);
    ``sliding_window`` is the largest of them, or ``None`` when every layer attends fully — the
    number a KV-cache planner cares about.
    """

    family: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    dtype: torch.dtype
    sliding_window: int | None = None
    layer_sliding_windows: tuple[int | None, ...] = ()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_type: str = "default"
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_cache_bytes_per_token(self, cache_dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V, over all layers, that one cached token occupies."""
        return 2 * self.num_layers * self.kv_size * (cache_dtype or self.dtype).itemsize
