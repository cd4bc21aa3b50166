"""Rotary position embeddings: one cos/sin table per model, indexed by position each step.

Inverse frequencies come from ``transformers.modeling_rope_utils`` for the scaled variants, so
our numbers are the reference's numbers. Every supported variant is a fixed function of the
position, which is what a paged cache needs: a key is rotated once, when it is written, and never
again. ``dynamic`` NTK scaling rescales *all* positions as the sequence grows, so it cannot be
cached and is refused.
"""

from __future__ import annotations

from typing import Any

import torch

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn", "longrope")


def _default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (theta**exponent)


def _table(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """[len(positions), 2, rotary_dim / 2]: cos and sin (times ``scaling``), float32."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    return torch.stack((freqs.cos() * scaling, freqs.sin() * scaling), dim=1)


def build_rope_table(hf_config: Any, rope_type: str, max_positions: int) -> torch.Tensor:
    """The cos/sin table ``[max_positions, 2, head_dim / 2]`` (float32) for ``hf_config``.

    ``longrope`` uses its short factors below ``original_max_position_embeddings`` and its long
    factors from there on, per position (Hugging Face switches a whole sequence to the long
    factors once it grows past that length, which a cache written earlier cannot follow; the
    two agree on every sequence shorter than the original context).
    """
    params: dict[str, Any] = dict(hf_config.rope_parameters or {})
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    positions = torch.arange(max_positions)
    if rope_type == "default":
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        return _table(positions, _default_inv_freq(float(params["rope_theta"]), head_dim), 1.0)

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init_fn = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = init_fn(hf_config, torch.device("cpu"))
    if rope_type != "longrope":
        return _table(positions, inv_freq, float(scaling))
    original = int(params["original_max_position_embeddings"])
    long_inv_freq, long_scaling = init_fn(hf_config, torch.device("cpu"), seq_len=original + 1)
    short = _table(positions[:original], inv_freq, float(scaling))
    long = _table(positions[original:], long_inv_freq, float(long_scaling))
    return torch.cat((short, long), dim=0)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] by half-split pairs (the Hugging Face layout).

    ``cos`` and ``sin`` are [T, 1, D / 2] in ``x``'s dtype.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
