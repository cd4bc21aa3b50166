"""make-model: deterministic checkpoints whose tokenizer and config transformers can read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.fixtures.models import TINY_FAMILIES, MakeTinyModel
from worker.make_model import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END,
    IM_START,
    PAD_TOKEN,
    build_checkpoint,
    hf_config_for,
    main,
    preset_shape,
)

MULTIBYTE_TEXTS = [
    "plain ascii, with  double spaces\nand a newline",
    "Grüße aus Köln: naïve café",
    "日本語のテキストと中文",
    "emoji 🙂🚀 and symbols € ✓ °C",
    "mixed: def f(x):\n    return x  # ß→ss",
]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def test_same_seed_gives_identical_bytes(tmp_path: Path, make_tiny_model: MakeTinyModel) -> None:
    first = make_tiny_model("llama")
    again = build_checkpoint("llama", "tiny", tmp_path / "again", seed=0)
    other = build_checkpoint("llama", "tiny", tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tokenizer_round_trip_and_vocab(family: str, make_tiny_model: MakeTinyModel) -> None:
    from transformers import AutoTokenizer

    model_dir = make_tiny_model(family)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    assert len(tok) == config["vocab_size"] == preset_shape(family, "tiny").vocab_size
    assert tok.bos_token == BOS_TOKEN and tok.bos_token_id == config["bos_token_id"]
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == config["eos_token_id"]
    assert tok.pad_token == PAD_TOKEN and tok.pad_token_id == config["pad_token_id"]
    for text in MULTIBYTE_TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert all(0 <= i < config["vocab_size"] for i in ids)
        assert tok.decode(ids, skip_special_tokens=True) == text
    # Byte-level BPE learned merges: common code takes far fewer tokens than characters.
    ascii_ids = tok.encode("def function(self, value):\n    return value", add_special_tokens=False)
    assert len(ascii_ids) < len("def function(self, value):\n    return value") / 2


def test_chat_template_and_eos_ids(make_tiny_model: MakeTinyModel) -> None:
    from transformers import AutoTokenizer

    model_dir = make_tiny_model("qwen2")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hallo, wie geht's? 🙂"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"{BOS_TOKEN}{IM_START}system\nBe brief.{IM_END}\n"
        f"{IM_START}user\nHallo, wie geht's? 🙂{IM_END}\n{IM_START}assistant\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    im_start, im_end = tok.convert_tokens_to_ids([IM_START, IM_END])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tok.decode(ids) == text
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, im_end]


def test_family_specific_config(make_tiny_model: MakeTinyModel) -> None:
    llama = json.loads((make_tiny_model("llama") / "config.json").read_text())
    assert llama["architectures"] == ["LlamaForCausalLM"]
    assert llama["head_dim"] * llama["num_attention_heads"] != llama["hidden_size"]
    assert (llama["num_hidden_layers"], llama["num_key_value_heads"]) == (2, 2)

    mistral = json.loads((make_tiny_model("mistral") / "config.json").read_text())
    assert mistral["architectures"] == ["MistralForCausalLM"]
    assert mistral["sliding_window"] == 32

    qwen_dir = make_tiny_model("qwen2")
    qwen = json.loads((qwen_dir / "config.json").read_text())
    assert qwen["architectures"] == ["Qwen2ForCausalLM"] and qwen["tie_word_embeddings"] is True
    tensors = _tensors(qwen_dir / "model.safetensors")
    assert "lm_head.weight" not in tensors
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{proj}.bias" in tensors
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors


def test_logits_are_well_spread(make_tiny_model: MakeTinyModel) -> None:
    """The init scale keeps the top two logits apart, so greedy comparisons are stable."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(make_tiny_model("llama")), dtype=torch.float32)
    ids = torch.arange(5, 69).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits[0]
    top2 = logits.topk(2, dim=-1).values
    assert logits.std() > 1.0
    assert (top2[:, 0] - top2[:, 1]).median() > 0.05


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_bench_preset_shape_and_parameter_count(family: str) -> None:
    from transformers import AutoModelForCausalLM

    shape = preset_shape(family, "bench")
    assert (shape.hidden_size, shape.intermediate_size, shape.num_layers) == (512, 1536, 8)
    assert (shape.num_heads, shape.num_kv_heads, shape.vocab_size) == (8, 4, 4096)
    config = hf_config_for(family, "bench", shape, torch.float32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    biases = 8 * (512 + 2 * 256) if family == "qwen2" else 0
    assert n_params == 29_368_832 + biases


def test_qwen2_05b_preset_has_the_published_shape() -> None:
    """``qwen2-0.5b``: Qwen2-0.5B's numbers (GQA 7 on heads of 64, tied output head), 494,032,768
    parameters as the published checkpoint counts them."""
    from transformers import AutoModelForCausalLM

    shape = preset_shape("qwen2", "qwen2-0.5b")
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim) == (14, 2, 64)
    config = hf_config_for("qwen2", "qwen2-0.5b", shape, torch.float32)
    assert config.tie_word_embeddings
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 494_032_768


def test_cli_writes_a_loadable_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    assert main(["--family", "mistral", "--preset", "tiny", "--out", str(out), "--seed", "3"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["family"] == "mistral" and report["out"] == str(out)
    stored = _tensors(out / "model.safetensors")
    assert report["params"] == sum(t.numel() for t in stored.values())
    written = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    for name in written:
        assert (out / name).is_file()
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())


def test_unknown_family_or_preset_is_refused() -> None:
    with pytest.raises(ValueError, match="llama"):
        preset_shape("gpt2", "tiny")
    with pytest.raises(ValueError, match="tiny"):
        preset_shape("llama", "huge")
