"""Where our engine's time goes on one of bench.throughput's workloads (``mixed`` by default,
``--workload uniform|shared-prefix``), on the bench model or ``--model`` (no engine changes).

Pass 1 wraps engine, scheduler, runner, attention backend (and its C decode kernel), sampler,
detokenizer and the projections (``worker.models.layers.linear``) with perf_counter accumulators
(a few microseconds per call) and reports each phase's share of wall time, and the projections'
GFLOP/s by row count (``linear_by_rows``: rows rounded up to a power of two; decode steps are the
tens of rows, prefill the thousands). ``decode_attention``: the K/V bytes the C decode kernel read
over the run (each row's tokens from its first block on, K and V), its seconds, its GB/s and that
over a plain read of a 128 MiB buffer sampled every 16 steps during the run (the median; a shared
host's read rate moved 32-61 GB/s between runs minutes apart, so a read measured once before or
after compares unlike phases): issue #17's "decode attention at 0.8 of the read", on the engine's
own tables and batches. The samples' time is left out of ``wall_s`` and every phase. Pass 2
(``--torch-profiler``) runs a smaller slice under torch.profiler and lists the top aten ops by
self CPU time. Prints one JSON line.

    python -m bench.profile_engine [--model DIR] [--workload mixed] [--requests 48]
        [--weight-dtype auto|bfloat16|int8] [--kv-cache-dtype auto|bfloat16] [--torch-profiler]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import emit, sig
from bench.throughput import (
    ensure_model,
    make_mixed,
    make_shared_prefix,
    make_uniform,
    model_numbers,
    params_of,
)

TOTALS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
#: Projection seconds and FLOPs by row bucket (rows rounded up to a power of two).
LINEAR_S: dict[int, float] = defaultdict(float)
LINEAR_FLOPS: dict[int, float] = defaultdict(float)
#: The C decode kernel's K/V bytes read and seconds (``record_decode``).
DECODE: dict[str, float] = defaultdict(float)  # "bytes" (an integer count), "s"
#: Seconds of each plain read of ``READ_BYTES`` sampled between steps (left out of the wall).
READ_TIMES: list[float] = []
READ_BYTES, READ_EVERY = 128 << 20, 16


def timer(
    name: str, fn: Callable[..., Any], record: Callable[..., None] | None = None
) -> Callable[..., Any]:
    """``fn`` with its seconds and calls added to ``name``; ``record(seconds, *args)`` too."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            TOTALS[name] += dt
            CALLS[name] += 1
            if record is not None:
                record(dt, *args)

    return wrapped


def patch(owner: Any, attr: str, name: str) -> None:
    setattr(owner, attr, timer(name, getattr(owner, attr)))


def record_linear(dt: float, x: Any, weight: Any, *_: Any) -> None:
    """Bins a projection by row count: decode steps multiply tens of rows by every weight,
    prefill thousands, and the two run at very different GFLOP/s."""
    rows = x.numel() // x.shape[-1]
    bucket = 1 << max(0, rows - 1).bit_length()
    LINEAR_S[bucket] += dt
    LINEAR_FLOPS[bucket] += 2.0 * rows * x.shape[-1] * weight.shape[0]


def record_decode(dt: float, _kernel: Any, _query: Any, k_cache: Any, _v: Any, _tables: Any,
                  rows: Any, _scale: float, window: int | None, *_: Any) -> None:  # fmt: skip
    """The K/V bytes one call of ``NativeDecode.decode`` reads: every row's tokens from its
    first block on (the blocks before are a shared prefix the cascade read), at most ``window``
    of them, each token's K and V of every KV head (cache ``[blocks, block_size, kv_heads, D]``)."""
    tokens = rows.seq_lens - rows.first_block * k_cache.shape[1]
    if window:
        tokens = tokens.clamp(max=window)
    per_token = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    DECODE["bytes"] += int(tokens.sum()) * per_token
    DECODE["s"] += dt


def sampling_reads(step: Callable[..., Any]) -> Callable[..., Any]:
    """``Engine.step`` preceded, every ``READ_EVERY`` calls, by one timed sum over a buffer
    larger than the L3 (cold: the steps between read the weights and K/V)."""
    import torch

    buf = torch.ones(READ_BYTES // 4)
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] % READ_EVERY == 1:
            t0 = time.perf_counter()
            buf.sum()
            READ_TIMES.append(time.perf_counter() - t0)
        return step(*args, **kwargs)

    return wrapped


def decode_table() -> dict[str, Any]:
    """The decode kernel's read rate beside the plain reads sampled during the run."""
    if not DECODE["s"] or not READ_TIMES:
        return {}
    gbps = DECODE["bytes"] / DECODE["s"] / 1e9
    reads = [READ_BYTES / t / 1e9 for t in READ_TIMES]
    read = statistics.median(reads)
    return {
        "kv_bytes": int(DECODE["bytes"]),
        "s": round(DECODE["s"], 3),
        "gbps": sig(gbps),
        "read_gbps": sig(read),
        "read_samples": len(reads),
        "read_gbps_range": [sig(min(reads)), sig(max(reads))],
        "fraction_of_read": sig(gbps / read),
    }


def linear_table() -> list[dict[str, Any]]:
    total = sum(LINEAR_S.values()) or 1.0
    return [
        {
            "rows_le": b,
            "s": round(LINEAR_S[b], 3),
            "pct_of_linear": round(100 * LINEAR_S[b] / total, 1),
            "gflops": round(LINEAR_FLOPS[b] / LINEAR_S[b] / 1e9, 1) if LINEAR_S[b] else None,
        }
        for b in sorted(LINEAR_S)
    ]


def install_timers() -> None:
    """Class-level wrappers: every instance created afterwards is timed."""
    import torch.nn.functional as F

    from kernels import torch_backend
    from kernels.fused import FusedOps
    from kernels.native import NativeDecode
    from kernels.torch_backend import TorchBackend
    from scheduler.scheduler import Scheduler
    from worker.detokenizer import IncrementalDetokenizer
    from worker.engine import Engine
    from worker.model_runner import ModelRunner
    from worker.models import decoder, layers
    from worker.sampler import Sampler

    patch(Engine, "step", "engine.step")
    Engine.step = sampling_reads(Engine.step)
    patch(Scheduler, "schedule", "scheduler.schedule")
    patch(Scheduler, "postprocess", "scheduler.postprocess")
    patch(ModelRunner, "execute", "runner.execute")
    patch(ModelRunner, "_update_tables", "runner.update_tables")
    patch(TorchBackend, "paged_attention", "attn.paged_attention")
    patch(TorchBackend, "write_kv", "attn.write_kv")
    patch(torch_backend, "decode_chunk", "attn.decode_chunk")
    patch(torch_backend, "prefill_chunk", "attn.prefill")
    patch(torch_backend, "shared_prefixes", "attn.shared_prefixes")
    patch(TorchBackend, "_get_plan", "attn.plan")
    patch(TorchBackend, "_get_decode_chunks", "attn.decode_chunks_plan")
    patch(Sampler, "sample", "sampler.sample")
    patch(Engine, "_sample", "engine.sample_total")
    patch(Engine, "_on_token", "engine.on_token")
    patch(Engine, "_output", "engine.output")
    patch(IncrementalDetokenizer, "add", "detok.add")
    # greedy rows' tokens through the bfloat16 screen of the output head (inside
    # runner.execute; rows it leaves open go through ``linear`` as well)
    patch(decoder.CausalLM, "greedy_tokens", "head.greedy_tokens")
    NativeDecode.decode = timer("attn.native_decode", NativeDecode.decode, record_decode)
    # the tiled kernel: causal prefill chunks, and the cascade's shared prefixes where the
    # policy runs them in C (native_prefill counts both calls)
    patch(NativeDecode, "prefill", "attn.native_prefill")
    patch(torch_backend, "native_shared_prefixes", "attn.native_shared_prefixes")
    # projections go through worker.models.layers.linear (oneDNN on CPUs), not F.linear
    layers.linear = timer("linear", layers.linear, record_linear)
    decoder.linear = timer("linear", decoder.linear, record_linear)
    patch(F, "linear", "F.linear")
    # the fused C layer ops (kernels/fused.py): what the layers do besides products and attention
    patch(FusedOps, "silu_mul", "fused.silu_mul")
    patch(FusedOps, "add_rms_norm", "fused.add_rms_norm")
    patch(FusedOps, "rope_kv", "fused.rope_kv")


#: ``--workload``: the builders of bench.throughput's workloads (same prompts, seed 0).
WORKLOADS = {"mixed": make_mixed, "uniform": make_uniform, "shared-prefix": make_shared_prefix}


def run_workload(
    model: Path,
    workload: str,
    requests: int,
    vocab: int,
    weight_dtype: str = "auto",
    kv_cache_dtype: str = "auto",
) -> tuple[float, int, int]:
    from pagedserve.params import SamplingParams
    from worker.llm import LLM

    wl = WORKLOADS[workload](requests, vocab, 0)
    llm = LLM(model, dtype="float32", max_model_len=wl.max_model_len, kv_cache_memory=2 << 30,
              weight_dtype=weight_dtype, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    llm.generate([[10, 11, 12, 13]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for acc in (TOTALS, CALLS, LINEAR_S, LINEAR_FLOPS, DECODE):
        acc.clear()
    READ_TIMES.clear()
    params = params_of(wl)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False)
    return time.perf_counter() - t0 - sum(READ_TIMES), wl.prompt_tokens, wl.output_tokens


def phase_table(wall: float) -> dict[str, Any]:
    table = {
        name: {"s": round(s, 3), "pct": round(100 * s / wall, 1), "calls": CALLS[name]}
        for name, s in sorted(TOTALS.items(), key=lambda kv: -kv[1])
    }
    step = TOTALS["engine.step"]
    known = TOTALS["scheduler.schedule"] + TOTALS["runner.execute"]
    known += TOTALS["engine.sample_total"] + TOTALS["scheduler.postprocess"]
    known += TOTALS["engine.on_token"] + TOTALS["engine.output"]
    model_other = TOTALS["runner.execute"] - TOTALS["linear"] - TOTALS["attn.paged_attention"]
    model_other -= TOTALS["attn.write_kv"]
    derived = {
        "outside_step_pct": round(100 * (wall - step) / wall, 1),
        "step_unattributed_pct": round(100 * (step - known) / wall, 1),
        "runner_non_linear_non_attn_pct": round(100 * model_other / wall, 1),
    }
    return {"phases": table, "derived": derived}


def torch_ops(
    model: Path, workload: str, requests: int, vocab: int, top: int = 15
) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_workload(model, workload, requests, vocab)
    rows = []
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) or 1
    for e in events[:top]:
        rows.append(
            {
                "op": e.key,
                "self_ms": round(e.self_cpu_time_total / 1000, 1),
                "pct": round(100 * e.self_cpu_time_total / total, 1),
                "calls": e.count,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch-profiler", action="store_true")
    ap.add_argument("--weight-dtype", default="auto", help="auto | bfloat16 | int8 (speed modes)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16 (half the cache)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="profile-") as tmp:
        model = ensure_model(args.model, Path(tmp))
        vocab, _ = model_numbers(model)
        quarter = max(8, args.requests // 4)
        ops = torch_ops(model, args.workload, quarter, vocab) if args.torch_profiler else []
        install_timers()
        wall, ptok, otok = run_workload(model, args.workload, args.requests, vocab,
                                        args.weight_dtype, args.kv_cache_dtype)  # fmt: skip
    figures = {
        "workload": args.workload,
        "requests": args.requests,
        "prompt_tokens": ptok,
        "output_tokens": otok,
        "wall_s": round(wall, 2),
        "output_tok_s": round(otok / wall, 1),
        **phase_table(wall),
        "linear_by_rows": linear_table(),
        "decode_attention": decode_table(),
        "torch_top_ops": ops,
        "note": "2 shared CPU cores: noisy; timers add a few us per call",
    }
    emit("profile_engine", figures)


if __name__ == "__main__":
    main()
