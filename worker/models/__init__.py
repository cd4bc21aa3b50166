"""Model families as our own torch modules, fed by Hugging Face checkpoints.

``ARCHITECTURES`` maps a checkpoint's ``architectures`` entry to its family: how to read its
config and which module class runs it. :func:`worker.loader.load_model` is the entry point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from worker.models.config import ModelConfig
from worker.models.decoder import CausalLM
from worker.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    llama_config,
    mistral_config,
)
from worker.models.qwen2 import Qwen2ForCausalLM, qwen2_config

ConfigReader = Callable[[Any, torch.dtype, tuple[int, ...]], ModelConfig]


@dataclass(frozen=True)
class ModelFamily:
    name: str
    read_config: ConfigReader
    model_class: type[CausalLM]


ARCHITECTURES: dict[str, ModelFamily] = {
    "LlamaForCausalLM": ModelFamily("llama", llama_config, LlamaForCausalLM),
    "MistralForCausalLM": ModelFamily("mistral", mistral_config, MistralForCausalLM),
    "Qwen2ForCausalLM": ModelFamily("qwen2", qwen2_config, Qwen2ForCausalLM),
}

__all__ = ["ARCHITECTURES", "CausalLM", "ModelConfig", "ModelFamily"]
