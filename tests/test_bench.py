"""The throughput benchmark itself: its arithmetic, and one real quick run end to end.

Speed is never asserted here (shared machines are noisy); these tests check that the benchmark
runs from a checkout, that every system generated exactly the requested tokens, and that the
figures it derives (ratios, medians, MFU) are computed from what was measured. MFU is checked
against FLOPs that torch itself counts (``FlopCounterMode``) on a forward pass of the model, not
against the benchmark's own ``2 x params x tokens`` formula.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.throughput import (
    PRESETS,
    REPO,
    Workload,
    add_mfu,
    make_workload,
    median_result,
    model_numbers,
    parse_args,
    pick_systems,
    pick_workloads,
    ratio,
    run_child,
    vllm_env,
    vllm_preload,
)


def _workload(prompt_tokens: int, output_tokens: int) -> Workload:
    return Workload("w", [[1] * prompt_tokens], [output_tokens], 1024)


@pytest.fixture(name="flops_per_token", scope="module")
def flops_per_token_fixture(tiny_model_dir: Path) -> float:
    """FLOPs per token of the tiny checkpoint's weight matmuls (``mm`` / ``addmm``: its linear
    layers; attention's batched matmuls are not in the benchmark's rule either), as torch counts
    them on a forward pass of the transformers model: independent of the benchmark's count."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokens = 32
    ids = torch.arange(8, 8 + tokens).unsqueeze(0)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    counts = counter.get_flop_counts()["Global"]
    weight_ops = (torch.ops.aten.mm, torch.ops.aten.addmm)
    return sum(n for op, n in counts.items() if op in weight_ops) / tokens


def _reference_mfu_pct(flops_per_token: float, tokens: int, wall_s: float, peak: float) -> float:
    return 100 * flops_per_token * tokens / wall_s / (peak * 1e9)


def test_mfu_matches_flops_torch_counts(tiny_model_dir: Path, flops_per_token: float) -> None:
    """The benchmark's MFU for a known run equals what torch's FLOP count gives, to within the
    parameters that do no matmul (norm weights: 0.25% of this model's)."""
    _vocab, params = model_numbers(tiny_model_dir)
    ctx = {"params": params, "peak_gflops": 2.0}
    wl = _workload(900, 100)
    # A wall time at which the counted FLOPs make exactly 50% of a 2 GFLOP/s peak.
    wall = flops_per_token * 1000 / (0.5 * 2.0e9)
    got = add_mfu({"wall_s": wall}, wl, ctx)["mfu_pct"]
    assert got == pytest.approx(50.0, abs=0.5)
    # Prompt tokens served from the prefix cache are not computed: 200 of 1000 tokens were.
    cached = add_mfu({"wall_s": wall, "prefix_hit_tokens": 800}, wl, ctx)["mfu_pct"]
    assert cached == pytest.approx(10.0, abs=0.1)


def test_mfu_counts_only_computed_tokens() -> None:
    ctx = {"params": 1_000_000, "peak_gflops": 1.0}
    wl = _workload(900, 100)
    plain = add_mfu({"wall_s": 2.0}, wl, ctx)
    # 2 * 1e6 * 1000 tokens / 2 s = 1 GFLOP/s = 100% of a 1 GFLOP/s peak
    assert plain["mfu_pct"] == pytest.approx(100.0)
    cached = add_mfu({"wall_s": 2.0, "prefix_hit_tokens": 800}, wl, ctx)
    assert cached["mfu_pct"] == pytest.approx(20.0)  # only 100 prompt + 100 output computed
    assert "mfu_pct" not in add_mfu({"ok": False}, wl, ctx)


def test_smollm2_preset_sizes_its_workloads_like_peers_md() -> None:
    preset = PRESETS["smollm2"]
    wl = make_workload("mixed", preset, 49_152, seed=0)
    assert len(wl.prompts) == 48 and wl.max_model_len >= 384 + 160
    assert all(16 <= len(p) <= 384 for p in wl.prompts)
    assert all(16 <= n <= 160 for n in wl.max_tokens)
    assert all(8 <= t < 49_152 for p in wl.prompts for t in p)
    assert pick_workloads(parse_args(["--preset", "smollm2"])) == ["mixed", "uniform"]
    assert pick_workloads(parse_args([])) == ["mixed", "shared-prefix"]


def _stored(model_dir: Path) -> dict[str, int]:
    from safetensors import safe_open

    out = {}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            out |= {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    return out


def test_a_tied_output_head_counts_as_computed_parameters(make_tiny_model: Any) -> None:
    """Qwen2's tiny checkpoint ties its head to the embedding (stored once, computed every
    token: it counts); Llama's has its own head and the input embedding alone is left out."""
    tied, untied = make_tiny_model("qwen2"), make_tiny_model("llama")
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"]
    stored = _stored(tied)
    assert "lm_head.weight" not in stored
    assert model_numbers(tied)[1] == sum(stored.values())
    stored = _stored(untied)
    assert model_numbers(untied)[1] == sum(stored.values()) - stored["model.embed_tokens.weight"]


def test_a_peer_past_its_timeout_fails_alone(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import time; time.sleep(30)"]
    res = run_child(cmd, {}, tmp_path / "never.json", timeout=0.5)
    assert res["ok"] is False and "timed out after" in res["error"]


def test_median_and_ratio() -> None:
    runs: list[dict[str, Any]] = [{"output_tok_s": v} for v in (30.0, 10.0, 20.0)]
    mid = median_result(runs)
    assert mid["output_tok_s"] == 20.0
    assert mid["runs_output_tok_s"] == [30.0, 10.0, 20.0]
    assert median_result([{"output_tok_s": 4.0}, {"output_tok_s": 2.0}])["output_tok_s"] == 2.0
    assert median_result([{"ok": False}]) == {"ok": False}
    assert ratio({"output_tok_s": 30.0}, {"output_tok_s": 10.0}) == 3.0
    assert ratio({"output_tok_s": 30.0}, {"ok": False}) is None


def test_system_choice_is_checked() -> None:
    with pytest.raises(SystemExit, match="unknown systems"):
        pick_systems(parse_args(["--systems", "ours,tgi"]))
    with pytest.raises(SystemExit, match="--vllm-python"):
        pick_systems(parse_args(["--systems", "ours,vllm"]))
    assert "vllm" not in pick_systems(parse_args([]))
    with pytest.raises(SystemExit, match="--vllm-python"):
        pick_systems(parse_args(["--systems", "ours,vllm-bf16"]))
    everything = pick_systems(parse_args(["--vllm-python", "x"]))
    assert "vllm" in everything and not {"ours-bf16w", "vllm-bf16"} & set(everything)


#: Every bfloat16 system in one ``bench.throughput`` run (the three tests below read it): one
#: parent and one child per system, where three runs of their own took 15 children, 10 of them
#: for two rounds of the weights' systems (a third of the suite's time went to ``test_bench``).
#: Pairing runs by round is checked once, in the ``compare_models`` test.
BF16_SYSTEMS = ("ours,ours-bf16w,base-bf16w,ours-bf16,base-bf16,ours-bf16kv,"
                "ours-bf16w-native,ours-bf16w-onednn")  # fmt: skip


@pytest.fixture(name="bf16_smoke", scope="module")
def bf16_smoke_fixture(tiny_model_dir: Path) -> dict[str, Any]:
    """The ``mixed`` body of one smoke run of :data:`BF16_SYSTEMS` (``base-*`` from this same
    checkout as ``--base``); skipped where the CPU has no bfloat16 products (the weights' mode
    is refused there: ``test_model_runner``)."""
    from worker.models.layers import bf16_products_available

    if not bf16_products_available():
        pytest.skip("no bfloat16 products on this CPU")
    return smoke_mixed(tiny_model_dir, BF16_SYSTEMS, "--base", str(REPO))


def test_bfloat16_weights_run_as_a_system_of_their_own(bf16_smoke: dict[str, Any]) -> None:
    """``ours-bf16w`` / ``base-bf16w``: our engine with bfloat16 projection weights (saying so;
    ``base-*`` from ``--base``), ``ours-bf16`` / ``base-bf16`` with a bfloat16 cache too, all
    generating every requested token, the modes' A/B ratios beside the float32 one."""
    body = bf16_smoke
    ours, bf16 = body["systems"]["ours"], body["systems"]["ours-bf16w"]
    assert ours["ok"] and bf16["ok"] and bf16["length_mismatches"] == 0
    base = body["systems"]["base-bf16w"]
    assert base["ok"] and base["length_mismatches"] == 0
    assert (ours["bf16_weights"], bf16["bf16_weights"], base["bf16_weights"]) == (False, True, True)
    want = round(ours["output_tok_s"] / bf16["output_tok_s"], 2)
    assert body["ratios"]["ours/ours-bf16w"] == want
    assert body["ratios"]["ours-bf16w/base-bf16w"] == round(
        bf16["output_tok_s"] / base["output_tok_s"], 2
    )
    mode, base_mode = body["systems"]["ours-bf16"], body["systems"]["base-bf16"]
    assert mode["ok"] and base_mode["ok"] and base_mode["length_mismatches"] == 0
    assert (mode["kv_cache_dtype"], base_mode["kv_cache_dtype"]) == ("bfloat16", "bfloat16")
    assert body["ratios"]["ours-bf16/base-bf16"] == round(
        mode["output_tok_s"] / base_mode["output_tok_s"], 2
    )


def smoke_mixed(model: Path, systems: str, *extra: str) -> dict[str, Any]:
    """``bench.throughput --preset smoke --workload mixed`` of ``systems`` on ``model`` (and
    ``extra`` arguments): the workload's body (systems, ratios) from the JSON line."""
    cmd = [sys.executable, "-m", "bench.throughput", "--preset", "smoke", "--workload", "mixed",
           "--systems", systems, "--model", str(model), *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["workloads"]["mixed"]


def test_the_bfloat16_modes_kernels_run_as_systems_of_their_own(
    bf16_smoke: dict[str, Any],
) -> None:
    """``ours-bf16w-native`` / ``ours-bf16w-onednn``: the mode with its products forced onto
    our C GEMM and onto oneDNN (the A/B an AMX CPU needs), each saying which it ran (the C path
    falls back to oneDNN where it does not build), and their ratio."""
    from kernels import gemm

    lib = gemm.load()
    body = bf16_smoke
    native, onednn = body["systems"]["ours-bf16w-native"], body["systems"]["ours-bf16w-onednn"]
    assert native["ok"] and onednn["ok"] and native["bf16_weights"] and onednn["bf16_weights"]
    assert native["bf16_gemm"] == ("native" if lib is not None and lib.bf16 else "onednn")
    assert onednn["bf16_gemm"] == "onednn"
    want = round(native["output_tok_s"] / onednn["output_tok_s"], 2)
    assert body["ratios"]["ours-bf16w-native/ours-bf16w-onednn"] == want


def test_the_bfloat16_kv_cache_runs_as_systems_of_its_own(bf16_smoke: dict[str, Any]) -> None:
    """``ours-bf16kv`` / ``ours-bf16w`` / ``ours-bf16``: the cache alone, the weights alone and
    both (the whole bfloat16 mode), each saying what it ran, and the cache's A/B ratio."""
    body = bf16_smoke
    kv, weights, both = (body["systems"][s] for s in ("ours-bf16kv", "ours-bf16w", "ours-bf16"))
    assert kv["ok"] and weights["ok"] and both["ok"]
    got = [(s["kv_cache_dtype"], s["bf16_weights"]) for s in (kv, weights, both)]
    assert got == [("bfloat16", False), ("float32", True), ("bfloat16", True)]
    assert kv["num_kv_blocks"] == 2 * weights["num_kv_blocks"]  # same bytes, twice the blocks
    want = round(both["output_tok_s"] / weights["output_tok_s"], 2)
    assert body["ratios"]["ours-bf16/ours-bf16w"] == want


def test_profile_engine_reports_the_bfloat16_mode_by_phase(tiny_model_dir: Path) -> None:
    """``bench.profile_engine --weight-dtype bfloat16 --kv-cache-dtype bfloat16``: the phases'
    shares and the projections' FLOPs by row count, counted from the bfloat16 weights' shapes as
    from float32 ones; the decode rows in the bfloat16 cache's C kernel; the fused layer ops."""
    from worker.models.layers import bf16_products_available

    if not bf16_products_available():
        pytest.skip("no bfloat16 products on this CPU")
    cmd = [sys.executable, "-m", "bench.profile_engine", "--model", str(tiny_model_dir),
           "--requests", "4", "--weight-dtype", "bfloat16",
           "--kv-cache-dtype", "bfloat16"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    body = json.loads(proc.stdout.strip().splitlines()[-1])
    assert body["output_tokens"] > 0 and body["output_tok_s"] > 0
    rows = body["linear_by_rows"]  # (the tiny model's rates round to 0.0 GFLOP/s: not checked)
    assert rows and all(r["s"] >= 0 and r["gflops"] is not None for r in rows)
    assert sum(r["pct_of_linear"] for r in rows) == pytest.approx(100, abs=1)
    import torch

    from kernels import native

    if native.load(torch.bfloat16) is not None:
        assert body["phases"]["attn.native_decode"]["calls"] > 0
    from kernels import fused

    if fused.load() is not None:  # the layers' fused C ops, timed each
        for op in ("fused.silu_mul", "fused.add_rms_norm", "fused.rope_kv"):
            assert body["phases"][op]["calls"] > 0


def test_profile_engine_counts_every_kv_byte_decode_attention_reads(tiny_model_dir: Path) -> None:
    """``decode_attention``: on ``uniform`` (128 prompt + 128 output tokens, random prompts: no
    shared prefix), every output token after the first is one decode row reading its whole
    context, so the kernel's K/V bytes are exactly each layer's sum of those contexts; the rate
    is those bytes over the kernel's seconds, and the fraction that rate over the median of the
    plain reads sampled between steps. Where the CPU has bfloat16 products the greedy rows'
    head screen is a phase of its own (``head.greedy_tokens``)."""
    import torch

    from kernels import native

    if native.load(torch.float32) is None:
        pytest.skip("no native decode kernel here")
    requests, prompt, out = 3, 128, 128
    cmd = [sys.executable, "-m", "bench.profile_engine", "--model", str(tiny_model_dir),
           "--workload", "uniform", "--requests", str(requests)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    body = json.loads(proc.stdout.strip().splitlines()[-1])
    got = body["decode_attention"]
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_key_value_heads"] * head_dim * 4  # K and V, float32
    contexts = sum(range(prompt + 1, prompt + out))  # the decode rows' lengths, new token included
    assert got["kv_bytes"] == requests * cfg["num_hidden_layers"] * contexts * per_token
    assert got["s"] > 0 and got["read_gbps"] > 0
    lo, hi = got["read_gbps_range"]  # ~130 steps: a read sampled every 16th
    assert got["read_samples"] >= 8 and lo <= got["read_gbps"] <= hi
    # the rate is the unrounded bytes over the unrounded seconds ("s" is rounded to the ms, the
    # rates to four significant figures)
    assert got["kv_bytes"] / 1e9 / got["gbps"] == pytest.approx(got["s"], rel=0.01, abs=6e-4)
    assert got["fraction_of_read"] == pytest.approx(got["gbps"] / got["read_gbps"], abs=0.002)
    from kernels import gemm

    lib = gemm.load()
    if lib is not None and lib.bf16:  # greedy rows through the head's bfloat16 screen, timed
        head, steps = body["phases"]["head.greedy_tokens"], body["phases"]["engine.step"]
        assert 0 < head["calls"] <= steps["calls"] and head["s"] <= steps["s"]


def test_decode_table_keeps_four_figures_of_a_slow_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny model on a loaded CI host: 56 MB of K/V in 2.02 s is 0.0278 GB/s, which two decimals
    would have turned into 0.03 (a rate 8% off its bytes and seconds); four figures keep it."""
    from bench import profile_engine as pe

    monkeypatch.setattr(pe, "DECODE", {"bytes": 56_180_736, "s": 2.0215})
    monkeypatch.setattr(pe, "READ_TIMES", [0.004, 0.0045, 0.005])
    got = pe.decode_table()
    assert got["gbps"] == pytest.approx(56_180_736 / 2.0215 / 1e9, rel=5e-4)
    assert got["kv_bytes"] / 1e9 / got["gbps"] == pytest.approx(got["s"], rel=1e-3)
    read = (128 << 20) / 0.0045 / 1e9
    assert got["read_gbps"] == pytest.approx(read, rel=5e-4) and got["read_samples"] == 3
    assert got["read_gbps_range"][0] < got["read_gbps"] < got["read_gbps_range"][1]
    assert got["fraction_of_read"] == pytest.approx(got["gbps"] / read, rel=1e-3)


def test_gemm_benchmarks_take_known_model_shapes_only() -> None:
    """``--models`` of ``bench.gemm_libs`` and ``bench.gemm_ab``: keys of their shape table, in
    order, empty items dropped; an unknown name is refused with the known ones listed."""
    from bench.gemm_libs import model_names

    assert model_names("qwen2-0.5b,,bench") == ("qwen2-0.5b", "bench")
    with pytest.raises(SystemExit, match=r"unknown nope \(known: bench, smollm2, qwen2-0\.5b\)"):
        model_names("bench,nope")


def test_a_gpu_run_leaves_vllm_cpu_out() -> None:
    """``--device cuda``: vLLM-CPU is refused when named and left out of the default set; the
    placement and hf-static's batch sizes parse."""
    with pytest.raises(SystemExit, match="vLLM-CPU"):
        pick_systems(
            parse_args(["--device", "cuda", "--systems", "ours,vllm", "--vllm-python", "x"])
        )
    args = parse_args(["--device", "cuda", "--vllm-python", "x", "--dtype", "bfloat16",
                       "--batch-sizes", "64,256"])  # fmt: skip
    assert "vllm" not in pick_systems(args)
    assert (args.device, args.dtype, args.batch_sizes) == ("cuda", "bfloat16", [64, 256])


def test_vllm_gets_both_cores_and_the_allocator_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    env = vllm_env(2, "/usr/lib/libtcmalloc_minimal.so.4")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["OMP_NUM_THREADS"] == "2"
    assert env["LD_PRELOAD"] == "/usr/lib/libtcmalloc_minimal.so.4:/opt/other.so"
    assert "PYTHONPATH" not in env  # vLLM's venv must not import this checkout
    assert vllm_env(2, None)["LD_PRELOAD"] == "/opt/other.so"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # the presets' budget, in whole GiB (at least 1)
    assert vllm_env(2, None, PRESETS["smoke"].kv_cache_gib)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert vllm_preload("glibc") is None
    monkeypatch.setattr("bench.throughput.find_tcmalloc", lambda: None)
    assert vllm_preload("auto") is None
    with pytest.raises(SystemExit, match="no libtcmalloc"):
        vllm_preload("tcmalloc")


def smoke_pool_blocks(model_dir: Path) -> int:
    """Blocks of 16 tokens in the smoke preset's KV budget for the float32 checkpoint."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    return int(PRESETS["smoke"].kv_cache_gib * (1 << 30)) // (16 * per_token)


def test_quick_run_end_to_end(tiny_model_dir: Path, flops_per_token: float) -> None:
    """Ours and static transformers on every workload, in subprocesses: the smoke preset (the
    quick preset's workloads and checks with fewer requests, to keep the suite short)."""
    cmd = [sys.executable, "-m", "bench.throughput", "--preset", "smoke", "--workload", "all",
           "--systems", "ours,hf-static", "--model", str(tiny_model_dir)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["bench"] == "throughput" and line["peak_gflops"] > 0
    for name in ("mixed", "uniform"):
        body = line["workloads"][name]
        for system in ("ours", "hf-static"):
            res = body["systems"][system]
            assert res["ok"], res  # each peer checks it generated exactly max_tokens per prompt
            assert res["output_tok_s"] > 0
            # MFU from this run's figures and torch's FLOP count (the tiny model's can round
            # to 0.0): within the rounding to 0.1 and the norm weights' 0.25%.
            computed = body["prompt_tokens"] - res.get("prefix_hit_tokens", 0)
            computed += body["output_tokens"]
            ref = _reference_mfu_pct(flops_per_token, computed, res["wall_s"], line["peak_gflops"])
            assert abs(res["mfu_pct"] - ref) <= 0.05 + 0.01 * ref
        ours = body["systems"]["ours"]
        assert ours["length_mismatches"] == 0
        assert ours["num_kv_blocks"] == smoke_pool_blocks(tiny_model_dir)
        assert 0 <= ours["kv_waste_pct"] < 100
        expected = round(ours["output_tok_s"] / body["systems"]["hf-static"]["output_tok_s"], 2)
        assert body["ratios"]["ours/hf-static"] == expected
    shared = line["workloads"]["shared-prefix"]
    on, off = shared["systems"]["ours"], shared["systems"]["ours-prefix-off"]
    assert on["ok"] and off["ok"]
    assert "hf-static" not in shared["systems"]  # no prefix cache: not compared there
    assert shared["ratios"]["prefix_on/off"] == round(on["output_tok_s"] / off["output_tok_s"], 2)
    assert shared["prefix_hit_rate"] > 0.5  # a 1024-token system prompt ahead of short suffixes
    assert off["prefix_hit_tokens"] == 0


def test_base_system_needs_a_checkout() -> None:
    with pytest.raises(SystemExit, match="--base DIR"):
        pick_systems(parse_args(["--systems", "ours,base"]))
    with pytest.raises(SystemExit, match="--base DIR"):
        pick_systems(parse_args(["--systems", "ours,base-bf16w"]))
    assert "base" not in pick_systems(parse_args([]))
    assert "base" in pick_systems(parse_args(["--base", str(REPO)]))


def test_compare_models_runs_an_ab_against_a_base_checkout(tiny_model_dir: Path) -> None:
    """bench.compare_models over one model, ours against this same checkout as 'base' in 2
    alternating rounds: its table carries both systems' figures and the paired ratios computed
    from the runs' own figures."""
    cmd = [sys.executable, "-m", "bench.compare_models", "--models", str(tiny_model_dir),
           "--workloads", "mixed", "--systems", "ours,base", "--base", str(REPO),
           "--repeats", "2", "--real-preset", "smoke"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    (row,) = line["table"]
    assert row["model"] == str(tiny_model_dir) and row["workload"] == "mixed"
    ours, base = row["systems"]["ours"], row["systems"]["base"]
    assert ours["ok"] and base["ok"]
    pairs = zip(ours["runs_output_tok_s"], base["runs_output_tok_s"], strict=True)
    assert row["paired_ratios"]["ours/base"] == [round(a / b, 2) for a, b in pairs]
    assert row["ratios"]["ours/base"] == round(ours["output_tok_s"] / base["output_tok_s"], 2)


def test_gemm_libs_times_every_library_on_checked_products(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench import gemm_libs
    from kernels import gemm
    from worker.models.layers import onednn_bf16_available

    lib = gemm.load()
    onednn_bf16 = onednn_bf16_available()  # (not on an AVX2-only CPU)
    gemm_libs.main(["--models", "bench", "--rows", "8", "--cold-rows", "8", "--layers", "2",
                    "--threads", "1", "--min-seconds", "0.01", "--bf16", "--int8"])  # fmt: skip
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    hot = rec["models"]["bench"]["hot_gflops"]
    assert set(hot) == {"qkv.8", "o.8", "gate_up.8", "down.8"}
    for figures in hot.values():
        assert figures["mkl"] > 0 and figures["onednn_plain"] > 0
        assert ("onednn_bf16" in figures) == onednn_bf16
        assert figures.get("onednn_bf16", 1) > 0  # (checked against F.linear to bf16's precision)
        assert ("native_bf16" in figures) == bool(lib is not None and lib.bf16)
        assert ("native_int8" in figures) == (lib is not None)  # (checked the same way)
        assert figures["best"] in gemm_libs.LIBRARIES
    cold = rec["models"]["bench"]["cold_pass"]["8"]
    assert ("onednn_bf16_ms" in cold) == onednn_bf16 and all(v > 0 for v in cold.values())
    if lib is not None:
        want = round(cold["native_gemm_ms"] / cold["native_int8_ms"], 3)
        assert cold["int8_speedup"] == want


def test_weight_formats_times_each_format_against_float32(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench.weight_formats``: one engine per format, every stream count timed in alternating
    rounds, ratios to float32 from the same rounds, the packed weights' bytes (int8 a little
    over a quarter of float32's: the scales), and each format's agreement with float32's text."""
    from bench import weight_formats
    from kernels import gemm

    if gemm.load() is None:
        pytest.skip("no C GEMM here: no int8 format")
    weight_formats.main(["--model", str(tiny_model_dir), "--formats", "float32,int8",
                         "--streams", "1,3", "--max-tokens", "6", "--rounds", "2",
                         "--threads", "1"])  # fmt: skip
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["bench"] == "weight_formats" and rec["rounds"] == 2
    mb = rec["weight_mb"]
    assert 0.25 * mb["float32"] < mb["int8"] < 0.35 * mb["float32"]
    assert set(rec["streams"]) == {"1", "3"}
    for row in rec["streams"].values():
        f32, int8 = row["float32"], row["int8"]
        assert len(f32["tok_s_rounds"]) == 2 and all(x > 0 for x in f32["tok_s_rounds"])
        # each round's ratio of the same round's rates (printed rounded to 0.1 tok/s, the
        # ratio to 0.001: equal up to those roundings)
        paired = [a / b for a, b in zip(int8["tok_s_rounds"], f32["tok_s_rounds"], strict=True)]
        assert int8["over_float32_rounds"] == pytest.approx(paired, rel=5e-3, abs=1e-3)
        assert 0.0 <= int8["agreement"] <= 1.0 and "agreement" not in f32


def test_engine_ab_pairs_two_configurations_in_one_process(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench.engine_ab``: both engines run each round's workload, the paired ratios are the
    rounds' own, and a setting meant to keep the outputs (the greedy screen) keeps every token."""
    from bench import engine_ab

    engine_ab.main(["--model", str(tiny_model_dir), "--set", "greedy_screen=false",
                    "--preset", "smoke", "--workloads", "uniform", "--rounds", "2",
                    "--threads", "1", "--max-model-len", "512"])  # fmt: skip
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["bench"] == "engine_ab" and rec["set"] == {"greedy_screen": False}
    row = rec["workloads"]["uniform"]
    paired = [a / b for a, b in zip(row["a_tok_s_rounds"], row["b_tok_s_rounds"], strict=True)]
    assert len(paired) == 2 and all(x > 0 for x in paired)
    assert row["a_over_b_rounds"] == pytest.approx(paired, rel=5e-3, abs=1e-3)
    assert row["tokens_identical"] is True


def test_greedy_head_times_the_float32_head_against_its_screens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``bench.greedy_head``: every screen this CPU has (int16 everywhere) against the float32
    head, paired per round, its tokens checked equal to the float32 head's (else it exits)."""
    from bench import greedy_head

    greedy_head.main(["--heads", "3000x128", "--rows", "3,16", "--rounds", "2", "--threads", "1"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["bench"] == "greedy_head" and rec["heads"]["3000x128"]["shape"] == [3000, 128]
    from kernels import native

    assert rec["kernel_flags"] == native.extra_flags()  # PAGEDSERVE_KERNEL_FLAGS, as built
    for rows in ("3", "16"):
        row = rec["heads"]["3000x128"]["by_rows"][rows]
        assert "int16" in row["speedup"] and set(row["ms"]) == {"float32", *row["speedup"]}
        assert all(len(p) == 2 and min(p) > 0 for p in row["paired"].values())
        assert all(0 <= n <= 2 * int(rows) for n in row["rows_left_open"].values())
    with pytest.raises(SystemExit):
        greedy_head.main(["--heads", "3000x127"])


def test_engine_ab_takes_only_engine_config_fields() -> None:
    from bench.engine_ab import parse_sets

    got = parse_sets(["greedy_screen=false", "max_num_seqs=8", "dtype=float32"])
    assert got == {"greedy_screen": False, "max_num_seqs": 8, "dtype": "float32"}
    for bad in (["no_such_field=1"], ["greedy_screen"]):
        with pytest.raises(SystemExit):
            parse_sets(bad)


def test_weight_formats_agreement_counts_up_to_the_first_difference() -> None:
    from bench.weight_formats import agreement

    assert agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]) == 1.0
    assert agreement([[1, 9, 3], [4, 5, 6]], [[1, 2, 3], [7, 5, 6]]) == round(1 / 6, 4)


def test_inductor_mlp_compares_three_ways_on_the_same_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``bench.inductor_mlp``: ours, eager torch and torch.compile on one small layer, all three
    timed and agreeing with eager torch to float32 rounding."""
    from bench import inductor_mlp

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor compiles C++: no g++ / c++ here")
    inductor_mlp.main(["--models", "bench", "--rows", "4", "--layers", "1", "--repeats", "1",
                       "--threads", "1"])  # fmt: skip
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (got,) = rec["results"]
    assert got["rows"] == 4 and got["layers"] == 1
    assert set(got["ms"]) == {"ours", "eager", "inductor"} and min(got["ms"].values()) > 0
    assert set(got["max_abs_diff"]) == {"ours", "inductor"}
    assert max(got["max_abs_diff"].values()) < 1e-4


def test_kernels_inorder_tables_give_each_row_its_own_consecutive_run() -> None:
    """The consecutive layout of ``bench.kernels``: same shape and dtype, row r's blocks are
    r*n .. r*n+n-1 (other blocks of the same pool: as many bytes, in runs)."""
    import torch

    from bench.kernels import inorder_tables

    tables = torch.tensor([[7, 3, 0], [1, 9, 0]], dtype=torch.int32)
    got = inorder_tables(tables, 2)
    assert got.dtype == torch.int32 and got.shape == tables.shape and got.is_contiguous()
    assert got.tolist() == [[0, 1, 0], [2, 3, 0]]


def test_kernels_decode_over_a_bfloat16_cache() -> None:
    """``bench.kernels --kv-bf16``: the decode kernel's bfloat16 build against the float32
    one on the same tables, with its figures consistent with each other."""
    from bench.kernels import HeadShape, bench_decode_bf16_cache

    got = bench_decode_bf16_cache(4, 64, 2, HeadShape.parse("9/3/64"))
    assert (got["heads"], got["batch"], got["ctx"]) == (9, 4, 64)
    assert got["f32_ms"] > 0 and got["bf16_ms"] > 0 and got["bf16_blocks_read_gbps"] > 0
    assert got["speedup"] == pytest.approx(got["f32_ms"] / got["bf16_ms"], rel=0.05, abs=2e-3)


def test_kernels_decode_runs_at_other_head_shapes() -> None:
    """``bench.kernels --shapes``: the decode row at a GQA 3 shape (SmolLM2's), with its
    bandwidth figures; malformed shapes are refused."""
    import argparse

    from bench.kernels import HeadShape, bench_decode

    got = bench_decode(4, 64, 2, HeadShape.parse("9/3/64"))
    assert got.batch == 4 and got.ctx == 64 and got.ms > 0
    assert got.kv_gbps > 0 and got.read_gbps > 0
    assert got.cold_kv_gbps > 0 and got.cold_read_gbps > 0
    assert got.cold_blocks_read_gbps > 0  # the C kernel builds wherever the suite runs
    assert got.cold_inorder_kv_gbps > 0

    def rounded(*gbps: float) -> float:
        """Relative error of a ratio of figures rounded to 2 decimals (small figures on a loaded
        machine: a 0.04 GB/s call is off by up to 12%)."""
        return 0.02 + sum(0.005 / x for x in gbps)

    warm_kv, warm_read = got.kv_gbps, got.read_gbps
    assert got.fraction_of_read == pytest.approx(
        warm_kv / warm_read, rel=rounded(warm_kv, warm_read), abs=2e-3
    )
    kv, read, blocks = got.cold_kv_gbps, got.cold_read_gbps, got.cold_blocks_read_gbps
    assert got.cold_fraction_of_read == pytest.approx(kv / read, rel=rounded(kv, read), abs=2e-3)
    assert got.cold_fraction_of_blocks_read == pytest.approx(
        kv / blocks, rel=rounded(kv, blocks), abs=2e-3
    )
    inorder = got.cold_inorder_kv_gbps
    assert got.inorder_over_scattered == pytest.approx(
        inorder / kv, rel=rounded(inorder, kv), abs=2e-3
    )
    with pytest.raises(argparse.ArgumentTypeError):
        HeadShape.parse("9/4/64")


def test_prefill_ab_times_three_builds_and_checks_their_outputs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``bench.prefill_ab`` against this very tree: every case timed for the three builds
    (ours, base, a control build of base), and all three give bit-identical outputs (the
    kernel's sums do not depend on the build's code placement)."""
    from bench import prefill_ab

    repo = Path(prefill_ab.__file__).resolve().parents[1]
    prefill_ab.main(["--base", str(repo), "--rounds", "1", "--layers", "1", "--threads", "1"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["case"].split()[0] for r in rec["results"]] == ["causal"] * 4 + ["shared"] * 2
    for got in rec["results"]:
        assert set(got["ms"]) == {"ours", "base", "control"} and min(got["ms"].values()) > 0
        assert min(got["gflops"].values()) > 0 and got["ours/base"] > 0
        assert got["bit_identical"] == {"ours": True, "control": True}


def test_decode_ab_times_three_builds_under_traffic_and_checks_their_outputs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``bench.decode_ab`` against this very tree: each shape's K/V rate for the three builds,
    the plain read of the same blocks and each build's fraction of it, and bit-identical
    outputs (the same source, built twice, gives the same sums)."""
    from bench import decode_ab

    repo = Path(decode_ab.__file__).resolve().parents[1]
    decode_ab.main([
        "--base", str(repo), "--rounds", "1", "--layers", "2", "--between-mb", "1",
        "--rows", "3", "--ctx", "40", "--threads", "1",
    ])  # fmt: skip
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["case"] for r in rec["results"]] == [
        "14/2/64 heads, 3 x 40",
        "9/3/64 heads, 3 x 40",
        "8/4/64 heads, 3 x 40",
    ]
    for got in rec["results"]:
        assert set(got["kv_gbps"]) == {"ours", "base", "control"}
        assert min(got["kv_gbps"].values()) > 0 and got["blocks_read_gbps"] > 0
        assert got["fraction_of_blocks_read"]["ours"] == pytest.approx(
            got["kv_gbps"]["ours"] / got["blocks_read_gbps"], abs=2e-3
        )
        assert got["bit_identical"] == {"ours": True, "control": True}


@pytest.mark.parametrize(
    "mode", [(), ("--bf16",), ("--bf16", "--no-amx"), ("--swiglu",), ("--int8",)], ids=str
)
def test_gemm_ab_times_three_builds_and_checks_their_outputs(
    mode: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench.gemm_ab`` against this very tree: every hot and cold case timed for the three
    builds (ours, base, a control build of base), all three bit-identical (each output's sum is
    in a fixed order, whatever the code's placement); float32 panels, and bfloat16 ones where
    the build has them (on an AMX CPU its tiles, and with ``--no-amx`` ``vdpbf16ps``), and with
    ``--swiglu`` the gate/up products as SwiGLU products; ``--int8`` int8 panels."""
    from bench import gemm_ab
    from kernels import gemm

    lib = gemm.load()
    bf16 = "--bf16" in mode
    if lib is None or (bf16 and not lib.bf16):
        pytest.skip("no C GEMM here" if lib is None else "no AVX512-BF16 here")
    repo = Path(gemm_ab.__file__).resolve().parents[1]
    args = ["--base", str(repo), "--rounds", "1", "--layers", "1", "--threads", "1"]
    gemm_ab.main([*args, "--rows", "40", "--cold-rows", "5", *mode])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["case"].split()[0] for r in rec["results"]] == ["hot"] * 6 + ["cold"]
    assert rec["bf16"] is bf16 and rec["amx"] is (mode == ("--bf16",) and lib.amx)
    assert rec["swiglu"] is ("--swiglu" in mode) and rec["int8"] is ("--int8" in mode)
    for got in rec["results"]:
        assert set(got["ms"]) == {"ours", "base", "control"} and min(got["ms"].values()) > 0
        assert min(got["gflops"].values()) > 0 and got["ours/base"] > 0
        assert got["bit_identical"] == {"ours": True, "control": True}


def test_gemm_ab_swiglu_runs_a_tree_without_the_glu_product_as_two_passes() -> None:
    """A base tree whose binding has no ``pack_glu`` runs its gate/up product and then the fused
    SwiGLU pass, as its engine did: the same bits as this tree's SwiGLU product."""
    import torch

    from bench.gemm_ab import Product
    from kernels import fused, gemm

    lib = gemm.load()
    if lib is None or fused.load() is None:
        pytest.skip("no C GEMM or fused ops here")
    gen = torch.Generator().manual_seed(8)
    w, x = torch.randn(2 * 72, 64, generator=gen), torch.randn(9, 64, generator=gen)
    two_pass = Product(lib.pack(w), silu_after=True)({64: x})
    assert two_pass.shape == (9, 72)
    assert torch.equal(two_pass, Product(lib.pack_glu(w))({64: x}))


def test_service_bench_warms_every_system_then_times_rounds(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench.service``: a real worker on its own redis-server against the offline engine, an
    untimed warm-up through both first (on a GPU the first shapes' Triton compiles took a
    whole round), then timed rounds that each generated every requested token."""
    from bench import service

    args = ["--model", str(tiny_model_dir), "--requests", "6", "--rounds", "1"]
    service.main([*args, "--warmup-requests", "3", "--submit-jobs", "50", "--ttft-repeats", "1"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["requests"] == 6 and rec["rounds"] == 1
    assert rec["offline_tok_s"] > 0 and rec["service_tok_s"] > 0
    assert rec["service_over_offline"] == round(rec["service_tok_s"] / rec["offline_tok_s"], 3)
    # the worker's loop clock, read from its heartbeats around the round
    (engine,) = rec["service_loop_engine_s_rounds"]
    (own,) = rec["service_loop_service_s_rounds"]
    (wall,) = rec["service_wall_s_rounds"]
    assert 0 < engine < wall and 0 <= own < wall
    (offline,) = rec["offline_wall_s_rounds"]
    assert rec["service_engine_over_offline_wall"] == pytest.approx(engine / offline, rel=0.02)
    (cpu,) = rec["service_loop_engine_cpu_s_rounds"]  # the stepping thread's CPU in those steps
    assert 0 < cpu <= engine + 0.01
    # (from the unrounded seconds: the rounds' figures above are rounded to 1 ms)
    assert rec["service_engine_off_cpu_share"] == pytest.approx(1 - cpu / engine, abs=0.015)
    (thread,) = rec["service_engine_thread_cpu_s_rounds"]  # the worker's main thread, in-process
    assert cpu - 0.02 <= thread <= wall + 0.02
    cpus = sorted(os.sched_getaffinity(0))
    assert rec["pinned_cpus"] == (cpus if len(cpus) > 1 else [])
    assert 0 < rec["service_pss_mb"] <= rec["service_rss_mb"]  # the worker's, after the round


def test_service_bench_fresh_runs_every_round_in_new_processes(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench.service --fresh``: each round restarts the workers (a new process, warmed up
    again; its loop clock and step count start over) and runs the offline engine in a spawned
    child, so a process's own speed is drawn anew each round instead of once a run."""
    from bench import service

    args = ["--model", str(tiny_model_dir), "--requests", "6", "--rounds", "2", "--fresh"]
    service.main([*args, "--warmup-requests", "3", "--submit-jobs", "50", "--ttft-repeats", "1"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["fresh_processes"] is True
    for system in ("offline", "service"):
        assert len(rec[f"{system}_tok_s_rounds"]) == 2 and min(rec[f"{system}_tok_s_rounds"]) > 0
        assert min(rec[f"{system}_steps_rounds"]) > 0  # each round's own steps, not a total
    assert min(rec["offline_cpu_s_rounds"]) > 0  # measured in the child


_SPAWNS_A_CHILD = """
import multiprocessing, sys, time
if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    child.start()
    print(child.pid, flush=True)
    time.sleep(60)
"""


def _wait_for_exec(pid: int, timeout_s: float = 30.0) -> None:
    """Until ``pid`` runs multiprocessing's spawn entry point: ``Process.start()`` returns right
    after the fork, and until the exec the child's command line is still its parent's (a
    loaded 2-core host once read it in that window). A worker's engine process has long been
    running by the time ``bench.service`` looks for it."""
    deadline = time.monotonic() + timeout_s
    while b"spawn_main" not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, f"process {pid} never exec'd spawn_main"
        time.sleep(0.01)


def test_service_bench_finds_and_pins_the_engine_processes_thread(tmp_path: Path) -> None:
    """``bench.service`` pins each system's stepping thread for a round: a worker's own main
    thread, or under ``--engine-process`` its spawned child's (not the resource tracker); a
    worker's memory counts its children's."""
    from bench import service

    script = tmp_path / "spawns.py"
    script.write_text(_SPAWNS_A_CHILD)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        _wait_for_exec(child)
        assert service.engine_thread(parent.pid) == child
        assert service.engine_thread(child) == child  # no spawned child: its own main thread
        assert {parent.pid, child} <= set(service.descendants(parent.pid))
        both, alone = service.tree_memory_mb(parent.pid), service.tree_memory_mb(child)
        assert both["rss"] > alone["rss"] > 0 and both["pss"] > alone["pss"] > 0
        cpu, before = max(os.sched_getaffinity(0)), os.sched_getaffinity(child)
        with service.pinned(child, cpu):
            assert os.sched_getaffinity(child) == {cpu}
        assert os.sched_getaffinity(child) == before
    finally:
        parent.kill()
        parent.wait()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_redis_cost_counts_what_a_real_worker_asks_of_redis(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench.redis_cost``: a real worker on its own redis-server runs the jobs; the server's
    own counters (commands, bytes, CPU) before and after give the cost per job and per token.
    (It had stopped starting its worker when ``bench.service`` grew ``--device``/``--dtype``.)"""
    from bench import redis_cost

    redis_cost.main(["--model", str(tiny_model_dir), "--requests", "4", "--priority",
                     "interactive", "--progress-intervals-ms", "200,default"])  # fmt: skip
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run, default = rec["runs"]
    assert rec["requests"] == 4 and run["progress_interval_ms"] == 200.0
    assert default["progress_interval_ms"] == "default" and default["priority"] == "interactive"
    assert default["commands_per_job"] > 0
    # every job was enqueued (at least its stream entry and its hash) and then served
    assert run["enqueue_commands_per_job"] >= 2 and run["commands_per_job"] > 0
    assert run["steps"] > 0 and run["output_tok_s"] > 0
    assert sum(run["top_commands"].values()) <= run["commands_per_job"] * 4 + 1e-6
    assert run["redis_cpu_us_per_token"] > 0 and run["workers_to_saturate"] > 0


def test_online_bench_streams_through_worker_and_api(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench.online``: streaming chat clients through a real worker and the API against the
    offline engine on the same requests. (It had stopped starting, like ``bench.redis_cost``
    before it, when ``bench.service`` grew ``--device``/``--dtype``.)"""
    from bench import online

    online.main(["--model", str(tiny_model_dir), "--clients", "2", "--requests", "4",
                 "--rounds", "1"])  # fmt: skip
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["bench"] == "online" and rec["clients"] == 2 and rec["requests"] == 4
    assert rec["output_tokens"] > 0 and rec["online_tok_s"] > 0 and rec["offline_tok_s"] > 0
    assert len(rec["paired_ratios"]) == 1 and rec["online_over_offline"] > 0
    assert rec["ttft_ms_p50"] > 0 and rec["ttft_ms_p99"] >= rec["ttft_ms_p50"]


def test_kv_layout_bench_counts_layouts_times_them_and_reuses_chats(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench.kv_layout`` on the tiny checkpoint: adjacency per wave (shares of every pair),
    the decode kernel over the engine's, consecutive and random layouts of the same rows, and
    the chats' prefix hits (the second turn extends the first turn's prompts: hits)."""
    from bench import kv_layout

    args = ["--model", str(tiny_model_dir), "--waves", "2", "--requests", "12", "--pool-mib", "8"]
    kv_layout.main([*args, "--shapes", "9/3/64", "--chats", "4", "--turns", "2", "--repeats", "1"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["bench"] == "kv_layout" and rec["pool_blocks"] > 0
    assert len(rec["waves"]) == 2
    for wave in rec["waves"]:
        assert wave["pairs"] > 0
        parts = wave["adjacent"] + wave["descending"] + wave["scattered"]
        assert parts == pytest.approx(1.0, abs=2e-3)
    (dec,) = rec["decode"]
    assert dec["shape"] == "9/3/64" and dec["rows"] > 0
    assert set(dec["gbps"]) == {"engine", "in_order", "random", "read"}
    assert min(dec["gbps"].values()) > 0
    first, second = rec["chat_hit_rate"]
    assert first == 0.0 and 0 < second <= 1


def test_kv_layout_counts_adjacency_and_builds_same_length_layouts() -> None:
    from bench.kv_layout import adjacency, layouts

    got = adjacency([[4, 5, 6, 2, 1], [9]])
    assert got == {"adjacent": 2, "descending": 1, "scattered": 1}
    sets = layouts([([7, 3], 20), ([5], 0), ([8, 1, 2], 40)], num_blocks=16)
    assert [n for _, n in sets["in_order"]] == [20, 40] == [n for _, n in sets["random"]]
    assert sets["in_order"][0][0] == [0, 1] and sets["in_order"][1][0] == [2, 3, 4]
    picked = [b for t, _ in sets["random"] for b in t]
    assert len(picked) == 5 == len(set(picked)) and all(0 <= b < 16 for b in picked)


def test_kv_replay_compares_allocator_policies_on_the_bare_scheduler(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``bench.kv_replay``: both policies per pool size over the same seeds. In a pool with room
    for every wave (12 requests of at most 48 blocks), windows keep the running tables in
    consecutive blocks; a new table at the queue's front breaks some of them. The chats' second
    turn extends the first's prompts: the prefix cache serves part of it under either policy."""
    from bench import kv_replay

    kv_replay.main(["--blocks", "1024", "--seeds", "2", "--waves", "2", "--requests", "12",
                    "--chats", "6", "--turns", "2"])  # fmt: skip
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["bench"] == "kv_replay" and rec["seeds"] == 2
    got = {r["policy"]: r for r in rec["results"]}
    assert set(got) == {"windows", "front"} and all(r["blocks"] == 1024 for r in got.values())
    assert min(got["windows"]["adjacent_by_wave"]) >= 0.99
    assert got["windows"]["adjacent_by_wave"][-1] > got["front"]["adjacent_by_wave"][-1]
    for r in got.values():
        assert len(r["last_wave_adjacent_by_seed"]) == 2 == len(r["last_turn_hits_by_seed"])
        first, second = r["chat_hit_rate_by_turn"]
        assert first == 0.0 and 0 < second <= 1
        assert r["preemptions"] == 0


def test_kv_replay_rejects_an_unknown_policy() -> None:
    from bench import kv_replay

    with pytest.raises(SystemExit):
        kv_replay.parse_args(["--policies", "windows,best"])
