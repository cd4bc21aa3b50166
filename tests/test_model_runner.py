"""ModelRunner: KV-cache sizing, persistent block tables, copy-on-write block copies."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scheduler.output import ScheduledSequence, SchedulerOutput
from worker.cpu_memory import thp_mode
from worker.model_runner import (
    ModelRunner,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_weight_dtype,
)
from worker.models.layers import bf16_products_available
from worker.outputs import EngineConfig


def test_cache_is_sized_from_the_per_token_footprint(make_tiny_model) -> None:
    model_dir = make_tiny_model("llama")
    runner = ModelRunner(model_dir, EngineConfig(block_size=16, kv_cache_memory=1 << 20))
    mc = runner.model.config
    per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4  # fp32
    assert runner.bytes_per_token() == per_token
    assert runner.layout.num_blocks == (1 << 20) // (per_token * 16)
    k, v = runner.kv_caches[0]
    assert k.shape == (runner.layout.num_blocks, 16, mc.num_kv_heads, mc.head_dim)
    assert len(runner.kv_caches) == mc.num_layers and v.dtype == torch.float32
    bf16 = ModelRunner(
        model_dir, EngineConfig(block_size=8, kv_cache_memory=1 << 20, dtype="bfloat16")
    )
    assert bf16.bytes_per_token() == per_token // 2
    assert bf16.layout.num_blocks == (1 << 20) // (per_token // 2 * 8)
    explicit = ModelRunner(model_dir, EngineConfig(num_kv_blocks=7))
    assert explicit.layout.num_blocks == 7 and explicit.layout.capacity_tokens == 7 * 16


def test_tables_persist_and_copies_happen_before_the_pass(make_tiny_model) -> None:
    model_dir = make_tiny_model("llama")
    runner = ModelRunner(model_dir, EngineConfig(block_size=4, num_kv_blocks=16))
    prompt = [7, 8, 9, 10, 11, 12]
    slots = [12, 13, 14, 15, 20, 21]  # blocks 3 and 5 of 4 slots each
    prefill = ScheduledSequence(0, "r0", prompt, 0, 0, [3, 5], slots, True)
    first = runner.execute(SchedulerOutput([prefill], num_batched_tokens=6))
    assert first is not None and first.shape == (1, runner.model.config.vocab_size)
    assert runner._tables[runner._row_of[0], :2].tolist() == [3, 5]
    # Copy-on-write of block 5 into block 9, then decode position 6 of a fork living in block 9.
    fork = ScheduledSequence(1, "r1", [13], 6, 0, [3, 9], [9 * 4 + 2], True)
    out = runner.execute(SchedulerOutput([fork], block_copies=[(5, 9)], num_batched_tokens=1))
    for k, _ in runner.kv_caches:
        assert torch.equal(k[9, :2], k[5, :2])  # the copied prefix of the partial block
    # The fork reads the same prefix as the original would: compare with decoding on block 5.
    orig = ScheduledSequence(0, "r0", [13], 6, 2, [], [5 * 4 + 2], True)
    ref = runner.execute(SchedulerOutput([orig], num_batched_tokens=1))
    assert out is not None and ref is not None
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    runner.execute(SchedulerOutput([], released_seq_ids=[0, 1]))
    assert not runner._row_of


def test_block_copies_read_every_source_before_writing(make_tiny_model) -> None:
    """A step's copies as one gather then one scatter: block by block on a CPU when no
    destination is also a source; a chain (5 -> 6, 6 -> 7) keeps the gather first, so block 7
    gets block 6's old contents, not block 5's."""
    model_dir = make_tiny_model("llama")
    runner = ModelRunner(model_dir, EngineConfig(block_size=4, num_kv_blocks=16))
    cache = runner._cache
    cache.copy_(torch.randn_like(cache))
    before = cache.clone()
    runner._copy_blocks([(2, 9), (3, 11), (4, 0)])  # disjoint: the per-block path
    for src, dst in [(2, 9), (3, 11), (4, 0)]:
        assert torch.equal(cache[:, :, dst], before[:, :, src])
    untouched = [b for b in range(16) if b not in (9, 11, 0)]
    assert torch.equal(cache[:, :, untouched], before[:, :, untouched])
    before = cache.clone()
    runner._copy_blocks([(5, 6), (6, 7)])
    assert torch.equal(cache[:, :, 6], before[:, :, 5])
    assert torch.equal(cache[:, :, 7], before[:, :, 6])


def _run_probe(
    code: str, model_dir: Path, variable: str, setting: str | None, arg: str = "-"
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (process-wide settings are made once per process)
    with ``variable`` unset or set to ``setting`` (argv: ``model_dir``, ``arg``)."""
    env = {k: v for k, v in os.environ.items() if k != variable}
    if setting is not None:
        env[variable] = setting
    return subprocess.run(
        [sys.executable, "-c", code, str(model_dir), arg],
        env=env, capture_output=True, text=True, check=True,
        cwd=Path(__file__).parent.parent,
    )  # fmt: skip


def _probe(code: str, model_dir: Path, variable: str, setting: str | None) -> list[str]:
    """:func:`_run_probe`'s printed words."""
    return _run_probe(code, model_dir, variable, setting).stdout.split()


_HUGE_PAGES_PROBE = """
import os, sys
import worker.engine, worker.llm, worker.service  # what the worker and LLM import first
if sys.argv[2] == "allocated-first":
    import torch
    torch.zeros(4)  # torch reads its huge-page switch now, before the runner sets it
from worker.cpu_memory import huge_pages_in_effect
from worker.model_runner import ModelRunner
from worker.outputs import EngineConfig
runner = ModelRunner(sys.argv[1], EngineConfig(kv_cache_memory=64 << 20))
huge = [l for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')]
print(os.environ.get('THP_MEM_ALLOC_ENABLE'), int(huge[0].split()[1]), huge_pages_in_effect())
"""


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="no transparent huge pages")
@pytest.mark.parametrize("setting", [None, "0"])
def test_cpu_runner_asks_for_huge_pages_unless_told_not_to(
    make_tiny_model, setting: str | None
) -> None:
    """The KV cache (64 MiB here) and large weights land on 2 MiB pages by default, with the
    engine's modules imported first (a module-level tensor in one of them once turned this off
    for every worker)."""
    value, huge_kib, in_effect = _probe(
        _HUGE_PAGES_PROBE, make_tiny_model("llama"), "THP_MEM_ALLOC_ENABLE", setting
    )
    if setting is None:
        assert value == "1" and int(huge_kib) >= 32 * 1024 and in_effect == "True"
    elif thp_mode() == "madvise":
        assert value == "0" and int(huge_kib) == 0 and in_effect == "False"


@pytest.mark.skipif(thp_mode() != "madvise", reason="needs the kernel's madvise THP mode")
def test_runner_warns_when_torch_read_the_huge_page_switch_too_early(make_tiny_model) -> None:
    """A CPU tensor allocated before the runner: torch has read its switch unset, the runner
    cannot turn huge pages on any more, and says so."""
    out = _run_probe(
        _HUGE_PAGES_PROBE, make_tiny_model("llama"), "THP_MEM_ALLOC_ENABLE", None,
        "allocated-first",
    )  # fmt: skip
    value, huge_kib, in_effect = out.stdout.split()
    assert value == "1" and int(huge_kib) == 0 and in_effect == "False"
    assert "transparent huge pages are not in effect" in out.stderr


_MALLOC_PROBE = """
import ctypes, sys
from worker.model_runner import ModelRunner
from worker.outputs import EngineConfig

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
ModelRunner(sys.argv[1], EngineConfig(kv_cache_memory=8 << 20))
before = libc.mallinfo2().hblks
buf = libc.malloc(20 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(buf)
print(mapped, libc.mallinfo2().fordblks >= 20 << 20)
"""


def _has_mallinfo2() -> bool:
    import ctypes
    import platform

    return platform.libc_ver()[0] == "glibc" and hasattr(ctypes.CDLL(None), "mallinfo2")


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33")
@pytest.mark.parametrize("setting", [None, "0"])
def test_cpu_runner_keeps_large_freed_buffers_unless_told_not_to(
    make_tiny_model, setting: str | None
) -> None:
    """A 20 MB buffer (a prefill activation's size) comes from the heap and stays there when
    freed, instead of a fresh mmap that the kernel faults in and zeroes every time."""
    mapped, kept = _probe(
        _MALLOC_PROBE, make_tiny_model("llama"), "PAGEDSERVE_MALLOC_TUNING", setting
    )
    if setting is None:
        assert (mapped, kept) == ("0", "True")
    else:
        assert (mapped, kept) == ("1", "False")


def _packed(weight: object) -> bool:
    """Packed for the C GEMM (kernels/gemm.py) or for oneDNN."""
    from kernels.gemm import PanelWeight

    return isinstance(weight, PanelWeight) or bool(getattr(weight, "is_mkldnn", False))


@pytest.mark.parametrize("gemm", ["auto", "1", "0"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied and tied output heads
def test_packed_projection_weights_give_the_plain_results(
    make_tiny_model, monkeypatch: pytest.MonkeyPatch, family: str, gemm: str
) -> None:
    """The CPU runner packs projections (for the C GEMM or oneDNN, as PAGEDSERVE_NATIVE_GEMM
    says) by default; logits of a mixed prefill + decode batch match the plain weights'
    (float32 summation order aside)."""
    from kernels import gemm as native_gemm
    from kernels.gemm import PanelWeight

    monkeypatch.setenv("PAGEDSERVE_NATIVE_GEMM", gemm)
    want_panels = native_gemm.for_packing() is not None
    if gemm == "1" and not want_panels:
        pytest.skip("no C compiler: the GEMM does not build")
    if gemm == "0":
        assert not want_panels
    model_dir = make_tiny_model(family)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    batch = SchedulerOutput(
        [
            ScheduledSequence(0, "a", prompts[0], 0, 0, [0, 1], list(range(7)), True),
            ScheduledSequence(1, "b", prompts[1], 0, 0, [2], [8, 9, 10], True),
        ],
        num_batched_tokens=10,
    )
    logits = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("PAGEDSERVE_PREPACK_WEIGHTS", setting)
        runner = ModelRunner(model_dir, EngineConfig(block_size=4, num_kv_blocks=8))
        attn = runner.model.layers[0].attn
        assert _packed(attn.qkv_weight) == (setting == "1")
        assert _packed(runner.model.lm_head_weight) == (setting == "1")
        if setting == "1":
            assert isinstance(attn.qkv_weight, PanelWeight) == want_panels
        assert not runner.model.embed_weight.is_mkldnn  # lookups keep the plain table
        logits[setting] = runner.execute(batch)
    torch.testing.assert_close(logits["1"], logits["0"], rtol=1e-5, atol=1e-5)


def test_linear_with_a_packed_weight_handles_any_row_count() -> None:
    from worker.models.layers import linear, pack_weight

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    packed = pack_weight(weight)
    if packed is None:
        pytest.skip("this torch has no oneDNN weight packing")
    for rows in (0, 1, 5, 130):
        x = torch.randn(rows, 16, generator=gen)
        out = linear(x, packed, bias)
        assert out.shape == (rows, 24)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))
    x3 = torch.randn(2, 3, 16, generator=gen)
    torch.testing.assert_close(linear(x3, packed), x3 @ weight.T)
    assert pack_weight(weight.to(torch.bfloat16)) is None  # float32 only


def _mixed_batch() -> SchedulerOutput:
    """A prefill of 7 tokens and a 3-token chunk of another sequence, in one step."""
    return SchedulerOutput(
        [
            ScheduledSequence(0, "a", [5, 6, 7, 8, 9, 10, 11], 0, 0, [0, 1], list(range(7)), True),
            ScheduledSequence(1, "b", [12, 13, 14], 0, 0, [2], [8, 9, 10], True),
        ],
        num_batched_tokens=10,
    )


def _bf16_path_or_skip(path: str) -> None:
    """Skip where ``PAGEDSERVE_BF16_GEMM=<path>`` has nothing to run on this machine."""
    from kernels import gemm as native_gemm
    from worker.models.layers import onednn_bf16_available

    if path == "onednn" and not onednn_bf16_available():
        pytest.skip("no oneDNN bfloat16 linear in this torch on this CPU")
    lib = native_gemm.for_packing()
    if path == "native" and not (lib is not None and lib.bf16):
        pytest.skip("no bfloat16 C GEMM on this CPU (AVX512-BF16)")


@pytest.mark.parametrize("path", ["onednn", "native"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: qkv biases, a tied head
def test_bfloat16_weights_pack_every_projection_and_keep_float32_around_them(
    make_tiny_model, family: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--weight-dtype bfloat16``: every projection and the head become bfloat16 weights, for
    oneDNN or our C GEMM (``PAGEDSERVE_BF16_GEMM``; the embedding table and norms stay float32),
    logits stay float32 and within bfloat16's rounding of the float32 runner's, and they do
    differ from them (the mode is on)."""
    from worker.models.layers import Bf16Weight

    monkeypatch.setenv("PAGEDSERVE_BF16_GEMM", path)
    _bf16_path_or_skip(path)
    model_dir = make_tiny_model(family)
    logits = {}
    for weight_dtype in ("auto", "bfloat16"):
        cfg = EngineConfig(block_size=4, num_kv_blocks=8, weight_dtype=weight_dtype)
        runner = ModelRunner(model_dir, cfg)
        layer = runner.model.layers[0]
        for weight in (layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up_weight,
                       layer.mlp.down_weight, runner.model.lm_head_weight):  # fmt: skip
            assert isinstance(weight, Bf16Weight) == (weight_dtype == "bfloat16")
            if isinstance(weight, Bf16Weight):  # the forced path, and only it
                assert (weight.panels is not None, weight.packed is not None) == (
                    path == "native",
                    path == "onednn",
                )
        assert runner.model.embed_weight.dtype == torch.float32
        assert layer.input_norm.weight.dtype == torch.float32
        assert runner.kv_caches[0][0].dtype == torch.float32
        logits[weight_dtype] = runner.execute(_mixed_batch())
    got, want = logits["bfloat16"], logits["auto"]
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * scale)
    assert not torch.equal(got, want)


@pytest.mark.parametrize("path", ["onednn", "native"])
def test_a_bfloat16_weight_multiplies_like_its_rounded_float32_copy(path: str) -> None:
    """:class:`Bf16Weight` through oneDNN or our C GEMM: any row count, leading dimensions, the
    bias added in float32; the product is that of the bfloat16-rounded weight and input, to
    bfloat16's output rounding. An odd input width (no k pairs) goes to oneDNN either way, and
    so does, where the C GEMM has the AMX path, a width off its 32-wide steps."""
    from kernels import gemm as native_gemm
    from worker.models.layers import Bf16Weight, linear, onednn_available

    _bf16_path_or_skip(path)
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 32, generator=gen), torch.randn(24, generator=gen)
    packed = Bf16Weight.pack(weight, use_native=path == "native")
    assert isinstance(packed, Bf16Weight)
    assert (packed.panels is not None, packed.packed is not None) == (
        path == "native",
        path == "onednn",
    )
    assert packed.shape == (24, 32)
    rounded = weight.to(torch.bfloat16).float()
    for rows in (0, 1, 5, 130):
        x = torch.randn(rows, 32, generator=gen)
        out = linear(x, packed, bias)
        assert out.shape == (rows, 24) and out.dtype == torch.float32
        want = torch.nn.functional.linear(x.to(torch.bfloat16).float(), rounded, bias)
        torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
    x3 = torch.randn(2, 3, 32, generator=gen)
    assert linear(x3, packed).shape == (2, 3, 24)
    if onednn_available():
        odd = Bf16Weight.pack(torch.randn(8, 5, generator=gen), use_native=path == "native")
        assert odd is not None and odd.panels is None and odd.packed is not None
        assert odd.shape == (8, 5)
        lib = native_gemm.load()
        off_tiles = Bf16Weight.pack(torch.randn(8, 16, generator=gen), use_native=path == "native")
        tiles = path == "native" and lib is not None and lib.amx
        assert off_tiles is not None and (off_tiles.packed is not None) == (
            path == "onednn" or tiles
        )


def test_the_bfloat16_products_path_is_chosen_per_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto``: the C GEMM where its bfloat16 path builds (on AMX tiles where the CPU has
    them), except on a CPU with AMX whose build has no tile path (oneDNN's AMX kernels then);
    ``PAGEDSERVE_BF16_GEMM`` forces either; a bad value is refused by name."""
    from kernels import gemm as native_gemm
    from worker.models import layers

    lib = native_gemm.for_packing()
    has_native = lib is not None and lib.bf16
    monkeypatch.setenv("PAGEDSERVE_BF16_GEMM", "onednn")
    assert layers.bf16_native() is False
    monkeypatch.setenv("PAGEDSERVE_BF16_GEMM", "native")
    assert layers.bf16_native() is has_native
    monkeypatch.setenv("PAGEDSERVE_BF16_GEMM", "auto")
    for amx in (False, True):
        monkeypatch.setattr(layers, "_has_amx", lambda amx=amx: amx)
        tiles = lib is not None and lib.amx
        assert layers.bf16_native() is (has_native and (not amx or tiles))
    if lib is not None and lib.amx:  # a build without the tile path on this AMX CPU
        monkeypatch.setattr(lib, "amx", False)
        assert layers.bf16_native() is False
    monkeypatch.setenv("PAGEDSERVE_BF16_GEMM", "fast")
    with pytest.raises(ValueError, match="PAGEDSERVE_BF16_GEMM must be auto, native or onednn"):
        layers.bf16_native()


def test_bfloat16_weights_are_a_cpu_mode_for_float32_models() -> None:
    """Clear errors for what the mode is not: a GPU or a bfloat16 model (use --dtype), an
    unknown name, a CPU without bfloat16 products (an AVX2-only one); ``auto`` (the default)
    keeps the weights in the model's dtype."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig().weight_dtype == "auto"
    assert resolve_weight_dtype("auto", torch.float32, cpu) is None
    assert resolve_weight_dtype("auto", torch.bfloat16, cuda) is None
    with pytest.raises(ValueError, match="on a GPU use --dtype bfloat16"):
        resolve_weight_dtype("bfloat16", torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="for float32 models"):
        resolve_weight_dtype("bfloat16", torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="unsupported weight dtype"):
        resolve_weight_dtype("int4", torch.float32, cpu)
    if bf16_products_available():
        assert resolve_weight_dtype("bfloat16", torch.float32, cpu) == "bfloat16"
    else:  # refused before any weight is packed (oneDNN raised mid-load here before)
        with pytest.raises(ValueError, match="bfloat16 products, which this CPU lacks"):
            resolve_weight_dtype("bfloat16", torch.float32, cpu)
        from worker.models.layers import Bf16Weight

        assert Bf16Weight.pack(torch.ones(4, 4)) is None  # nothing to pack for, no raise
    assert resolve_weight_dtype("int8", torch.float32, cpu) == "int8"
    with pytest.raises(ValueError, match="int8 is a CPU mode for float32 models"):
        resolve_weight_dtype("int8", torch.bfloat16, cuda)


def test_the_default_dtype_is_float32_on_a_cpu_and_bfloat16_on_a_gpu() -> None:
    """``auto`` (the default): the CPU keeps transformers' float32 (greedy parity), a GPU runs
    bfloat16 as deployments there do; explicit names are taken as given, float16 not on a CPU."""
    assert EngineConfig().dtype == "auto"
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) is torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    with pytest.raises(ValueError, match="float16 is not supported on CPU"):
        resolve_dtype("float16", torch.device("cpu"))
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8", torch.device("cpu"))


def test_a_bfloat16_kv_cache_holds_twice_the_tokens_and_stays_close(make_tiny_model) -> None:
    """``--kv-cache-dtype bfloat16`` under a float32 model: half the bytes per token, so twice
    the blocks in the same budget; the weights and activations stay float32, the fused rope +
    KV write stores rounded keys and values, and logits stay within the cache's rounding of
    the float32 cache's (and differ from them: the mode is on). With ``--weight-dtype
    bfloat16`` too, the whole bfloat16 mode."""
    model_dir = make_tiny_model("llama")
    budget = 1 << 20
    base = ModelRunner(model_dir, EngineConfig(block_size=4, kv_cache_memory=budget))
    half = ModelRunner(
        model_dir, EngineConfig(block_size=4, kv_cache_memory=budget, kv_cache_dtype="bfloat16")
    )
    assert half.kv_dtype == torch.bfloat16 and half.dtype == torch.float32
    assert half.bytes_per_token() * 2 == base.bytes_per_token()
    assert half.layout.num_blocks == 2 * base.layout.num_blocks
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in half.kv_caches)
    assert half.model.embed_weight.dtype == torch.float32
    want, got = base.execute(_mixed_batch()), half.execute(_mixed_batch())
    assert got.dtype == torch.float32
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=0.02 * scale)
    assert not torch.equal(got, want)
    k_half, k_base = half.kv_caches[0][0], base.kv_caches[0][0]
    written = k_base.flatten(0, 1)[:11].to(torch.bfloat16)  # slots 0-10 of the batch
    assert torch.equal(k_half.flatten(0, 1)[:11], written)  # rounded as torch rounds
    if not bf16_products_available():  # (the weights' mode is refused: test below)
        return
    both = ModelRunner(model_dir, EngineConfig(block_size=4, num_kv_blocks=8,
                                               kv_cache_dtype="bfloat16",
                                               weight_dtype="bfloat16"))  # fmt: skip
    torch.testing.assert_close(both.execute(_mixed_batch()), want, rtol=0, atol=0.05 * scale)


def test_kv_cache_dtype_choices_and_errors() -> None:
    """``auto`` (the default) is the model's dtype; a float32 model may keep its cache in
    bfloat16 on a CPU; clear errors for float16 on a CPU, a cache wider than the model, a GPU
    cache other than the model's dtype, and unknown names."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig().kv_cache_dtype == "auto"
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) is torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cuda) is torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, cpu) is torch.bfloat16
    assert resolve_kv_cache_dtype("bf16", torch.bfloat16, cpu) is torch.bfloat16
    assert resolve_kv_cache_dtype("float32", torch.float32, cpu) is torch.float32
    refused = [
        ("float16", torch.float32, cpu, "not supported on CPU"),
        ("float32", torch.bfloat16, cpu, "wider than the model"),
        ("float32", torch.bfloat16, cuda, "on a GPU"),
        ("fp8", torch.float32, cpu, "unsupported KV-cache dtype"),
    ]
    for name, dtype, device, why in refused:
        with pytest.raises(ValueError, match=why):
            resolve_kv_cache_dtype(name, dtype, device)


@pytest.mark.parametrize("family", ["llama", "mistral"])  # untied heads: the head is int8 too
def test_int8_weights_generate_as_their_dequantized_float32_copy(
    make_tiny_model, family: str, tmp_path: Path
) -> None:
    """``--weight-dtype int8``: every projection and the head become int8 panels with a scale
    per 32 inputs of each row (the embedding table, norms and KV cache stay float32), and
    greedy generation gives, token for token, what the float32 engine gives over a copy of the
    checkpoint whose projection weights are replaced by their int8 values times their scales:
    the mode's products are, bit for bit, the float32 ones with those weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kernels.gemm import PanelWeight, dequantize_int8, quantize_int8
    from pagedserve.params import SamplingParams
    from tests.test_engine import random_prompts
    from worker import LLM

    src = make_tiny_model(family)
    dequantized = tmp_path / "dequantized"
    shutil.copytree(src, dequantized)
    (shard,) = dequantized.glob("*.safetensors")
    tensors = load_file(shard)
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            tensors[name] = dequantize_int8(*quantize_int8(tensor.float())).to(tensor.dtype)
    save_file(tensors, shard, metadata={"format": "pt"})

    int8 = LLM(src, num_kv_blocks=64, weight_dtype="int8")
    model = int8.engine.runner.model
    layer = model.layers[0]
    for weight in (layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up_weight,
                   layer.mlp.down_weight, model.lm_head_weight):  # fmt: skip
        assert isinstance(weight, PanelWeight) and weight.panels.dtype == torch.int8
        assert weight.scale is not None and not weight.glu  # gate/up: then the SwiGLU pass
    assert model.embed_weight.dtype == torch.float32
    assert int8.engine.runner.kv_caches[0][0].dtype == torch.float32

    prompts = random_prompts(21, 6, 1, 60)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = int8.generate(prompts, params)
    want = LLM(dequantized, num_kv_blocks=64).generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.error is None and g.outputs[0].token_ids == w.outputs[0].token_ids
    plain = LLM(src, num_kv_blocks=64).generate(prompts, params)  # and the mode is on
    assert any(
        p.outputs[0].token_ids != g.outputs[0].token_ids for p, g in zip(plain, got, strict=True)
    )
