"""What the queue costs Redis: commands, bytes and Redis CPU per job and per generated token, and
the fleet size at which one Redis saturates.

A private redis-server and a real ``pagedserve worker`` run the ``mixed`` workload (as
``bench.service`` does) once per progress interval given; ``INFO commandstats``, ``INFO stats``
and ``INFO cpu`` are read before and after each run. Redis executes commands on one thread, so it
saturates when its CPU time per second reaches 1: the projection divides one CPU second by the
Redis CPU that one worker's generated tokens cost per second. That is a projection from one
worker on this machine, not a fleet measurement; with N Cluster shards that spread the keys evenly
it scales by N. Prints one JSON line.

Usage: ``python -m bench.redis_cost [--preset tiny|bench|smollm2] [--requests 48]
[--progress-intervals-ms 50,200|default] [--priority bulk|interactive]`` (``default``: the
worker's own paces, e.g. for interactive jobs that no reader streams).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench.common import emit
from bench.service import pick_model, start_worker
from bench.throughput import Workload, make_mixed, model_numbers, params_of
from pagedserve.client import Client
from pagedserve.redis_util import LocalRedisServer
from pagedserve.schemas import JobRecord, JobRequest
from pagedserve.store import JobStore
from pagedserve.telemetry import WorkerHeartbeat


def snapshot(r: redis.Redis) -> dict[str, Any]:
    """Cumulative counters of the server: per-command calls, bytes in and out, CPU seconds."""
    stats, cpu = r.info("stats"), r.info("cpu")
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}
    return {
        "calls": calls,
        "commands": stats["total_commands_processed"],
        "bytes_in": stats["total_net_input_bytes"],
        "bytes_out": stats["total_net_output_bytes"],
        "cpu_s": cpu["used_cpu_user"] + cpu["used_cpu_sys"],
        "t": time.perf_counter(),
    }


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    calls = {
        k: n - before["calls"].get(k, 0)
        for k, n in after["calls"].items()
        if n - before["calls"].get(k, 0) > 0
    }
    keys = ("commands", "bytes_in", "bytes_out", "cpu_s", "t")
    return {"calls": calls, **{k: after[k] - before[k] for k in keys}}


def worker_steps(url: str) -> int:
    raw = JobStore(url).workers().get("bench")
    hb = WorkerHeartbeat.parse_published({"worker_id": "bench", **raw}) if raw else None
    return hb.steps if hb else 0


def cost_of(d: dict[str, Any], jobs: int, tokens: int, steps: int) -> dict[str, Any]:
    wall = d["t"]
    tok_s = tokens / wall
    redis_cpu_per_token = d["cpu_s"] / tokens
    top = sorted(d["calls"].items(), key=lambda kv: -kv[1])[:8]
    return {
        "wall_s": round(wall, 3),
        "output_tok_s": round(tok_s, 1),
        "steps": steps,
        "commands_per_job": round(d["commands"] / jobs, 2),
        "commands_per_token": round(d["commands"] / tokens, 3),
        "commands_per_step": round(d["commands"] / steps, 2) if steps else None,
        "bytes_in_per_token": round(d["bytes_in"] / tokens, 1),
        "bytes_out_per_token": round(d["bytes_out"] / tokens, 1),
        "redis_cpu_us_per_token": round(redis_cpu_per_token * 1e6, 2),
        "redis_cpu_fraction": round(d["cpu_s"] / wall, 4),
        "redis_ops_per_s": round(d["commands"] / wall, 1),
        # One Redis thread: saturated at one CPU second per second.
        "workers_to_saturate": round(1.0 / (redis_cpu_per_token * tok_s), 1),
        "tokens_per_s_at_saturation": round(1.0 / redis_cpu_per_token),
        "top_commands": dict(top),
    }


def requests_of(wl: Workload, priority: str = "bulk") -> list[JobRequest]:
    return [
        JobRequest(prompt=p, params=sp, priority=priority)  # type: ignore[arg-type]
        for p, sp in zip(wl.prompts, params_of(wl), strict=True)
    ]


def check(recs: list[JobRecord], tokens: int) -> None:
    bad = [r.id for r in recs if r.status != "succeeded"]
    got = sum(r.result.completion_tokens for r in recs if r.result)
    if bad or got != tokens:
        raise RuntimeError(f"{len(bad)} jobs failed; {got} of {tokens} tokens")


def run_once(model: Path, args: argparse.Namespace, interval_ms: float | None, work: Path) -> dict:
    """One run at ``interval_ms`` (None: the worker's default paces)."""
    vocab, _ = model_numbers(model)
    wl = make_mixed(args.requests, vocab, args.seed)
    with LocalRedisServer() as server:
        # No reader follows these jobs: their pace is --bulk-progress-interval-ms, set to the
        # interval measured like the streamed jobs' pace.
        extra: tuple[str, ...] = ()
        if interval_ms is not None:
            extra = ("--progress-interval-ms", str(interval_ms),
                     "--bulk-progress-interval-ms", str(interval_ms))  # fmt: skip
        proc = start_worker(server.url, model, args, work / f"worker-{interval_ms}.log", extra)
        try:
            r = redis.Redis.from_url(server.url, decode_responses=True)
            steps0 = worker_steps(server.url)
            start = snapshot(r)
            client = Client(server.url)
            ids = client.submit_requests(requests_of(wl, args.priority))
            submitted = snapshot(r)
            # Polling once a second keeps the client's own reads out of the serving figures.
            recs = client.wait_many(ids, timeout=3600, poll_s=1.0)
            after = snapshot(r)
            check(recs, wl.output_tokens)
            time.sleep(1.2)  # one more heartbeat carries the final step count
            steps = worker_steps(server.url) - steps0
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    enqueue = delta(start, submitted)
    serve = cost_of(delta(submitted, after), args.requests, wl.output_tokens, steps)
    return {
        "progress_interval_ms": interval_ms if interval_ms is not None else "default",
        "priority": args.priority,
        "enqueue_commands_per_job": round(enqueue["commands"] / args.requests, 2),
        "enqueue_bytes_in_per_job": round(enqueue["bytes_in"] / args.requests, 1),
        **serve,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF checkpoint dir or .gguf file")
    ap.add_argument("--preset", choices=("tiny", "bench", "smollm2"), default="tiny")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--device", default="cpu", help="cpu | cuda[:n] (the worker's)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    ap.add_argument("--progress-intervals-ms", default="50,200",
                    help="comma-separated; 'default': the worker's own paces")  # fmt: skip
    ap.add_argument("--priority", choices=("bulk", "interactive"), default="bulk")
    args = ap.parse_args(argv)
    intervals = [
        None if x.strip() == "default" else float(x)
        for x in args.progress_intervals_ms.split(",")
        if x.strip()
    ]
    with tempfile.TemporaryDirectory(prefix="psbench-redis-") as tmp:
        work = Path(tmp)
        name, model = pick_model(args, work)
        runs = [run_once(model, args, ms, work) for ms in intervals]
    emit("redis_cost", {"model": name, "workload": "mixed", "requests": args.requests,
                        "runs": runs})  # fmt: skip


if __name__ == "__main__":
    main()
