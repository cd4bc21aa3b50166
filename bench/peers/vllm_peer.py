"""vLLM-CPU peer: standalone (stdlib + vLLM), run by the interpreter given as --vllm-python.

The parent sets VLLM_CPU_OMP_THREADS_BIND (both cores: vLLM otherwise keeps one for its scheduler)
and VLLM_CPU_KVCACHE_SPACE=2 before starting it. ``LLM(...)`` must run under ``__main__`` because
vLLM starts worker processes.

    /opt/vllm-venv/bin/python bench/peers/vllm_peer.py JOB_JSON RESULT_JSON
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    opts = job.get("options", {})
    llm = LLM(
        model=job["model"],
        dtype=opts.get("vllm_dtype", "float32"),  # bfloat16: bench.throughput's vllm-bf16
        max_model_len=opts.get("max_model_len", 1024),
        enforce_eager=True,
        seed=0,
        # its default on x86 CPUs already; explicit, so that shared-prefix compares caches
        enable_prefix_caching=opts.get("enable_prefix_caching", True),
    )
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": job["warmup_prompt"]}], warm, use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in job["max_tokens"]
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    wrong = sum(
        len(o.outputs[0].token_ids) != n for o, n in zip(outs, job["max_tokens"], strict=True)
    )
    out_tokens = sum(job["max_tokens"])
    prompt_tokens = sum(len(p) for p in job["prompts"])
    cached = sum(o.num_cached_tokens or 0 for o in outs)  # prompt tokens its prefix cache served
    return {
        "system": "vllm",
        "wall_s": round(wall, 3),
        "prompt_tokens": prompt_tokens,
        "prefix_hit_tokens": cached,
        "prefix_hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else 0.0,
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / wall, 1),
        "length_mismatches": wrong,
        "ok": wrong == 0,
    }


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} JOB_JSON RESULT_JSON")
    job = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(job)))


if __name__ == "__main__":
    main()
