"""Our engine: ``worker.LLM(...).generate(prompts, params)``, timed around the whole call.

KV waste is sampled from ``engine.scheduler.occupancy()`` every few engine steps by wrapping
``engine.step``; the sampling time is measured and subtracted from the wall time.

    python -m bench.peers.ours JOB_JSON RESULT_JSON
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from bench.peers.job import Job, base_result, main_args, set_threads, write_result

GIB = 1 << 30


@dataclass(slots=True)
class WasteSampler:
    """Counts steps; every ``every`` steps records fragmentation_slots / allocated slots."""

    engine: Any
    every: int = 4
    steps: int = 0
    seconds: float = 0.0
    frag_slots: int = 0
    alloc_slots: int = 0
    samples: list[float] = field(default_factory=list)
    peak_blocks: int = 0

    def wrap(self) -> None:
        inner = self.engine.step

        def step() -> Any:
            outs = inner()
            self.steps += 1
            if self.steps % self.every == 0:
                self.sample()
            return outs

        self.engine.step = step

    def sample(self) -> None:
        t0 = time.perf_counter()
        sched = self.engine.scheduler
        occ = sched.occupancy()
        slots = occ.in_use * sched.block_size
        if slots:
            self.frag_slots += occ.fragmentation_slots
            self.alloc_slots += slots
            self.samples.append(occ.fragmentation_slots / slots)
            self.peak_blocks = max(self.peak_blocks, occ.in_use)
        self.seconds += time.perf_counter() - t0

    def summary(self) -> dict[str, Any]:
        n = len(self.samples)
        return {
            "kv_waste_pct": round(100 * self.frag_slots / self.alloc_slots, 2) if n else None,
            "kv_waste_mean_pct": round(100 * sum(self.samples) / n, 2) if n else None,
            "kv_samples": n,
            "kv_peak_blocks": self.peak_blocks,
            "sampling_s": round(self.seconds, 4),
        }


def build_llm(job: Job) -> Any:
    from kernels import native
    from worker.llm import LLM

    opts = job.options
    if opts.get("bf16_gemm"):  # ours-bf16w-native / -onednn: the mode's products forced
        os.environ[native.BF16_GEMM_ENV] = opts["bf16_gemm"]
    return LLM(
        job.model,
        dtype=opts.get("dtype", "float32"),
        weight_dtype=opts.get("weight_dtype", "auto"),
        kv_cache_dtype=opts.get("kv_cache_dtype", "auto"),
        device=opts.get("device", "cpu"),
        max_model_len=opts.get("max_model_len", 2048),
        kv_cache_memory=int(opts.get("kv_cache_gib", 2) * GIB),
        max_num_seqs=opts.get("max_num_seqs", 256),
        max_num_batched_tokens=opts.get("max_num_batched_tokens", 2048),
        enable_prefix_caching=opts.get("enable_prefix_caching", True),
    )


def prefix_counters(llm: Any) -> tuple[int, int]:
    ps = llm.engine.scheduler.prefix_cache_stats()
    return ps.queried_tokens, ps.hit_tokens


def run(job: Job) -> dict[str, Any]:
    from pagedserve.params import SamplingParams

    set_threads(job.threads)
    llm = build_llm(job)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([job.warmup_prompt], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in job.max_tokens]
    sampler = WasteSampler(llm.engine, every=job.options.get("sample_every", 4))
    sampler.wrap()
    q0, h0 = prefix_counters(llm)
    outs, wall = _timed_generate(llm, job, params)
    q1, h1 = prefix_counters(llm)
    wrong = [
        i
        for i, (o, n) in enumerate(zip(outs, job.max_tokens, strict=True))
        if o.error or len(o.outputs[0].token_ids) != n
    ]
    wall -= sampler.seconds
    result = base_result(job, "ours", wall)
    result.update(sampler.summary())
    result["engine_steps"] = sampler.steps
    result["preemptions"] = llm.engine.scheduler.stats.num_preemptions
    result["prefix_caching"] = job.options.get("enable_prefix_caching", True)
    result["prefix_hit_rate"] = round((h1 - h0) / (q1 - q0), 4) if q1 > q0 else 0.0
    result["prefix_hit_tokens"] = h1 - h0
    result["num_kv_blocks"] = llm.engine.runner.layout.num_blocks
    result["bf16_weights"] = _bf16_weights(llm)
    result["bf16_gemm"] = _bf16_gemm(llm)
    result["kv_cache_dtype"] = llm.engine.runner.kv_dtype_name
    result["length_mismatches"] = len(wrong)
    result["ok"] = not wrong
    return result


def _bf16_weights(llm: Any) -> bool:
    """Whether the engine runs its projections with bfloat16 weights (``ours-bf16w``)."""
    from worker.models.layers import Bf16Weight

    return isinstance(llm.engine.runner.model.lm_head_weight, Bf16Weight)


def _bf16_gemm(llm: Any) -> str | None:
    """Which kernel multiplies the bfloat16 weights (``native`` or ``onednn``); None in float32."""
    if not _bf16_weights(llm):
        return None
    return "native" if llm.engine.runner.model.lm_head_weight.panels is not None else "onednn"


def _timed_generate(llm: Any, job: Job, params: list[Any]) -> tuple[list[Any], float]:
    prompts = [{"prompt_token_ids": p} for p in job.prompts]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def main() -> None:
    job, out = main_args()
    write_result(out, run(job))


if __name__ == "__main__":
    main()
