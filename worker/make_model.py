"""``pagedserve make-model``: deterministic random checkpoints for tests and benchmarks.

A checkpoint directory holds what a Hugging Face model directory holds — ``config.json``,
``generation_config.json``, ``model.safetensors`` and a fast tokenizer with a chat template — so our
loader, ``transformers`` and peer engines can all read it. Everything derives from the seed and
from text already on the machine (the Python standard library), never from the network.

Weights are drawn with scales chosen so that the logits are well spread (about unit variance per
layer output, logits with a standard deviation near 2): greedy decoding then rarely meets two
nearly equal top logits, which keeps token-for-token comparisons against ``transformers`` stable.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from worker.tokenizer_corpus import iter_corpus

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PretrainedConfig

FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2")
PRESETS: tuple[str, ...] = ("tiny", "small", "bench", "qwen2-0.5b")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START, IM_END)

# ChatML turns, preceded by the BOS token (the tokenizer adds no specials inside a chat template).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """The architecture numbers of one preset."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 2048
    corpus_chars: int = 200_000
    #: The output head is the embedding (Qwen2's small models); Qwen2's tiny checkpoints tie too,
    #: so that the tests cover a tied head.
    tie_embeddings: bool = False


PRESET_SHAPES: dict[str, Shape] = {
    "tiny": Shape(64, 128, 2, 4, 2, 16, 512, corpus_chars=60_000),
    "small": Shape(256, 768, 4, 8, 4, 32, 2048, corpus_chars=150_000),
    # The peers' benchmark checkpoint: ~29.4M parameters with untied embeddings.
    "bench": Shape(512, 1536, 8, 8, 4, 64, 4096, corpus_chars=300_000),
    # Qwen2-0.5B's published shape (494M parameters, tied; 14 query heads on 2 KV heads of 64:
    # GQA 7, the decode kernel's widest group), to compare engines on it without the hub. Its
    # 151,936-entry vocabulary is mostly reserved tokens past what the corpus teaches.
    "qwen2-0.5b": Shape(
        896, 4864, 24, 14, 2, 64, 151_936, 4096, corpus_chars=300_000, tie_embeddings=True
    ),
}


def preset_shape(family: str, preset: str) -> Shape:
    """The shape of ``family`` at ``preset``; tiny presets vary a little so tests cover more."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    if preset not in PRESET_SHAPES:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    shape = PRESET_SHAPES[preset]
    if preset == "tiny" and family == "llama":
        # head_dim * num_heads != hidden_size: catches code that assumes they are equal.
        shape = replace(shape, head_dim=32)
    return shape


def hf_config_for(family: str, preset: str, shape: Shape, dtype: torch.dtype) -> PretrainedConfig:
    """The ``transformers`` config object for ``family`` with the preset's shape."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    ids = {name: SPECIAL_TOKENS.index(tok) for name, tok in _SPECIAL_IDS.items()}
    common = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        dtype=dtype,
    )
    if family == "llama":
        return LlamaConfig(
            **common,
            tie_word_embeddings=shape.tie_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if family == "mistral":
        window = 32 if preset == "tiny" else 4096
        return MistralConfig(
            **common,
            tie_word_embeddings=shape.tie_embeddings,
            sliding_window=window,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    return Qwen2Config(
        **common,
        tie_word_embeddings=preset == "tiny" or shape.tie_embeddings,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


_SPECIAL_IDS = {"bos": BOS_TOKEN, "eos": EOS_TOKEN, "pad": PAD_TOKEN}


def _init_std(name: str, param: torch.Tensor, hidden_size: int, tied: bool) -> tuple[float, float]:
    """(mean, std) of the normal distribution ``name`` is drawn from."""
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name.endswith(".bias"):
        return 0.0, 0.2
    if name.endswith("embed_tokens.weight"):
        # Tied: the embedding is also the output head, whose scale sets the logits' spread.
        return 0.0, (2.0 / math.sqrt(hidden_size)) if tied else 1.0
    if name.endswith("lm_head.weight"):
        return 0.0, 2.0 / math.sqrt(hidden_size)
    return 0.0, 1.0 / math.sqrt(param.shape[-1])


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int, hidden_size: int, tied: bool) -> None:
    """Draw every parameter from one seeded generator in sorted-name order (init-order agnostic)."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())  # shared (tied) parameters appear once
    for name in sorted(params):
        param = params[name]
        mean, std = _init_std(name, param, hidden_size, tied)
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std + mean
        param.copy_(values.to(param.dtype))


def train_tokenizer(vocab_size: int, corpus_chars: int) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_corpus(corpus_chars), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:  # a small corpus may run out of merges: fill up with reserved specials
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, wanted {vocab_size}")
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write the fast tokenizer files; the chat template lives in tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(str(out_dir))
    # Keep the template inside tokenizer_config.json, where every reader looks for it.
    jinja = out_dir / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    # Names every transformers release understands (v4 readers reject a list-valued
    # ``extra_special_tokens`` and do not know ``TokenizersBackend``).
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens", [IM_START, IM_END])
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_checkpoint(
    family: str,
    preset: str,
    out_dir: Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
) -> Path:
    """Write a complete checkpoint of ``family`` / ``preset`` into ``out_dir`` and return it.

    The same arguments always give byte-identical ``model.safetensors``. ``max_shard_size`` (e.g.
    ``"200KB"``) splits the weights into shards with an index, as large published models are.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    shape = preset_shape(family, preset)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = hf_config_for(family, preset, shape, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(model, seed, shape.hidden_size, bool(config.tie_word_embeddings))
    model = model.to(dtype)
    save_kwargs: dict[str, object] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out_dir), **save_kwargs)

    tok = train_tokenizer(shape.vocab_size, shape.corpus_chars)
    save_tokenizer(tok, out_dir, shape.max_position_embeddings)
    im_end_id = tok.token_to_id(IM_END)
    gen = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, im_end_id],
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    gen.save_pretrained(str(out_dir))
    return out_dir


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pagedserve make-model",
        description="Write a deterministic randomly initialised checkpoint with its tokenizer.",
    )
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--preset", choices=PRESETS, required=True)
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--max-shard-size", default=None, help='e.g. "50MB" to shard the weights')
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = build_checkpoint(
        args.family,
        args.preset,
        args.out,
        seed=args.seed,
        dtype=DTYPES[args.dtype],
        max_shard_size=args.max_shard_size,
    )
    n_params = _count_params(out)
    print(
        json.dumps(
            {"out": str(out), "family": args.family, "preset": args.preset, "params": n_params}
        )
    )
    return 0


def _count_params(model_dir: Path) -> int:
    """Number of stored parameters (tied weights counted once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                total += math.prod(f.get_slice(key).get_shape())
    return total


if __name__ == "__main__":
    raise SystemExit(main())
