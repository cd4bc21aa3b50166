"""Structured outputs: what constraining costs, in one process, one engine, alternating rounds.

Workload: ``bench.throughput``'s ``mixed`` (token-id prompts, lengths uniform in its ranges,
per-request ``max_tokens``), greedy, on the bench checkpoint (random weights, its own trained
tokenizer, which structured outputs need) or ``--model``. Per round, four runs:

- ``one``: every request constrained by one JSON schema (the invoice schema);
- ``ten``: request i constrained by schema i mod 10 (``bench.structured_schemas``);
- ``free-one`` / ``free-ten``: the same prompts unconstrained with ``ignore_eos`` and each
  request's ``max_tokens`` set to the length its constrained run produced.

Why matched lengths: a constrained request ends when its grammar does (a random model writes
short JSON), so comparing against the workload's unconstrained lengths would compare different
amounts of work and batch shapes; with matched lengths the runs differ only by the grammar work.
Ratios are constrained / unconstrained tok/s (goal: >= 0.9 with one schema, >= 0.85 with ten).
Cold compile time per schema is measured once before the rounds (the rounds then hit the
cache, as a long batch does); mask time per step is the fill + apply time over steps that had
constrained rows. Prefix caching is off so that repeating prompts does not favour later runs.

    python -m bench.structured [--requests 24] [--rounds 2] [--model DIR] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit
from bench.structured_schemas import SCHEMAS
from bench.throughput import ensure_model, make_mixed

INVOICE = SCHEMAS[9]


def run(llm: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    st = llm.engine.structured.stats
    m0, s0, r0 = st.mask_s, st.mask_steps, st.mask_rows
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    steps, rows = st.mask_steps - s0, st.mask_rows - r0
    res = {
        "wall_s": round(wall, 3),
        "output_tokens": sum(lengths),
        "output_tok_s": round(sum(lengths) / wall, 1),
        "finish_stop": sum(o.outputs[0].finish_reason == "stop" for o in outs),
        "lengths": lengths,
    }
    if steps:
        res["mask_ms_per_step"] = round(1e3 * (st.mask_s - m0) / steps, 3)
        res["mask_us_per_row"] = round(1e6 * (st.mask_s - m0) / rows, 1)
        res["mask_share_of_wall_pct"] = round(100 * (st.mask_s - m0) / wall, 2)
    return res


def cold_compiles(llm: Any) -> dict[str, Any]:
    from pagedserve.params import StructuredOutputs

    t0 = time.perf_counter()
    backend = llm.engine.structured.backend()
    setup = time.perf_counter() - t0
    per = []
    for schema in SCHEMAS:
        t = time.perf_counter()
        backend.compile(StructuredOutputs(json=schema))
        per.append(1e3 * (time.perf_counter() - t))
    return {
        "tokenizer_setup_s": round(setup, 3),
        "compile_ms_per_schema": [round(x, 2) for x in per],
        "compile_ms_mean": round(statistics.mean(per), 2),
    }


def rounds(llm: Any, prompts: list[list[int]], max_tokens: list[int], n: int) -> dict[str, Any]:
    from pagedserve.params import SamplingParams

    def cons(schema: dict, mt: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=mt, structured_outputs={"json": schema})

    def free(mt: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True)

    one = [cons(INVOICE, mt) for mt in max_tokens]
    ten = [cons(SCHEMAS[i % 10], mt) for i, mt in enumerate(max_tokens)]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("one", "free-one", "ten", "free-ten")}
    for r in range(n):
        pairs = [("one", one), ("ten", ten)]
        for name, params in pairs if r % 2 == 0 else pairs[::-1]:
            got = run(llm, prompts, params)
            base = run(llm, prompts, [free(k) for k in got["lengths"]])
            runs[name].append(got)
            runs[f"free-{name}"].append(base)
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def med(name: str, key: str) -> float | None:
        vals = [r[key] for r in runs[name] if key in r]
        return round(statistics.median(vals), 3) if vals else None

    out: dict[str, Any] = {}
    for name in ("one", "ten"):
        paired = [
            round(c["output_tok_s"] / b["output_tok_s"], 3)
            for c, b in zip(runs[name], runs[f"free-{name}"], strict=True)
        ]
        out[name] = {
            "constrained_tok_s": med(name, "output_tok_s"),
            "unconstrained_tok_s": med(f"free-{name}", "output_tok_s"),
            "ratio_median": round(statistics.median(paired), 3),
            "paired_ratios": paired,
            "output_tokens": runs[name][0]["output_tokens"],
            "finish_stop": runs[name][0]["finish_stop"],
            "mask_ms_per_step": med(name, "mask_ms_per_step"),
            "mask_us_per_row": med(name, "mask_us_per_row"),
            "mask_share_of_wall_pct": med(name, "mask_share_of_wall_pct"),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", help="HF checkpoint dir with a tokenizer (default: bench preset)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from worker import LLM

    with tempfile.TemporaryDirectory(prefix="structured-") as tmp:
        model = ensure_model(args.model, Path(tmp))
        llm = LLM(model, enable_prefix_caching=False, max_model_len=1024,
                  num_threads=args.threads)  # fmt: skip
        wl = make_mixed(args.requests, llm.engine.vocab_size, args.seed)
        llm.generate(wl.prompts[:2], None, use_tqdm=False)  # warm-up
        compiles = cold_compiles(llm)
        runs = rounds(llm, wl.prompts, wl.max_tokens, max(1, args.rounds))
    emit(
        "structured",
        {
            "model": args.model or "bench preset (built, random weights)",
            "threads": args.threads,
            "requests": args.requests,
            "rounds": args.rounds,
            "prompt_tokens": wl.prompt_tokens,
            **summarize(runs),
            **compiles,
            "goal": {"one": 0.9, "ten": 0.85},
            "note": "unconstrained runs use the constrained runs' output lengths (ignore_eos)",
        },
    )


if __name__ == "__main__":
    main()
