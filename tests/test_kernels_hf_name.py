"""Our ``kernels`` package shares its import name with Hugging Face's ``kernels`` library.

transformers 5.x probes that name (``is_kernels_available``): ``find_spec("kernels")`` finds our
package, and the version it then reads comes from our distribution's metadata (``pagedserve``),
which sits outside the window transformers accepts (``KERNELS_MIN_VERSION`` ..
``KERNELS_MAX_VERSION``), so transformers never tries ``from kernels import get_kernel``. These
tests check the real probe, the reason it answers False (so a version bump into that window
fails here, loudly), and that a small Llama still loads and runs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from packaging import version
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import import_utils, is_kernels_available

import kernels


def test_probe_finds_our_package_but_reports_unavailable() -> None:
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    assert spec is not None and spec.origin == kernels.__file__
    assert not hasattr(kernels, "get_kernel")  # what transformers would import from HF's library
    assert is_kernels_available() is False


def test_detected_version_is_outside_the_hf_kernels_window() -> None:
    found, detected = import_utils._is_package_available("kernels", return_version=True)
    assert found
    low = version.parse(import_utils.KERNELS_MIN_VERSION)
    high = version.parse(import_utils.KERNELS_MAX_VERSION)
    assert detected == "N/A" or not (low <= version.parse(detected) < high), detected


def test_hub_kernels_integration_imports_without_using_ours() -> None:
    from transformers.integrations import hub_kernels

    from_ours = [
        name
        for name, obj in vars(hub_kernels).items()
        if getattr(obj, "__module__", "").split(".")[0] == "kernels"
    ]
    assert from_ours == []
    assert callable(hub_kernels.use_kernel_forward_from_hub)  # the no-kernels fallback


def test_small_llama_saves_loads_and_runs(tmp_path: Path) -> None:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        expected = model(ids).logits
        got = loaded(ids).logits
        generated = loaded.generate(ids, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(got, expected)
    assert generated.shape == (1, 9)
    assert torch.equal(generated[:, :5], ids)
