"""worker.gguf: GGUF files written here from tiny checkpoints convert back to the same model.

Each GGUF is written the way llama.cpp's converter writes one (``gguf.GGUFWriter``; q/k rows
permuted for Llama-family models; norms kept in F32; the tokenizer as a byte-level BPE vocabulary
with merges and a chat template), so converting it back tests name mapping, dequantisation and the
un-permutation against an independent source: the original Hugging Face checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file

from pagedserve.params import SamplingParams
from tests.test_engine import hf_greedy, random_prompts
from worker import LLM
from worker.gguf import (
    GGUFError,
    cached_hf_dir,
    check_supported,
    convert,
    dequantize,
    model_name_from_file,
    open_gguf,
)
from worker.model_source import MODEL_CACHE_ENV, served_model_name

REPO = Path(__file__).resolve().parent.parent
Q = GGMLQuantizationType

#: Largest error per element allowed after a round trip, as a fraction of the tensor's max |w|.
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q5_0: 7e-2, Q.Q5_1: 4e-2}
TOLERANCE |= {Q.Q4_0: 0.14, Q.Q4_1: 0.07}

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


# ------------------------------------------------------------------- writing GGUF like llama.cpp
def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for q/k: each head's halves interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _encode(w: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    if w.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms (and biases) in F32
        return w.astype(np.float32), Q.F32
    if qtype == Q.F16:
        return w.astype(np.float16), Q.F16
    return gguf_quantize(w.astype(np.float32), qtype), qtype


def _write_tokenizer(writer: GGUFWriter, model_dir: Path) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"] | {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    cfg = json.loads((model_dir / "config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: CONTROL, 1: NORMAL
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_add_bos_token(tok.get("post_processor") is not None)  # ours prepends BOS
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    writer.add_chat_template(template)


def write_gguf(
    model_dir: Path,
    out: Path,
    qtype: GGMLQuantizationType = Q.F32,
    arch: str | None = None,
    name: str = "tiny",
    tokenizer: bool = True,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """``model_dir`` (a Hugging Face checkpoint) written as the GGUF file ``out``, with the
    ``extra`` F32 tensors (GGUF names) added."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = arch or cfg["model_type"]
    writer = GGUFWriter(str(out), arch)
    writer.add_name(name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if tokenizer:
        _write_tokenizer(writer, model_dir)
    permute = cfg["model_type"] in ("llama", "mistral")
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for hf_name, t in load_file(str(model_dir / "model.safetensors")).items():
        w = t.float().numpy()
        proj = hf_name.split(".")[-2]
        if permute and proj in heads:
            w = llama_cpp_permute(w, heads[proj])
        data, stored = _encode(w, qtype)
        writer.add_tensor(gguf_name(hf_name), data, raw_dtype=stored)
    for extra_name, data in (extra or {}).items():
        writer.add_tensor(extra_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def expected_roundtrip(w: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """What a perfect reader returns for ``w`` stored as ``qtype`` (gguf's own round trip)."""
    data, stored = _encode(w.float().numpy(), qtype)
    return torch.from_numpy(np.array(gguf_dequantize(data, stored), dtype=np.float32)).reshape(
        w.shape
    )


# ------------------------------------------------------------------------------------- tests
ROUNDTRIP_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ROUNDTRIP_TYPES, ids=lambda q: q.name)
def test_conversion_round_trips_the_weights(
    tmp_path: Path, make_tiny_model, family: str, qtype: GGMLQuantizationType
) -> None:
    src = make_tiny_model(family)
    path = write_gguf(src, tmp_path / f"tiny.{qtype.name}.gguf", qtype)
    source = convert(path, tmp_path / "hf")
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = load_file(str(src / "model.safetensors"))
    assert set(got) == set(want)
    assert source.architecture == family
    for name, w in want.items():
        assert got[name].dtype == torch.float32 and got[name].shape == w.shape, name
        # In the original row order: the q/k permutation is undone, not merely self-consistent.
        torch.testing.assert_close(got[name], expected_roundtrip(w, qtype), rtol=0, atol=0)
        err = float((got[name] - w.float()).abs().max())
        assert err <= TOLERANCE[qtype] * float(w.abs().max()), (name, err)
    if qtype == Q.F32:
        assert all(torch.equal(got[n], w) for n, w in want.items())


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_converted_config_and_tokenizer_match_the_original(
    tmp_path: Path, make_tiny_model, family: str
) -> None:
    from transformers import AutoTokenizer

    src = make_tiny_model(family)
    convert(write_gguf(src, tmp_path / "t.gguf"), tmp_path / "hf")
    got = json.loads((tmp_path / "hf" / "config.json").read_text())
    want = json.loads((src / "config.json").read_text())
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
    assert got["architectures"] == [arch.get(family, "Qwen2ForCausalLM")]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "max_position_embeddings", "bos_token_id",
                "eos_token_id", "tie_word_embeddings"):  # fmt: skip
        assert got[key] == want[key], key
    assert got["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"])
    assert got["rope_parameters"]["rope_theta"] == want["rope_parameters"]["rope_theta"]
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == want["eos_token_id"]
    t_got = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    t_want = AutoTokenizer.from_pretrained(str(src))
    text = "def f(x):\n    return x + 1  # über"
    assert t_got(text)["input_ids"] == t_want(text)["input_ids"]
    chat = [{"role": "user", "content": "hi there"}]
    assert t_got.apply_chat_template(chat, add_generation_prompt=True) == (
        t_want.apply_chat_template(chat, add_generation_prompt=True)
    )


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_engine_on_a_gguf_matches_transformers_on_the_original(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_tiny_model, family: str
) -> None:
    """F32 is lossless, so greedy tokens from the GGUF must equal transformers on the source
    checkpoint (and on the converted directory, which transformers loads unchanged)."""
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "cache"))
    src = make_tiny_model(family)
    path = write_gguf(src, tmp_path / "tiny-model.F32.gguf", Q.F32)
    llm = LLM(str(path), num_kv_blocks=64, block_size=8)
    assert llm.engine.model_name == "tiny-model"
    assert llm.engine.model_dir.parent == tmp_path / "cache"
    prompts = random_prompts(7, 3, 3, 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(src, prompt, 8)
        assert out.outputs[0].token_ids == ref
        assert hf_greedy(llm.engine.model_dir, prompt, 8) == ref


def test_cache_converts_once_and_names_entries_by_content(tmp_path: Path, make_tiny_model) -> None:
    src = make_tiny_model("llama")
    path = write_gguf(src, tmp_path / "a.gguf", Q.Q8_0)
    first = cached_hf_dir(path, tmp_path / "cache")
    assert served_model_name(first, first) == "a"  # the converted directory keeps the file's name
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_hf_dir(path, tmp_path / "cache") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    copy = tmp_path / "b.gguf"
    copy.write_bytes(path.read_bytes())
    assert cached_hf_dir(copy, tmp_path / "cache") == first  # same bytes, same entry
    other = write_gguf(src, tmp_path / "c.gguf", Q.Q4_0)
    assert cached_hf_dir(other, tmp_path / "cache") != first
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp")]
    assert leftovers == []


def test_unsupported_architecture_is_named(tmp_path: Path, make_tiny_model) -> None:
    path = write_gguf(make_tiny_model("llama"), tmp_path / "g.gguf", arch="gemma2")
    with pytest.raises(GGUFError, match=r"unsupported GGUF architecture 'gemma2'.*llama, mistral"):
        cached_hf_dir(path, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".convert.lock"]


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    writer = GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    writer.add_block_count(1)
    # IQ2_XXS stores 256 weights in 66 bytes; the reader derives the shape from the bytes.
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 66), np.uint8), raw_dtype=Q.IQ2_XXS)
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"IQ2_XXS \(blk\.0\.attn_q\.weight\); supported: F32"):
        convert(tmp_path / "iq.gguf", tmp_path / "hf")


def test_k_quant_tensors_dequantize_through_our_reader(tmp_path: Path) -> None:
    """gguf-py cannot write K-quants, so raw blocks are built here (scales set to finite f16)."""
    rng = np.random.default_rng(0)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks = {}
    for qtype, nbytes, scale_at in ((Q.Q4_K, 144, (0, 2)), (Q.Q6_K, 210, (208,))):
        raw = rng.integers(0, 256, (4, nbytes), dtype=np.uint8)
        for at in scale_at:  # Q4_K: d, dmin first; Q6_K: d last
            raw[:, at : at + 2] = scale
        blocks[qtype] = raw
    writer = GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for i, (qtype, raw) in enumerate(blocks.items()):
        writer.add_tensor(f"blk.{i}.ffn_up.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = open_gguf(tmp_path / "k.gguf")
    assert check_supported(reader, "k.gguf") == "llama"
    for t, (qtype, raw) in zip(reader.tensors, blocks.items(), strict=True):
        got = dequantize(t)
        assert got.shape == (4, 256) and got.dtype == torch.float32
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, torch.from_numpy(gguf_dequantize(raw, qtype)))


def test_unknown_tensors_and_missing_metadata_fail_clearly(tmp_path: Path, make_tiny_model) -> None:
    src = make_tiny_model("llama")
    freqs = {"rope_freqs.weight": np.ones(16, np.float32)}
    path = write_gguf(src, tmp_path / "l3.gguf", extra=freqs)
    with pytest.raises(GGUFError, match=r"rope_freqs .*not supported"):
        convert(path, tmp_path / "a")
    path = write_gguf(
        src, tmp_path / "x.gguf", extra={"blk.0.attn_qkv.weight": np.ones(8, np.float32)}
    )
    with pytest.raises(GGUFError, match=r"unexpected GGUF tensor 'blk.0.attn_qkv.weight'"):
        convert(path, tmp_path / "b")
    path = write_gguf(src, tmp_path / "notok.gguf", tokenizer=False)
    with pytest.raises(GGUFError, match=r"notok.gguf: cannot read the tokenizer"):
        convert(path, tmp_path / "c")


def test_bad_magic_and_truncated_files_fail_clearly(tmp_path: Path, make_tiny_model) -> None:
    good = write_gguf(make_tiny_model("llama"), tmp_path / "good.gguf", Q.Q8_0).read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + good[4:])
    with pytest.raises(GGUFError, match=r"not a GGUF file \(magic bytes b'GGML'"):
        cached_hf_dir(bad, tmp_path / "cache")
    for cut in (len(good) - 100, len(good) // 2, 64):
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(good[:cut])
        with pytest.raises(GGUFError, match=r"truncated"):
            cached_hf_dir(short, tmp_path / "cache")
    assert isinstance(GGUFError("x"), ValueError)


def test_model_names_drop_the_quantisation_label(tmp_path: Path) -> None:
    assert model_name_from_file("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert model_name_from_file("qwen2-0_5b-instruct-q4_k_m.gguf") == "qwen2-0_5b-instruct"
    assert model_name_from_file("Mistral-7B-v0.1-F16.gguf") == "Mistral-7B-v0.1"
    assert model_name_from_file("plain.gguf") == "plain"
    assert served_model_name(tmp_path / "some-dir", tmp_path / "some-dir") == "some-dir"


def _cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(REPO), "PAGEDSERVE_MODEL_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "stack", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=240,
    )


def test_import_gguf_cli_writes_a_directory_transformers_loads(
    tmp_path: Path, make_tiny_model
) -> None:
    from transformers import AutoModelForCausalLM

    src = make_tiny_model("qwen2")
    path = write_gguf(src, tmp_path / "q.gguf", Q.F32)
    proc = _cli("import-gguf", str(path), "--out", str(tmp_path / "out"), cache=tmp_path / "c")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["out"] == str(tmp_path / "out") and report["architecture"] == "qwen2"
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    ref = AutoModelForCausalLM.from_pretrained(str(src))
    ids = torch.tensor([[5, 17, 99, 260]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope" * 10)
    proc = _cli("import-gguf", str(bad), "--out", str(tmp_path / "o2"), cache=tmp_path / "c")
    assert proc.returncode == 2 and "not a GGUF file" in json.loads(proc.stdout)["error"]
    assert "Traceback" not in proc.stderr and not (tmp_path / "o2").exists()


def test_models_cli_lists_the_cache(tmp_path: Path, make_tiny_model) -> None:
    path = write_gguf(make_tiny_model("llama"), tmp_path / "tiny.Q8_0.gguf", Q.Q8_0)
    entry = cached_hf_dir(path, tmp_path / "cache")
    proc = _cli("models", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    listing = json.loads(proc.stdout)
    assert listing["cache_dir"] == str(tmp_path / "cache")
    assert [(c["name"], c["dir"]) for c in listing["cached"]] == [("tiny", str(entry))]
    if listing["default"] is not None:  # the embedded model's wheel is installed here
        assert listing["default"]["name"] == "SmolLM2-135M-Instruct"
        assert listing["default"]["path"].endswith(".gguf")
        assert listing["default"]["converted"] is False  # not in this fresh cache
