"""Throughput of ``Client.submit_many``: N small jobs into a private redis-server.

Prints one JSON line, e.g. ``{"bench": "submit_many", "jobs": 100000, "seconds": ..., ...}``.
Usage: ``python -m bench.submit [--jobs 100000] [--redis URL]`` (without --redis a private
redis-server on a unix socket is started and stopped).
"""

from __future__ import annotations

import argparse
import time

from bench.common import emit
from pagedserve.client import SUBMIT_CHUNK, Client
from pagedserve.params import SamplingParams
from pagedserve.redis_util import LocalRedisServer


def run(url: str, jobs: int, chunk: int) -> dict[str, object]:
    client = Client(url, prefix="psbench")
    prompts = [f"prompt number {i}: say something short" for i in range(jobs)]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    t0 = time.perf_counter()
    ids = client.submit_many(prompts, params, priority="bulk", chunk=chunk)
    seconds = time.perf_counter() - t0
    queued = client.store.queue_lengths()["bulk"]
    client.close()
    return {
        "jobs": jobs,
        "unique_ids": len(set(ids)),
        "chunk": chunk,
        "seconds": round(seconds, 3),
        "jobs_per_s": round(jobs / seconds, 1),
        "queued_bulk": queued,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--chunk", type=int, default=SUBMIT_CHUNK)
    ap.add_argument("--redis", default=None, help="Redis URL (default: a private server)")
    args = ap.parse_args(argv)
    if args.redis:
        out = run(args.redis, args.jobs, args.chunk)
    else:
        with LocalRedisServer() as server:
            out = run(server.url, args.jobs, args.chunk)
    emit("submit_many", out)


if __name__ == "__main__":
    main()
