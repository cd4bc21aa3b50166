"""GGUF checkpoints (llama.cpp's format) converted once into Hugging Face checkpoint directories.

:func:`cached_hf_dir` turns a ``.gguf`` file into a directory that both our loader and
``transformers.AutoModelForCausalLM.from_pretrained`` read unchanged: ``config.json``,
``generation_config.json``, ``model.safetensors`` (fp32, dequantized), the tokenizer with its chat
template, and ``gguf_source.json`` saying where it came from. The directory lives under
``cache_root/<sha256 of the file>/``; it is built in a temporary directory and renamed into place,
so a directory under its final name is always complete, and a file lock keeps two processes from
converting at once.

Metadata (config, tokenizer, chat template) is read by ``transformers``' GGUF support; tensors are
read with ``gguf.GGUFReader`` and dequantized with ``gguf.quants``. llama.cpp stores the query and
key projections of Llama-family models with their rows permuted (its rotary embedding pairs
adjacent dimensions; Hugging Face pairs the two halves of each head), which is undone here.

Architectures follow the metadata: llama.cpp writes Mistral models as ``llama`` (they then load
as Llama, which computes the same thing: a GGUF carries no sliding window), a file stating
``mistral`` loads as Mistral, ``qwen2`` as Qwen2 (not permuted). Weights are written as one fp32
file, held in memory while converting: fine for small models, not for multi-GB ones.

``pagedserve import-gguf FILE --out DIR`` converts one file into a directory of one's choice.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader, ReaderTensor

#: GGUF ``general.architecture`` values we convert, with the Hugging Face model type of each.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
#: Hugging Face ``model_type`` (as transformers reads it from the GGUF) -> ``architectures`` entry.
_HF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
#: Architectures whose q/k rows llama.cpp's converter permutes.
_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})

#: Tensor types ``gguf.quants.dequantize`` handles that we accept (names of GGMLQuantizationType).
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

SOURCE_FILE = "gguf_source.json"
#: One lock per cache directory: conversions are rare, and two of one file must not overlap.
LOCK_FILE = ".convert.lock"
GGUF_MAGIC = b"GGUF"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Trailing quantisation labels of llama.cpp file names: ".Q4_1", "-Q4_K_M", ".f16", "-IQ2_XXS".
_QUANT_SUFFIX = re.compile(
    r"[.\-_](?:(?:I?Q\d+(?:_[A-Z0-9]+)*)|F16|F32|BF16|FP16|FP32)$", re.IGNORECASE
)


class GGUFError(ValueError):
    """A GGUF file that cannot be converted: corrupt, truncated, or of an unsupported kind."""


@dataclass(frozen=True)
class GGUFSource:
    """What ``gguf_source.json`` records about a converted file."""

    source: str
    sha256: str
    name: str
    architecture: str
    tensor_types: list[str]
    converted_at: float
    conversion_seconds: float


# --------------------------------------------------------------------------------- hashing, names
def file_sha256(path: str | Path) -> str:
    """SHA-256 of the whole file (about 0.06 s per 100 MB here: cheap next to loading it)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def model_name_from_file(path: str | Path) -> str:
    """The name a GGUF file is served under: its stem without a quantisation label.

    ``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``. The file name is used rather
    than ``general.name``, which converters fill with labels such as ``Smollm2 135M 8k Lc100K Mix1
    Ep2`` that nobody would type as a model name.
    """
    stem = Path(path).stem
    return _QUANT_SUFFIX.sub("", stem) or stem


def read_source(model_dir: str | Path) -> GGUFSource | None:
    """The ``gguf_source.json`` of a converted directory, or ``None`` for any other directory."""
    path = Path(model_dir) / SOURCE_FILE
    if not path.is_file():
        return None
    return GGUFSource(**json.loads(path.read_text(encoding="utf-8")))


# ------------------------------------------------------------------------------- opening the file
def _check_header(path: Path) -> None:
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")


def open_gguf(path: str | Path) -> GGUFReader:
    """A reader over ``path`` whose every tensor lies inside the file, else :class:`GGUFError`."""
    from gguf import GGUFReader

    path = Path(path)
    _check_header(path)
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader fails deep in numpy on truncated or garbled files
        raise GGUFError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(
                f"{path}: truncated GGUF file: tensor {t.name} ends at byte "
                f"{t.data_offset + t.n_bytes}, the file has {size}"
            )
    return reader


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def check_supported(reader: GGUFReader, path: str | Path) -> str:
    """The file's architecture if we convert it and every tensor type in it, else GGUFError."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    bad: dict[str, list[str]] = {}
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            bad.setdefault(t.tensor_type.name, []).append(t.name)
    for t in reader.tensors:  # unknown tensor names fail here, before the slow steps
        hf_tensor_name(t.name)
    if bad:
        detail = "; ".join(
            f"{k} ({', '.join(v[:3])}{', ...' if len(v) > 3 else ''})" for k, v in bad.items()
        )
        raise GGUFError(
            f"{path}: unsupported GGUF tensor type(s) {detail}; supported: "
            f"{', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    return str(arch)


# --------------------------------------------------------------------------------------- tensors
def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor (Llama / Mistral / Qwen2 layout)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_TENSOR.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    if gguf_name == "rope_freqs.weight":
        raise GGUFError("GGUF tensor rope_freqs (Llama 3 rope scaling factors) is not supported")
    raise GGUFError(f"unexpected GGUF tensor {gguf_name!r} for a Llama/Mistral/Qwen2 model")


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (per head: interleaved pairs -> two halves)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(t: ReaderTensor) -> torch.Tensor:
    """One tensor as an fp32 torch tensor in PyTorch's (row-major, outer dimension first) shape."""
    import numpy as np
    import torch
    from gguf.quants import dequantize as gguf_dequantize

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    try:
        arr = gguf_dequantize(t.data, t.tensor_type)
    except (NotImplementedError, ValueError) as e:
        raise GGUFError(f"tensor {t.name} ({t.tensor_type.name}) cannot be read: {e}") from e
    arr = np.array(arr, dtype=np.float32, copy=True).reshape(shape)
    return torch.from_numpy(arr)


def iter_hf_tensors(
    reader: GGUFReader, arch: str, n_head: int, n_kv_head: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, fp32 tensor) of every tensor of the file, q/k rows un-permuted."""
    permuted = arch in _PERMUTED_ARCHITECTURES
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        w = dequantize(t)
        if permuted and ".attn_q." in t.name:
            w = unpermute_rows(w, n_head)
        elif permuted and ".attn_k." in t.name:
            w = unpermute_rows(w, n_kv_head)
        yield name, w


# ------------------------------------------------------------------------------------ conversion
@contextmanager
def _reading_metadata(path: Path, what: str) -> Iterator[None]:
    """Failures of transformers' GGUF reader as a GGUFError naming the file and the step."""
    try:
        yield
    except GGUFError:
        raise
    except Exception as e:
        raise GGUFError(f"{path}: cannot read the {what} ({type(e).__name__}: {e})") from e


def _hf_config(path: Path, arch: str) -> Any:
    from transformers import AutoConfig

    with _reading_metadata(path, "model config"):
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    hf_arch = _HF_ARCHITECTURES.get(config.model_type)
    if hf_arch is None:
        raise GGUFError(f"{path}: architecture {arch!r} read as unsupported {config.model_type!r}")
    config.architectures = [hf_arch]
    config.dtype = "float32"
    return config


def _eos_ids(reader: GGUFReader) -> list[int]:
    """End-of-sequence and end-of-turn ids (a chat model's turns end with EOT, not EOS)."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    ids = [_field(reader, k) for k in keys]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _write_generation_config(reader: GGUFReader, config: Any, out: Path) -> None:
    from transformers import GenerationConfig

    eos = _eos_ids(reader) or [config.eos_token_id]
    gen = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos if len(eos) > 1 else eos[0],
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    gen.save_pretrained(str(out))


def _write_weights(reader: GGUFReader, arch: str, config: Any, out: Path) -> None:
    from safetensors.torch import save_file

    tensors = dict(
        iter_hf_tensors(reader, arch, config.num_attention_heads, config.num_key_value_heads)
    )
    if "model.embed_tokens.weight" not in tensors:
        raise GGUFError("GGUF file has no token_embd.weight tensor")
    if not config.tie_word_embeddings and "lm_head.weight" not in tensors:
        config.tie_word_embeddings = True
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def convert(path: str | Path, out: str | Path, sha256: str | None = None) -> GGUFSource:
    """Convert the GGUF file ``path`` into a Hugging Face directory ``out`` (created, or empty)."""
    from transformers import AutoTokenizer

    started = time.time()
    path = Path(path).resolve()
    out = Path(out)
    reader = open_gguf(path)
    arch = check_supported(reader, path)
    out.mkdir(parents=True, exist_ok=True)
    config = _hf_config(path, arch)
    _write_weights(reader, arch, config, out)
    config.save_pretrained(str(out))
    _write_generation_config(reader, config, out)
    with _reading_metadata(path, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))
    source = GGUFSource(
        source=str(path),
        sha256=sha256 or file_sha256(path),
        name=model_name_from_file(path),
        architecture=arch,
        tensor_types=sorted({t.tensor_type.name for t in reader.tensors}),
        converted_at=started,
        conversion_seconds=round(time.time() - started, 3),
    )
    (out / SOURCE_FILE).write_text(json.dumps(asdict(source), indent=2) + "\n", encoding="utf-8")
    return source


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached_hf_dir(gguf_path: str | Path, cache_root: str | Path) -> Path:
    """The converted directory of ``gguf_path`` under ``cache_root``, converting on first use."""
    gguf_path = Path(gguf_path).expanduser()
    _check_header(gguf_path)
    cache_root = Path(cache_root).expanduser()
    cache_root.mkdir(parents=True, exist_ok=True)
    digest = file_sha256(gguf_path)
    final = cache_root / digest
    if final.is_dir():
        return final
    with _locked(cache_root / LOCK_FILE):
        if final.is_dir():  # another process converted it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{digest[:12]}-", dir=cache_root))
        try:
            convert(gguf_path, tmp, sha256=digest)
            tmp.chmod(0o755)  # mkdtemp makes it private; a cache entry is an ordinary directory
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def cached_entries(cache_root: str | Path) -> list[tuple[Path, GGUFSource]]:
    """(directory, source record) of every converted checkpoint under ``cache_root``."""
    root = Path(cache_root)
    if not root.is_dir():
        return []
    found = []
    for d in sorted(root.iterdir()):
        if d.is_dir() and not d.name.startswith("."):
            try:
                source = read_source(d)
            except (TypeError, ValueError):
                continue
            if source is not None:
                found.append((d, source))
    return found


# ------------------------------------------------------------------------------------------ CLI
def main(argv: Sequence[str] | None = None) -> int:
    """``pagedserve import-gguf FILE --out DIR``: convert; prints one JSON line."""
    ap = argparse.ArgumentParser(prog="pagedserve import-gguf", description=__doc__.split("\n")[0])
    ap.add_argument("file", help="the .gguf file")
    ap.add_argument("--out", required=True, help="directory to write (must not exist or be empty)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        sys.stdout.write(
            json.dumps({"error": f"{out} exists and is not an empty directory"}) + "\n"
        )
        return 2
    created = not out.exists()
    try:
        source = convert(args.file, out)
    except GGUFError as e:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        sys.stdout.write(json.dumps({"error": str(e)}) + "\n")
        return 2
    sys.stdout.write(json.dumps({"out": str(out), **asdict(source)}) + "\n")
    return 0
