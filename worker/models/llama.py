"""Llama and Mistral: the same decoder, Mistral adding a sliding window on every layer."""

from __future__ import annotations

from typing import Any

import torch

from worker.models.config import ModelConfig
from worker.models.decoder import CausalLM


def _head_dim(hf: Any) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def _rope_type(hf: Any) -> tuple[str, dict[str, Any]]:
    params = dict(getattr(hf, "rope_parameters", None) or {})
    return str(params.get("rope_type", "default")), params


def base_config(
    hf: Any, family: str, architecture: str, dtype: torch.dtype, eos_token_ids: tuple[int, ...]
) -> dict[str, Any]:
    """ModelConfig fields common to the Llama-style families, read from a transformers config."""
    rope_type, rope_params = _rope_type(hf)
    num_heads = hf.num_attention_heads
    return dict(
        family=family,
        architecture=architecture,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=_head_dim(hf),
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        rms_norm_eps=float(hf.rms_norm_eps),
        dtype=dtype,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        rope_type=rope_type,
        rope_parameters=rope_params,
        eos_token_ids=eos_token_ids,
        bos_token_id=getattr(hf, "bos_token_id", None),
        pad_token_id=getattr(hf, "pad_token_id", None),
    )


def _check_act(hf: Any) -> None:
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")


def llama_config(hf: Any, dtype: torch.dtype, eos_token_ids: tuple[int, ...]) -> ModelConfig:
    _check_act(hf)
    fields = base_config(hf, "llama", "LlamaForCausalLM", dtype, eos_token_ids)
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return ModelConfig(
        **fields,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        layer_sliding_windows=(None,) * hf.num_hidden_layers,
    )


def mistral_config(hf: Any, dtype: torch.dtype, eos_token_ids: tuple[int, ...]) -> ModelConfig:
    _check_act(hf)
    fields = base_config(hf, "mistral", "MistralForCausalLM", dtype, eos_token_ids)
    window = getattr(hf, "sliding_window", None)
    return ModelConfig(
        **fields,
        sliding_window=window,
        layer_sliding_windows=(window,) * hf.num_hidden_layers,
    )


class LlamaForCausalLM(CausalLM):
    """Llama 2/3-style decoder (also Mistral's, whose config adds the window)."""


class MistralForCausalLM(CausalLM):
    """Mistral decoder: Llama's layers with a sliding attention window."""
