"""The engine on a GPU: greedy parity with ``transformers`` through the Triton kernels.

CPU-only machines (CI) skip these; ``bash bench/gpu_check.sh`` runs them on a CUDA machine. The
checkpoints are built here (not by the shared fixtures) because that script runs pytest with
``--noconftest``. The reference is ``transformers`` on the CPU in float32, as for the CPU engine;
our engine runs on the GPU in float32 (parity) and in bfloat16 (it runs; lengths, no parity:
bfloat16 rounding differs between any two implementations).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from pagedserve.params import SamplingParams
from tests.test_engine import hf_greedy, random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


#: Checkpoints built so far in this session: the parametrized cases share them, as they share
#: transformers' references (:func:`_reference`); each costs device-session time.
_BUILT: dict[tuple[str, str], Path] = {}


def _checkpoint(tmp_path_factory: pytest.TempPathFactory, family: str, preset: str) -> Path:
    from worker.make_model import build_checkpoint

    key = (family, preset)
    if key not in _BUILT:
        out = tmp_path_factory.mktemp(f"{family}-{preset}")
        _BUILT[key] = build_checkpoint(family, preset, out)
    return _BUILT[key]


@cache
def _reference(model_dir: Path, prompt: tuple[int, ...]) -> list[int]:
    """transformers' 16 greedy tokens for ``prompt`` (computed once per checkpoint and prompt)."""
    return hf_greedy(model_dir, list(prompt), 16)


def _prompts() -> list[list[int]]:
    shared = random_prompts(99, 1, 40, 40)[0]  # a shared system prompt: prefix-cache hits
    return random_prompts(1, 8, 1, 90) + random_prompts(2, 6, 1, 30, shared=shared)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"block_size": 16, "max_num_batched_tokens": 512}, id="roomy"),
        pytest.param({"block_size": 8, "max_num_batched_tokens": 24}, id="chunked-prefill"),
        pytest.param({"block_size": 8, "num_kv_blocks": 22, "max_num_batched_tokens": 64},
                     id="preemption"),
    ],
)  # fmt: skip
def test_greedy_on_cuda_matches_transformers(
    tmp_path_factory: pytest.TempPathFactory, family: str, options: dict
) -> None:
    from worker import LLM

    model_dir = _checkpoint(tmp_path_factory, family, "tiny")
    opts = {"num_kv_blocks": 128, **options}
    llm = LLM(model_dir, device="cuda", dtype="float32", **opts)
    assert llm.engine.runner.device.type == "cuda"
    prompts = _prompts()
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.error is None
        want = _reference(model_dir, tuple(prompt))
        assert out.outputs[0].token_ids == want, f"prompt of {len(prompt)}"
    stats = llm.engine.stats()
    assert stats.prefix_cache["hit_tokens"] > 0
    if opts["num_kv_blocks"] == 22:
        assert stats.preemptions > 0, "the small pool must force preemptions"
    assert llm.engine.occupancy().in_use == 0, "all blocks return to the pool"


def test_bench_shape_on_cuda_matches_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """head_dim 64, GQA 2, 8 layers: the shape the throughput benchmark runs."""
    from worker import LLM

    model_dir = _checkpoint(tmp_path_factory, "llama", "bench")
    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=16, num_kv_blocks=256)
    prompts = _prompts()
    outs = llm.generate(prompts, GREEDY)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [_reference(model_dir, tuple(p)) for p in prompts]


def test_bfloat16_on_cuda_runs_parallel_samples(tmp_path_factory: pytest.TempPathFactory) -> None:
    """bfloat16 weights and cache, n=3 samples of one prompt (copy-on-write of the last block)."""
    from worker import LLM

    model_dir = _checkpoint(tmp_path_factory, "qwen2", "tiny")
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=64)
    assert llm.engine.runner.dtype is torch.bfloat16
    params = SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=20, ignore_eos=True)
    outs = llm.generate(_prompts()[:4], params)
    for out in outs:
        assert out.error is None
        assert [len(c.token_ids) for c in out.outputs] == [20, 20, 20]
    assert llm.engine.occupancy().in_use == 0
