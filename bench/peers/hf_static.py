"""transformers ``generate`` with static left-padded batches (greedy, EOS disabled).

Batches are formed in request order; each batch runs to its longest requested output
(``min_new_tokens = max_new_tokens``), and only requested tokens are counted. The whole workload
runs once per batch size in ``options["batch_sizes"]``; the best one is reported.

    python -m bench.peers.hf_static JOB_JSON RESULT_JSON
"""

from __future__ import annotations

import time
from typing import Any

from bench.peers.job import Job, base_result, main_args, set_threads, write_result


def load_model(path: str, options: dict[str, Any] | None = None) -> Any:
    """The checkpoint on ``options["device"]`` (default cpu) in ``options["dtype"]`` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    opts = options or {}
    dtype = getattr(torch, opts.get("dtype", "float32"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(opts.get("device", "cpu"))
    model.eval()
    return model


def synchronize(model: Any) -> None:
    """Wait for a GPU's queued work, so that a timer read next covers it."""
    import torch

    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def run_batch(model: Any, prompts: list[list[int]], outs: list[int], pad_id: int) -> int:
    """Generate one batch; returns the number of tokens computed per row (the longest output)."""
    import torch

    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    n = max(outs)
    with torch.inference_mode():
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=pad_id,
        )
    got = gen.shape[1] - ids.shape[1]
    if got != n:
        raise RuntimeError(f"batch generated {got} tokens, wanted {n}")
    return n


def run_workload(model: Any, job: Job, batch_size: int, pad_id: int) -> tuple[float, int]:
    """Wall seconds and the padded token count actually computed."""
    computed = 0
    t0 = time.perf_counter()
    for lo in range(0, len(job.prompts), batch_size):
        prompts = job.prompts[lo : lo + batch_size]
        outs = job.max_tokens[lo : lo + batch_size]
        n = run_batch(model, prompts, outs, pad_id)
        computed += len(prompts) * (max(len(p) for p in prompts) + n)
    synchronize(model)
    return time.perf_counter() - t0, computed


def run(job: Job) -> dict[str, Any]:
    set_threads(job.threads)
    model = load_model(job.model, job.options)
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = 0
    run_batch(model, [job.warmup_prompt] * 2, [8, 8], pad_id)
    sweep: dict[str, float] = {}
    best: tuple[float, int, int] | None = None
    for bs in job.options.get("batch_sizes", [8]):
        wall, computed = run_workload(model, job, bs, pad_id)
        sweep[str(bs)] = round(job.output_tokens / wall, 1)
        if best is None or wall < best[0]:
            best = (wall, bs, computed)
    assert best is not None
    wall, bs, computed = best
    result = base_result(job, "hf-static", wall)
    result["batch_size"] = bs
    result["sweep_tok_s"] = sweep
    useful = job.prompt_tokens + job.output_tokens
    result["computed_over_useful"] = round(computed / useful, 2)
    result["ok"] = True
    return result


def main() -> None:
    job, out = main_args()
    write_result(out, run(job))


if __name__ == "__main__":
    main()
