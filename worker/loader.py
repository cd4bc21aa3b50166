"""Load a Hugging Face checkpoint directory into our own model modules.

Reads ``config.json`` (through ``transformers.AutoConfig``, which fills defaults and normalises old
rope fields, without building a transformers model), then streams tensors from
``model.safetensors`` or from the shards named by ``model.safetensors.index.json`` straight into
the fused parameters. Nothing touches the network.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from worker.models import ARCHITECTURES, CausalLM
from worker.models.rope import build_rope_table

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def read_eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """End-of-sequence ids of ``config.json`` then ``generation_config.json``, deduplicated."""
    model_dir = Path(model_dir)
    ids = _as_id_list(_read_json(model_dir / "config.json").get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        ids += _as_id_list(_read_json(gen_path).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def resolve_architecture(config: dict[str, Any]) -> str:
    """The supported ``architectures`` entry of a raw config, else ``ValueError``."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return str(arch)
    supported = ", ".join(sorted(ARCHITECTURES))
    raise ValueError(f"unsupported architectures {archs!r}; supported: {supported}")


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the weights, single-file or sharded."""
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {model_dir}")


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every stored tensor, one shard open at a time, on the CPU."""
    from safetensors import safe_open

    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _resolve_dtype(dtype: torch.dtype | str, config: dict[str, Any]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[dtype]


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """Our module for the checkpoint in ``model_dir``, weights loaded, in eval mode.

    ``dtype`` may be a torch dtype, a name (``"bfloat16"``) or ``"auto"`` (the checkpoint's).
    """
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    raw = _read_json(model_dir / "config.json")
    family = ARCHITECTURES[resolve_architecture(raw)]
    torch_dtype = _resolve_dtype(dtype, raw)
    hf_config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    config = family.read_config(hf_config, torch_dtype, read_eos_token_ids(model_dir))
    rope_table = build_rope_table(hf_config, config.rope_type, config.max_position_embeddings)
    model = family.model_class(config, rope_table, device)
    model.load_weights(iter_weights(model_dir))
    return model.eval()
