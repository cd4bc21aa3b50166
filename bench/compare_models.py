"""``bench.throughput`` over several models and workloads, summarised: one JSON line.

Issue #17's targets are per model (the bench checkpoint and the real SmolLM2-135M) and per
workload (``mixed``, ``uniform``; ``shared-prefix`` too, where the systems with a prefix cache
are compared with it on). This runs ``python -m bench.throughput`` once per model and
workload (each a fresh process; systems alternate inside it as ``--repeats`` says) and prints
a ``table`` with, per model x workload x system, the median output tok/s, its MFU and every
run's figure, plus the ratios and paired ratios of ``ours`` against each other system; the
full ``bench.throughput`` lines follow under ``runs``.

    python -m bench.compare_models [--models bench,smollm2]
        [--workloads mixed,uniform,shared-prefix]
        [--systems ours,vllm] [--vllm-python PATH] [--base DIR] [--repeats 3]
        [--bench-preset full] [--real-preset smollm2] [--requests N] [--threads 2]

A model is ``bench`` (the built bench checkpoint), ``smollm2`` (the embedded SmolLM2 GGUF) or a
path (HF directory or ``.gguf``; run with ``--real-preset``'s sizes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from bench.common import emit
from bench.throughput import REPO


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="bench,smollm2")
    ap.add_argument("--workloads", default="mixed,uniform,shared-prefix")
    ap.add_argument("--systems", default="ours,vllm")
    ap.add_argument("--vllm-python")
    ap.add_argument("--base", help="checkout run as system 'base' (A/B)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bench-preset", default="full")
    ap.add_argument("--real-preset", default="smollm2")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def throughput_cmd(args: argparse.Namespace, model: str, workload: str) -> list[str]:
    preset = args.bench_preset if model == "bench" else args.real_preset
    cmd = [sys.executable, "-m", "bench.throughput", "--preset", preset, "--workload", workload]
    if model not in ("bench", "smollm2"):
        cmd += ["--model", model]
    cmd += ["--systems", args.systems, "--repeats", str(args.repeats)]
    cmd += ["--threads", str(args.threads)]
    for flag, value in (("--vllm-python", args.vllm_python), ("--base", args.base),
                        ("--requests", args.requests)):  # fmt: skip
        if value:
            cmd += [flag, str(value)]
    return cmd


def summarise(model: str, workload: str, line: dict[str, Any]) -> dict[str, Any]:
    body = line["workloads"][workload]
    systems = {
        name: {
            "output_tok_s": res.get("output_tok_s"),
            "mfu_pct": res.get("mfu_pct"),
            "runs_output_tok_s": res.get("runs_output_tok_s"),
            "ok": res.get("ok"),
        }
        for name, res in body["systems"].items()
    }
    return {
        "model": model,
        "workload": workload,
        "requests": body["requests"],
        "systems": systems,
        "ratios": body.get("ratios"),
        "paired_ratios": body.get("paired_ratios"),
        "peak_gflops": line.get("peak_gflops"),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    table: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        for workload in [w.strip() for w in args.workloads.split(",") if w.strip()]:
            cmd = throughput_cmd(args, model, workload)
            print(f"[compare_models] {model} / {workload}", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if proc.returncode != 0 or not lines:
                tail = proc.stderr[-1500:]
                table.append({"model": model, "workload": workload, "error": tail})
                continue
            line = json.loads(lines[-1])
            runs.append(line)
            table.append(summarise(model, workload, line))
    emit("compare_models", {"table": table, "runs": runs})


if __name__ == "__main__":
    main()
