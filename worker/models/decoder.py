"""The decoder-only causal LM shared by the Llama, Mistral and Qwen2 families.

The families differ only in how their Hugging Face configs translate into a
:class:`~worker.models.config.ModelConfig` (biases, windows, tying); the module structure and the
checkpoint's tensor names are the same, so one class loads and runs all three.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import AttentionMetadata, fused, get_backend
from kernels.gemm import PanelWeight
from kernels.greedy_head import GreedyHead
from worker.models.config import ModelConfig
from worker.models.layers import (
    DecoderLayer,
    LayerInputs,
    RMSNorm,
    _param,
    linear,
    swap_for_packed,
)
from worker.sampler import settle_open_rows

# Checkpoint tensors that carry no weights of ours (old exports store rotary buffers).
_IGNORED_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class CausalLM(nn.Module):
    """Embeddings, decoder layers over a paged KV cache, final norm, output head.

    ``forward`` returns final hidden states of every token of the flat batch;
    ``compute_logits`` turns the rows the sampler needs into float32 logits.
    """

    def __init__(
        self, config: ModelConfig, rope_table: torch.Tensor, device: torch.device | str = "cpu"
    ):
        super().__init__()
        self.config = config
        dt = config.dtype
        self.embed_weight = _param(config.vocab_size, config.hidden_size, dtype=dt, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt, device)
        self.lm_head_weight = (
            self.embed_weight
            if config.tie_word_embeddings
            else _param(config.vocab_size, config.hidden_size, dtype=dt, device=device)
        )
        # float32 [max_positions, 2, head_dim / 2]; rows are gathered by position each step.
        self.register_buffer("rope_table", rope_table.to(device).contiguous(), persistent=False)
        #: Whether float32 CPU passes may use the fused C layer ops (kernels/fused.py).
        self.use_fused = True
        #: The packed float32 head's bfloat16 or int16 screen for greedy rows
        #: (:meth:`enable_greedy_screen`).
        self.greedy_head: GreedyHead | None = None

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm, one row per input token."""
        backend = get_backend(input_ids.device)
        x = F.embedding(input_ids, self.embed_weight)
        cos_sin = self.rope_table[positions].to(x.dtype)  # [T, 2, D/2]
        ops = fused.load() if self.use_fused else None
        if ops is not None and not ops.supports(x, self.rope_table):
            ops = None
        inputs = LayerInputs(
            cos=cos_sin[:, 0:1],  # [T, 1, D/2], broadcast over heads
            sin=cos_sin[:, 1:2],
            rope_table=self.rope_table,
            positions=positions,
            meta=meta,
            backend=backend,
            fused=ops,
        )
        delta: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, delta = layer(x, delta, kv_cache, inputs)
        return self.norm.add_norm(x, delta, ops)[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab]`` of the given hidden rows."""
        return linear(hidden, self.lm_head_weight).float()

    def enable_greedy_screen(self) -> str | None:
        """Give greedy rows their tokens through a bfloat16 or int16 screen of the head
        (:mod:`kernels.greedy_head`: the float32 head's tokens, bit for bit), where the head is
        packed for the C GEMM in float32; the screen's kind, or None where it is off."""
        head = self.lm_head_weight
        if isinstance(head, PanelWeight):
            tied = self.config.tie_word_embeddings and self.embed_weight.dtype == torch.float32
            self.greedy_head = GreedyHead.build(head, self.embed_weight.detach() if tied else None)
        return None if self.greedy_head is None else self.greedy_head.kind

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's argmax of :meth:`compute_logits` without computing them all, or None where
        the screen is off (the caller then takes the logits)."""
        if self.greedy_head is None or hidden.dtype != torch.float32:
            return None
        tokens = self.greedy_head.tokens(hidden)
        settle_open_rows(tokens, hidden, self.compute_logits)
        return tokens

    # ------------------------------------------------------------------ weights
    def pack_weights(self, fmt: str | None = None) -> int:
        """Pack every projection (and the output head) for the C GEMM or oneDNN, once, after
        loading (``fmt``: ``"bfloat16"`` or ``"int8"`` weights, :func:`~worker.models.layers.
        pack_weight`);
        returns how many were packed (0 where unsupported: not float32 on a CPU).
        Checkpoint loading no longer works on a packed model. A tied head gets a packed copy;
        the embedding itself stays plain for lookups."""
        return sum(
            swap_for_packed(module, name, fmt, glu=name == "gate_up_weight")
            for module, name in self.projections()
        )

    def projections(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every projection weight and the output head: what
        :meth:`pack_weights` packs."""
        targets: list[tuple[nn.Module, str]] = [(self, "lm_head_weight")]
        for layer in self.layers:
            targets += [(layer.attn, "qkv_weight"), (layer.attn, "o_weight")]
            targets += [(layer.mlp, "gate_up_weight"), (layer.mlp, "down_weight")]
        return targets

    def _layer_target(self, layer: DecoderLayer, name: str) -> tuple[torch.Tensor, int, int] | None:
        """(parameter, first row, end row) that the checkpoint tensor ``name`` of a layer fills."""
        cfg = self.config
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        attn, mlp = layer.attn, layer.mlp
        fused: dict[str, tuple[torch.Tensor | None, int, int]] = {
            "self_attn.q_proj.weight": (attn.qkv_weight, 0, q),
            "self_attn.k_proj.weight": (attn.qkv_weight, q, q + kv),
            "self_attn.v_proj.weight": (attn.qkv_weight, q + kv, q + 2 * kv),
            "self_attn.q_proj.bias": (attn.qkv_bias, 0, q),
            "self_attn.k_proj.bias": (attn.qkv_bias, q, q + kv),
            "self_attn.v_proj.bias": (attn.qkv_bias, q + kv, q + 2 * kv),
            "self_attn.o_proj.weight": (attn.o_weight, 0, cfg.hidden_size),
            "self_attn.o_proj.bias": (attn.o_bias, 0, cfg.hidden_size),
            "mlp.gate_proj.weight": (mlp.gate_up_weight, 0, inter),
            "mlp.up_proj.weight": (mlp.gate_up_weight, inter, 2 * inter),
            "mlp.gate_proj.bias": (mlp.gate_up_bias, 0, inter),
            "mlp.up_proj.bias": (mlp.gate_up_bias, inter, 2 * inter),
            "mlp.down_proj.weight": (mlp.down_weight, 0, cfg.hidden_size),
            "mlp.down_proj.bias": (mlp.down_bias, 0, cfg.hidden_size),
            "input_layernorm.weight": (layer.input_norm.weight, 0, cfg.hidden_size),
            "post_attention_layernorm.weight": (layer.post_attn_norm.weight, 0, cfg.hidden_size),
        }
        target = fused.get(name)
        if target is None or target[0] is None:
            return None
        return target[0], target[1], target[2]

    def _target(self, name: str) -> tuple[torch.Tensor, int, int] | None:
        cfg = self.config
        if name == "model.embed_tokens.weight":
            return self.embed_weight, 0, cfg.vocab_size
        if name == "model.norm.weight":
            return self.norm.weight, 0, cfg.hidden_size
        if name == "lm_head.weight":
            return self.lm_head_weight, 0, cfg.vocab_size
        match = _LAYER_RE.match(name)
        if match is None:
            return None
        idx = int(match.group(1))
        if idx >= cfg.num_layers:
            return None
        return self._layer_target(self.layers[idx], match.group(2))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the fused parameters.

        Raises ``ValueError`` on an unknown tensor, a shape mismatch, or a parameter left
        unfilled. With tied embeddings a stored ``lm_head.weight`` is ignored: the head is the
        embedding matrix.
        """
        filled: set[tuple[int, int, int]] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target = self._target(name)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
            param, start, end = target
            dest = param.data[start:end]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects "
                    f"{tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled.add((id(param), start, end))
        self._check_filled(filled)

    def _check_filled(self, filled: set[tuple[int, int, int]]) -> None:
        rows_filled: dict[int, int] = {}
        for pid, start, end in filled:
            rows_filled[pid] = rows_filled.get(pid, 0) + (end - start)
        missing = [
            name
            for name, param in self.named_parameters()
            if rows_filled.get(id(param), 0) != param.shape[0]
        ]
        if missing:
            raise ValueError(f"checkpoint leaves parameters unfilled: {', '.join(missing)}")
