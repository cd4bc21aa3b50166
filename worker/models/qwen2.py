"""Qwen2: Llama's decoder with q/k/v biases and optional windows on the upper layers."""

from __future__ import annotations

from typing import Any

import torch

from worker.models.config import ModelConfig
from worker.models.decoder import CausalLM
from worker.models.llama import _check_act, base_config


def _layer_windows(hf: Any) -> tuple[int | None, ...]:
    """Per-layer windows from ``layer_types`` (transformers fills it from ``max_window_layers``)."""
    window = getattr(hf, "sliding_window", None)
    if not getattr(hf, "use_sliding_window", False):
        window = None
    layer_types = getattr(hf, "layer_types", None)
    if window is None:
        return (None,) * hf.num_hidden_layers
    if layer_types is None:
        first = getattr(hf, "max_window_layers", hf.num_hidden_layers)
        return tuple(window if i >= first else None for i in range(hf.num_hidden_layers))
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def qwen2_config(hf: Any, dtype: torch.dtype, eos_token_ids: tuple[int, ...]) -> ModelConfig:
    _check_act(hf)
    fields = base_config(hf, "qwen2", "Qwen2ForCausalLM", dtype, eos_token_ids)
    windows = _layer_windows(hf)
    used = [w for w in windows if w is not None]
    return ModelConfig(
        **fields,
        qkv_bias=True,
        sliding_window=max(used) if used else None,
        layer_sliding_windows=windows,
    )


class Qwen2ForCausalLM(CausalLM):
    """Qwen2 / Qwen2.5 decoder."""
