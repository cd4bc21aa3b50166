"""The Triton backend against the float64 dense reference.

Without CUDA the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, fp32 only,
small shapes: it is slow). The variable must be set before the JIT functions are defined, so this
module sets it for the import of ``kernels.triton_backend`` (reloading it and
``kernels.triton_kernels`` if another module imported them first) and for each of its tests,
restoring the environment after each, so other test modules in the same process are left alone.
With CUDA, the same cases plus the ``gpu``-marked ones (half precision, more head sizes, larger
batches) run compiled on the device.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from kernels.reference import reference_paged_attention, reference_write_kv
from kernels.testing import PagedBatch, make_batch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _import_backend():  # type: ignore[no-untyped-def]
    if HAS_CUDA:
        return importlib.import_module("kernels.triton_backend")
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        # The kernels are defined in kernels.triton_kernels; the backend takes INTERPRET from it.
        for name in ("kernels.triton_kernels", "kernels.triton_backend"):
            module = sys.modules.get(name)
            if module is not None and not module.INTERPRET:
                importlib.reload(module)
        return importlib.import_module("kernels.triton_backend")
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


triton_backend = _import_backend()
gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton reads the variable again when a launch imports more of itself: keep it set."""
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def check(
    batch: PagedBatch,
    sliding_window: int | None = None,
    atol: float = 2e-5,
    rtol: float = 1e-4,
) -> None:
    """write_kv then paged_attention through the Triton backend, against the reference."""
    backend = triton_backend.TritonBackend()
    scale = batch.query.shape[-1] ** -0.5
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    reference_write_kv(batch.key, batch.value, ref_k, ref_v, batch.meta.slot_mapping)
    backend.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    assert torch.equal(batch.k_cache, ref_k)
    assert torch.equal(batch.v_cache, ref_v)
    expected = reference_paged_attention(
        batch.query.double(), ref_k.double(), ref_v.double(), batch.meta, scale, sliding_window
    )
    got = backend.paged_attention(
        batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, scale,
        sliding_window,
    )  # fmt: skip
    assert got.dtype == batch.query.dtype and got.shape == batch.query.shape
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)


CASES = {
    "decode_ragged": ([1, 1, 1], [3, 17, 40]),
    "one_full_block": ([1, 16], [16, 16]),
    "one_past_block": ([1, 1], [17, 9]),
    "pure_prefill": ([20], [20]),
    "prefix_then_chunk": ([9, 1], [40, 25]),
    "mixed": ([5, 1, 18, 1], [5, 30, 50, 2]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_named_cases(case: str) -> None:
    q_lens, s_lens = CASES[case]
    batch = make_batch(
        q_lens, s_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, device=DEVICE
    )
    check(batch)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (4, 1)])
def test_block_sizes_and_gqa(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    batch = make_batch(
        [1, 6, 1], [33, 38, 16],
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32, block_size=block_size,
        device=DEVICE, seed=block_size + num_heads,
    )  # fmt: skip
    check(batch)


@pytest.mark.parametrize("window", [1, 6, 20])
def test_sliding_window(window: int) -> None:
    batch = make_batch(
        [1, 1, 12, 1], [45, 5, 30, 33],
        num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, device=DEVICE, seed=window,
    )  # fmt: skip
    check(batch, sliding_window=window)


def test_long_decode_uses_several_splits() -> None:
    assert triton_backend._num_splits(700, 8) > 1
    batch = make_batch(
        [1, 1], [700, 300], num_heads=2, num_kv_heads=1, head_dim=32, block_size=32, device=DEVICE
    )
    check(batch)


def test_head_dim_not_a_power_of_two() -> None:
    batch = make_batch(
        [1, 5], [12, 20], num_heads=2, num_kv_heads=1, head_dim=48, block_size=8, device=DEVICE
    )
    check(batch)


def test_negative_slots_are_skipped() -> None:
    backend = triton_backend.TritonBackend()
    k_cache = torch.zeros(2, 8, 2, 32, device=DEVICE)
    v_cache = torch.zeros(2, 8, 2, 32, device=DEVICE)
    key = torch.randn(3, 2, 32, device=DEVICE)
    value = torch.randn(3, 2, 32, device=DEVICE)
    slots = torch.tensor([5, -1, 12], dtype=torch.int64, device=DEVICE)
    backend.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[0, 5], key[0]) and torch.equal(v_cache[1, 4], value[2])
    assert int((k_cache.abs().sum(dim=(2, 3)) != 0).sum()) == 2


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU, tests/test_engine_cuda.py runs the engine there")
def test_the_engine_through_the_triton_backend_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine with the Triton backend (under the interpreter) in place of the CPU one, the
    fused C ops off so that the KV writes go through Triton too: the GPU path's integration
    (plans, metadata, chunked prefill, prefix hits, decode splits), checked where CI runs."""
    from kernels import registry
    from pagedserve.params import SamplingParams
    from tests.test_engine import hf_greedy, random_prompts
    from worker import LLM
    from worker.make_model import build_checkpoint

    model_dir = build_checkpoint("qwen2", "tiny", tmp_path / "qwen2")
    monkeypatch.setitem(registry._BACKENDS, "cpu", triton_backend.TritonBackend())
    llm = LLM(model_dir, block_size=16, num_kv_blocks=64, max_num_batched_tokens=48)
    llm.engine.runner.model.use_fused = False
    shared = random_prompts(99, 1, 40, 40)[0]
    prompts = random_prompts(1, 3, 1, 70) + random_prompts(2, 3, 1, 20, shared=shared)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model_dir, p, 8) for p in prompts]
    assert llm.engine.stats().prefix_cache["hit_tokens"] > 0


@pytest.mark.skipif(HAS_CUDA, reason="gpu_check.sh runs the full-size timings on a GPU")
def test_the_triton_timings_run_at_a_tiny_shape() -> None:
    """``bench.kernels --triton``'s decode and prefill timings, on the CPU under the interpreter
    at a tiny shape: what a GPU session runs first must not fail there."""
    from bench.kernels import TritonCase, bench_triton_decode, bench_triton_prefill

    case = TritonCase("cpu", torch.float32, heads=4, kv_heads=2, head_dim=32, block_size=8)
    dec = bench_triton_decode(2, 40, 1, case)
    assert dec["ms"] > 0 and dec["sum_read_gbps"] > 0 and dec["fraction_of_read"] >= 0
    pre = bench_triton_prefill(2, 12, 20, 1, case)
    # causal: the 12 queries of each chunk see 21 .. 32 keys; 4 x head_dim per head and key
    assert pre["flops"] == 4 * 32 * 4 * 2 * sum(range(21, 33)) and pre["ms"] > 0


# ---------------------------------------------------------------- compiled, on the GPU only
@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_gpu_dtypes_and_head_dims(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    s_lens = torch.randint(1, 600, (40,), generator=gen).tolist()
    q_lens = [1] * 40
    q_lens[3], s_lens[3] = 200, 200
    q_lens[7], s_lens[7] = 130, 700
    batch = make_batch(
        q_lens, s_lens, num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16,
        dtype=dtype, device=DEVICE,
    )  # fmt: skip
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    check(batch, atol=tol, rtol=tol)


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("window", [None, 100])
def test_gpu_large_mixed_batch(block_size: int, window: int | None) -> None:
    gen = torch.Generator().manual_seed(block_size)
    s_lens = torch.randint(1, 2000, (128,), generator=gen).tolist()
    q_lens = [1] * 128
    for i in range(0, 128, 31):
        q_lens[i] = min(s_lens[i], 300)
    batch = make_batch(
        q_lens, s_lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=block_size,
        dtype=torch.bfloat16, device=DEVICE,
    )  # fmt: skip
    check(batch, sliding_window=window, atol=2e-2, rtol=2e-2)
