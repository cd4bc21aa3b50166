"""transformers continuous batching through the manager API (per-request ``max_new_tokens``).

EOS is ignored with ``eos_token_id=-1``; the cache is sized explicitly
(``ContinuousBatchingConfig(num_blocks, page_size=64, max_batch_tokens=512)``) and at most 32
requests share a batch, the settings PEERS.md found best for it on this machine.

    python -m bench.peers.hf_cb JOB_JSON RESULT_JSON
"""

from __future__ import annotations

import time
from typing import Any

from bench.peers.hf_static import load_model
from bench.peers.job import Job, base_result, main_args, set_threads, write_result


def cb_config(job: Job) -> Any:
    from transformers import ContinuousBatchingConfig

    opts = job.options
    return ContinuousBatchingConfig(
        num_blocks=opts.get("num_blocks", 512),
        page_size=opts.get("page_size", 64),
        max_batch_tokens=opts.get("max_batch_tokens", 512),
        max_requests_per_batch=opts.get("max_requests_per_batch", 32),
        use_cuda_graph=False,
        use_async_batching=False,
    )


def gen_config(model: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=model.generation_config.pad_token_id or 0,
        max_new_tokens=16,
    )


def drain(
    manager: Any, prompts: list[list[int]], outs: list[int], tag: str = "r"
) -> dict[str, int]:
    """Submit every request and wait for all of them; returns generated counts by request id."""
    ids = [
        manager.add_request(p, request_id=f"{tag}{i}", max_new_tokens=n, eos_token_id=-1)
        for i, (p, n) in enumerate(zip(prompts, outs, strict=True))
    ]
    done: dict[str, int] = {}
    while len(done) < len(ids):
        res = manager.get_result(timeout=1.0)
        if res is None:
            if not manager.is_running():
                raise RuntimeError("continuous batching loop stopped early")
            continue
        if res.error:
            raise RuntimeError(f"request {res.request_id} failed: {res.error}")
        if res.is_finished():
            done[res.request_id] = len(res.generated_tokens)
    return done


def run(job: Job) -> dict[str, Any]:
    set_threads(job.threads)
    model = load_model(job.model, job.options)
    manager = model.init_continuous_batching(
        generation_config=gen_config(model), continuous_batching_config=cb_config(job)
    )
    manager.start()
    try:
        drain(manager, [job.warmup_prompt], [8], tag="warm")
        t0 = time.perf_counter()
        done = drain(manager, job.prompts, job.max_tokens)
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=10)
    wrong = [i for i, n in enumerate(job.max_tokens) if done.get(f"r{i}") != n]
    result = base_result(job, "hf-cb", wall)
    result["length_mismatches"] = len(wrong)
    result["ok"] = not wrong
    return result


def main() -> None:
    job, out = main_args()
    write_result(out, run(job))


if __name__ == "__main__":
    main()
