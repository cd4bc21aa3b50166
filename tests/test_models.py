"""Our model modules against transformers on the same checkpoints, through a hand-built paged cache.

Each test drives the model the way the model runner will: a flat batch of sequences, each with its
own (shuffled) block list, K/V written by slot, prefill and decode tokens mixed freely. The
reference is the transformers model run on each sequence alone, unpadded: causal attention makes
one forward over a whole sequence yield the reference logits of every one of its positions.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import AttentionMetadata
from tests.fixtures.models import TINY_FAMILIES, MakeTinyModel
from worker.loader import iter_weights, load_model, read_eos_token_ids
from worker.make_model import build_checkpoint
from worker.models import CausalLM

ATOL = 1e-4
RTOL = 1e-5


@dataclass
class Seq:
    """One sequence of the harness: all its tokens so far and the blocks that hold their K/V."""

    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V are in the cache


class PagedHarness:
    """A paged KV cache plus the bookkeeping a scheduler would do, kept deliberately simple."""

    def __init__(self, model: CausalLM, block_size: int, num_blocks: int, seed: int) -> None:
        cfg = model.config
        gen = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Garbage in unused slots: reading outside a sequence's context cannot pass unnoticed.
        self.kv_caches = [
            (
                torch.randn(shape, generator=gen, dtype=cfg.dtype) * 10,
                torch.randn(shape, generator=gen, dtype=cfg.dtype) * 10,
            )
            for _ in range(cfg.num_layers)
        ]
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.model = model
        self.block_size = block_size

    def _reserve(self, seq: Seq, total: int) -> None:
        while len(seq.blocks) * self.block_size < total:
            seq.blocks.append(self.free.pop())

    def step(self, work: list[tuple[Seq, int]]) -> list[torch.Tensor]:
        """Compute the next ``n`` tokens of each ``(seq, n)``; float32 logits per sequence."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for seq, n in work:
            end = seq.cached + n
            assert end <= len(seq.tokens)
            self._reserve(seq, end)
            for pos in range(seq.cached, end):
                input_ids.append(seq.tokens[pos])
                positions.append(pos)
                slots.append(seq.blocks[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            seq_lens.append(end)
        max_blocks = max(len(seq.blocks) for seq, _ in work)
        table = torch.zeros(len(work), max_blocks, dtype=torch.int32)
        for b, (seq, _) in enumerate(work):
            table[b, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(input_ids), len(logits[0]))
        for seq, n in work:
            seq.cached += n
        return list(logits.split(query_lens))


@pytest.fixture(scope="module")
def models(make_tiny_model: MakeTinyModel) -> dict[str, tuple[CausalLM, Any]]:
    """(ours, transformers') float32 models per tiny family, loaded once for the module."""
    from transformers import AutoModelForCausalLM

    loaded = {}
    for family in TINY_FAMILIES:
        path = make_tiny_model(family)
        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        loaded[family] = (load_model(path, dtype=torch.float32), ref)
    return loaded


def reference_logits(ref: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (length,), generator=gen).tolist()


def assert_matches_reference(ref: Any, seq: Seq, got: list[tuple[int, torch.Tensor]]) -> None:
    """``got``: (first position, logits rows) pieces computed by our model for ``seq``."""
    expected = reference_logits(ref, seq.tokens)
    for start, rows in got:
        torch.testing.assert_close(rows, expected[start : start + len(rows)], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_prefill_then_decode_matches_transformers(
    family: str, block_size: int, models: dict[str, tuple[CausalLM, Any]]
) -> None:
    model, ref = models[family]
    vocab = model.config.vocab_size
    prompt_lens = [1, 5, block_size, 2 * block_size + 3, 70]
    seqs = [Seq(random_prompt(n, vocab, seed=n + block_size)) for n in prompt_lens]
    harness = PagedHarness(model, block_size, num_blocks=64, seed=block_size)
    got: dict[int, list[tuple[int, torch.Tensor]]] = {i: [] for i in range(len(seqs))}

    # One pass prefills every prompt, then every sequence decodes greedily, one token a step.
    pieces = harness.step([(seq, len(seq.tokens)) for seq in seqs])
    for step in range(5):
        for i, (seq, rows) in enumerate(zip(seqs, pieces, strict=True)):
            got[i].append((seq.cached - len(rows), rows))
            seq.tokens.append(int(rows[-1].argmax()))
        if step < 4:
            pieces = harness.step([(seq, 1) for seq in seqs])
    for i, seq in enumerate(seqs):
        seq.tokens.pop()  # the last greedy token was never fed back
        assert_matches_reference(ref, seq, got[i])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_mixed_prefill_chunks_and_decodes_in_one_pass(
    family: str, models: dict[str, tuple[CausalLM, Any]]
) -> None:
    """Decodes of two sequences share passes with the chunked prefill of a third."""
    model, ref = models[family]
    vocab = model.config.vocab_size
    harness = PagedHarness(model, block_size=16, num_blocks=48, seed=7)
    a = Seq(random_prompt(20, vocab, seed=1) + random_prompt(3, vocab, seed=2))
    b = Seq(random_prompt(45, vocab, seed=3) + random_prompt(3, vocab, seed=4))
    c = Seq(random_prompt(60, vocab, seed=5))
    got: dict[str, list[tuple[int, torch.Tensor]]] = {"a": [], "b": [], "c": []}

    rows_a, rows_b = harness.step([(a, 20), (b, 45)])
    got["a"].append((0, rows_a))
    got["b"].append((0, rows_b))
    # c's first chunk rides with a and b decoding; its second chunk reads the first from the cache.
    for chunk in (25, 35):
        rows_a, rows_c, rows_b = harness.step([(a, 1), (c, chunk), (b, 1)])
        got["a"].append((a.cached - 1, rows_a))
        got["b"].append((b.cached - 1, rows_b))
        got["c"].append((c.cached - chunk, rows_c))
    # Then all three decode together, in another order.
    c.tokens.append(int(rows_c[-1].argmax()))
    rows_c, rows_b, rows_a = harness.step([(c, 1), (b, 1), (a, 1)])
    got["c"].append((c.cached - 1, rows_c))
    got["b"].append((b.cached - 1, rows_b))
    got["a"].append((a.cached - 1, rows_a))
    for name, seq in (("a", a), ("b", b), ("c", c)):
        assert seq.cached == len(seq.tokens)
        assert_matches_reference(ref, seq, got[name])


def test_tied_embeddings_share_the_output_head(models: dict[str, tuple[CausalLM, Any]]) -> None:
    qwen, _ = models["qwen2"]
    llama, _ = models["llama"]
    assert qwen.config.tie_word_embeddings
    assert qwen.lm_head_weight.data_ptr() == qwen.embed_weight.data_ptr()
    assert llama.lm_head_weight.data_ptr() != llama.embed_weight.data_ptr()


def test_config_fields(
    models: dict[str, tuple[CausalLM, Any]], make_tiny_model: MakeTinyModel
) -> None:
    llama, _ = models["llama"]
    mistral, _ = models["mistral"]
    qwen, _ = models["qwen2"]
    assert (llama.config.head_dim, llama.config.num_heads, llama.config.num_kv_heads) == (32, 4, 2)
    assert llama.config.sliding_window is None
    assert mistral.config.sliding_window == 32
    assert mistral.config.layer_sliding_windows == (32, 32)
    assert qwen.config.qkv_bias and not qwen.config.o_bias
    gen = json.loads((make_tiny_model("llama") / "generation_config.json").read_text())
    assert llama.config.eos_token_ids == tuple(dict.fromkeys([1, *gen["eos_token_id"]]))
    assert read_eos_token_ids(make_tiny_model("llama")) == llama.config.eos_token_ids


def run_and_compare(model: CausalLM, ref: Any, prompt: list[int], decode_steps: int = 3) -> None:
    """Prefill ``prompt`` minus its tail, feed the tail one token a step, compare every row."""
    seq = Seq(list(prompt))
    harness = PagedHarness(model, block_size=16, num_blocks=32, seed=len(prompt))
    got = [(0, harness.step([(seq, len(prompt) - decode_steps)])[0])]
    for _ in range(decode_steps):
        got.append((seq.cached, harness.step([(seq, 1)])[0]))
    assert_matches_reference(ref, seq, got)


def copy_with_config(src: Path, dst: Path, drop: tuple[str, ...] = (), **changes: Any) -> Path:
    """A copy of checkpoint ``src`` whose config.json has ``changes`` applied, ``drop`` removed."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    for key in drop:
        config.pop(key, None)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


ROPE_VARIANTS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(16)],
        "long_factor": [2.0 + 0.5 * i for i in range(16)],
        "original_max_position_embeddings": 1024,
    },
}


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_scaling_variants_match_transformers(
    variant: str, tmp_path: Path, make_tiny_model: MakeTinyModel
) -> None:
    from transformers import AutoModelForCausalLM

    path = copy_with_config(
        make_tiny_model("llama"), tmp_path / variant, rope_parameters=ROPE_VARIANTS[variant]
    )
    model = load_model(path)
    assert model.config.rope_type == variant
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    run_and_compare(model, ref, random_prompt(80, model.config.vocab_size, seed=11))


def test_unsupported_rope_type_is_refused(tmp_path: Path, make_tiny_model: MakeTinyModel) -> None:
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    path = copy_with_config(make_tiny_model("llama"), tmp_path / "dyn", rope_parameters=rope)
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        load_model(path)


def test_unsupported_architecture_names_the_supported_ones(
    tmp_path: Path, make_tiny_model: MakeTinyModel
) -> None:
    path = copy_with_config(
        make_tiny_model("llama"), tmp_path / "gpt2", architectures=["GPT2LMHeadModel"]
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load_model(path)
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert supported in str(err.value)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_sharded_checkpoint_loads_like_a_single_file(
    family: str,
    tmp_path: Path,
    make_tiny_model: MakeTinyModel,
    models: dict[str, tuple[CausalLM, Any]],
) -> None:
    sharded = build_checkpoint(family, "tiny", tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (sharded / "model.safetensors").exists()
    stored = dict(iter_weights(sharded))
    single = dict(iter_weights(make_tiny_model(family)))
    assert stored.keys() == single.keys()
    loaded = load_model(sharded)
    whole, ref = models[family]
    for (name, p_sharded), (_, p_whole) in zip(
        loaded.named_parameters(), whole.named_parameters(), strict=True
    ):
        assert torch.equal(p_sharded, p_whole), name
    run_and_compare(loaded, ref, random_prompt(20, whole.config.vocab_size, seed=5))


def test_bfloat16_tracks_float32(
    models: dict[str, tuple[CausalLM, Any]], make_tiny_model: MakeTinyModel
) -> None:
    model32, _ = models["llama"]
    model16 = load_model(make_tiny_model("llama"), dtype="bfloat16")
    assert model16.embed_weight.dtype == torch.bfloat16
    prompt = random_prompt(40, model32.config.vocab_size, seed=3)
    logits = {}
    for name, model in (("fp32", model32), ("bf16", model16)):
        harness = PagedHarness(model, block_size=16, num_blocks=8, seed=0)
        logits[name] = harness.step([(Seq(list(prompt)), len(prompt))])[0]
    assert logits["bf16"].dtype == torch.float32
    diff = (logits["bf16"] - logits["fp32"]).abs()
    scale = logits["fp32"].std()
    assert diff.mean() < 0.03 * scale and diff.max() < 0.2 * scale
    agree = (logits["bf16"].argmax(-1) == logits["fp32"].argmax(-1)).float().mean()
    assert agree > 0.9


def test_qwen2_sliding_window_on_upper_layers_matches_transformers(
    tmp_path: Path, make_tiny_model: MakeTinyModel
) -> None:
    """``use_sliding_window`` with ``max_window_layers=1``: layer 0 full, layer 1 windowed."""
    from transformers import AutoModelForCausalLM

    path = copy_with_config(
        make_tiny_model("qwen2"),
        tmp_path / "qwen2-swa",
        drop=("layer_types",),
        use_sliding_window=True,
        sliding_window=12,
        max_window_layers=1,
    )
    model = load_model(path)
    assert model.config.layer_sliding_windows == (None, 12)
    assert model.config.sliding_window == 12
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    run_and_compare(model, ref, random_prompt(45, model.config.vocab_size, seed=9))


@pytest.mark.parametrize("rows", [1, 8, 96, 2048])
def test_rms_norm_fused_path_is_bit_identical_to_the_composite(rows: int) -> None:
    """float32 uses F.rms_norm; it must equal Hugging Face's composite formula exactly."""
    from worker.models.layers import RMSNorm

    norm = RMSNorm(512, 1e-6, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(rows)
    norm.weight.data.copy_(torch.randn(512, generator=gen))
    x = torch.randn(rows, 512, generator=gen) * 3
    composite = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(norm(x), composite)
