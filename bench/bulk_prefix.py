"""Bulk work over shared prefixes: prefix-aware admission + affinity against FCFS, same run.

A private redis-server and two real ``pagedserve worker`` processes; ``--jobs`` bulk jobs over
``--prefixes`` distinct system prompts of ``--prefix-len`` tokens with short unique suffixes,
randomly interleaved; each worker's KV pool holds about ``--pool-prefixes`` of the prefixes. Rounds
alternate FCFS (``--admission fcfs``) and prefix-aware admission, then one more prefix-aware run
kills one worker (SIGKILL) a third of the way through: every job must still finish exactly once.

Figures per mode (medians over rounds): fleet throughput (jobs/s, tokens/s), the prefix-hit rate
(cached prompt tokens / prompt tokens) against the ideal one (each prefix computed once per worker
that serves it), and the longest time a job waited beyond FCFS order (how long after a job that
was queued later had started it started). Prints one JSON line with the CPU kind.

Model: the bench checkpoint (built; ~6 minutes for 2000 jobs, most of it FCFS recomputing
prefixes), or ``--model``; ``--quick`` uses a tiny random llama (prefill nearly free there, so its
ratio measures queue overhead more than cache savings).

Usage: ``python -m bench.bulk_prefix [--quick] [--rounds 1] [--jobs 2000] [--model DIR]``
(``--quick``: a few seconds, for tests).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import emit
from bench.service import build_model
from pagedserve.keys import DEFAULT_PREFIX, PREFIX_ENV
from pagedserve.params import SamplingParams
from pagedserve.redis_util import URL_ENV, LocalRedisServer
from pagedserve.schemas import JobRecord, JobRequest, JobStatus
from pagedserve.store import JobStore

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Setup:
    jobs: int
    prefixes: int
    prefix_len: int
    suffix: tuple[int, int]  # unique suffix length range (tokens)
    max_tokens: int
    pool_prefixes: int
    max_num_seqs: int
    max_wait_ms: int
    seed: int = 0

    @property
    def num_kv_blocks(self) -> int:
        """The pool: ``pool_prefixes`` prefixes plus a few blocks for each running job."""
        prefix_blocks = -(-self.prefix_len // BLOCK_SIZE)
        return self.pool_prefixes * prefix_blocks + 2 * self.max_num_seqs


def setup_of(args: argparse.Namespace) -> Setup:
    if args.quick:
        return Setup(jobs=96, prefixes=4, prefix_len=128, suffix=(4, 12), max_tokens=4,
                     pool_prefixes=2, max_num_seqs=8, max_wait_ms=60_000)  # fmt: skip
    return Setup(jobs=args.jobs, prefixes=16, prefix_len=512, suffix=(4, 16),
                 max_tokens=args.max_tokens, pool_prefixes=4, max_num_seqs=16,
                 max_wait_ms=args.max_wait_ms)  # fmt: skip


def make_jobs(s: Setup, vocab: int) -> list[tuple[int, list[int]]]:
    """(prefix index, prompt token ids) per job, prefixes randomly interleaved."""
    rng = random.Random(s.seed)
    prefixes = [[rng.randrange(4, vocab) for _ in range(s.prefix_len)] for _ in range(s.prefixes)]
    out = []
    for i in range(s.jobs):
        p = rng.randrange(s.prefixes)
        suffix = [rng.randrange(4, vocab) for _ in range(rng.randint(*s.suffix))]
        out.append((p, prefixes[p] + suffix + [4 + i % (vocab - 4)]))
    return out


class Fleet:
    """Two (or more) worker processes on one Redis, started and stopped together."""

    def __init__(self, url: str, model: Path, s: Setup, mode: str, logs: Path) -> None:
        self.url, self.procs = url, {}  # type: ignore[var-annotated]
        env = dict(os.environ, **{URL_ENV: url, PREFIX_ENV: DEFAULT_PREFIX})
        env.setdefault("OMP_NUM_THREADS", "1")
        for wid in ("w1", "w2"):
            cmd = [sys.executable, "-m", "stack", "worker", "--model", str(model)]
            cmd += ["--worker-id", wid, "--admission", mode, "--num-threads", "1",
                    "--num-kv-blocks", str(s.num_kv_blocks), "--block-size", str(BLOCK_SIZE),
                    "--max-num-seqs", str(s.max_num_seqs), "--max-model-len", "2048",
                    "--lease-ms", "3000", "--reclaim-ms", "3000", "--affinity-ttl-ms", "3000",
                    "--admission-max-wait-ms", str(s.max_wait_ms),
                    "--log-level", "WARNING"]  # fmt: skip
            with (logs / f"{mode}-{wid}.log").open("ab") as f:
                self.procs[wid] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, store: JobStore, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = store.workers()
            for wid, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"worker {wid} exited with {p.returncode}")
            if all(live.get(w, {}).get("pid") == p.pid for w, p in self.procs.items()):
                return
            time.sleep(0.1)
        raise TimeoutError("workers not ready")

    def kill(self, wid: str) -> None:
        self.procs[wid].send_signal(signal.SIGKILL)
        self.procs[wid].wait(timeout=30)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=30)


def submit(store: JobStore, jobs: list[tuple[int, list[int]]], s: Setup) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True)
    reqs = [(f"job-{i:05d}", JobRequest(prompt=ids, params=params, priority="bulk"))
            for i, (_, ids) in enumerate(jobs)]  # fmt: skip
    for k in range(0, len(reqs), 500):
        store.enqueue_many(reqs[k : k + 500])
    return [jid for jid, _ in reqs]


def wait_done(store: JobStore, ids: list[str], on_progress: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last_note = time.monotonic()
    while time.monotonic() < deadline:
        done = sum(st.terminal for st in store.statuses(ids))
        on_progress(done)
        if time.monotonic() - last_note > 10:
            last_note = time.monotonic()
            print(f"bulk_prefix: {done}/{len(ids)} done", file=sys.stderr, flush=True)
        if done == len(ids):
            return
        time.sleep(0.2)
    raise TimeoutError(f"jobs not done after {timeout} s")


def max_wait_beyond_fcfs(recs: list[JobRecord]) -> float:
    """The longest a job started after some job queued later than it had started (seconds)."""
    worst, later_min = 0.0, float("inf")
    for r in reversed(recs):  # enqueue order, walked backwards
        start = r.started_at or r.finished_at or 0.0
        worst = max(worst, start - later_min)
        later_min = min(later_min, start)
    return worst


def analyse(recs: list[JobRecord], jobs: list[tuple[int, list[int]]], s: Setup) -> dict[str, Any]:
    good = [i for i, r in enumerate(recs) if r.status == JobStatus.SUCCEEDED and r.result]
    ok = [recs[i] for i in good]
    prompt = sum(r.result.prompt_tokens for r in ok if r.result)
    cached = sum(r.result.cached_prompt_tokens for r in ok if r.result)
    shared = s.prefix_len // BLOCK_SIZE * BLOCK_SIZE
    pairs = {(recs[i].worker, jobs[i][0]) for i in good}
    ideal = (len(ok) * shared - len(pairs) * shared) / prompt if prompt else 0.0
    wall = max(r.finished_at or 0.0 for r in recs) - min(r.created_at for r in recs)
    out_tokens = sum(r.result.completion_tokens for r in ok if r.result)
    return {
        "succeeded": len(ok),
        "wall_s": round(wall, 2),
        "jobs_per_s": round(len(ok) / wall, 2),
        "tokens_per_s": round((prompt + out_tokens) / wall, 1),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ideal_hit_rate": round(ideal, 4),
        "hit_vs_ideal": round(cached / prompt / ideal, 3) if ideal else 0.0,
        "worker_prefix_pairs": len(pairs),
        "max_wait_beyond_fcfs_s": round(max_wait_beyond_fcfs(recs), 2),
        "jobs_per_worker": {w: sum(r.worker == w for r in ok) for w in ("w1", "w2")},
    }


def run_mode(srv: LocalRedisServer, model: Path, s: Setup, mode: str, logs: Path,
             kill_at: float | None = None) -> dict[str, Any]:  # fmt: skip
    """One run of ``mode`` on a flushed Redis; with ``kill_at`` (a fraction of the jobs done),
    SIGKILL worker w2 then and check every job finished exactly once."""
    store = JobStore(srv.url)
    store.r.flushall()
    fleet = Fleet(srv.url, model, s, mode, logs)
    killed: list[float] = []
    try:
        fleet.wait_ready(store)
        jobs = make_jobs(s, vocab=512)
        ids = submit(store, jobs, s)

        def progress(done: int) -> None:
            if kill_at is not None and not killed and done >= kill_at * len(ids):
                fleet.kill("w2")
                killed.append(done)

        wait_done(store, ids, progress, timeout=1800)
        recs = [r for r in store.get_many(ids) if r is not None]
        out = analyse(recs, jobs, s)
        if kill_at is not None:
            out.update(exactly_once(store, ids, recs), killed_after_jobs=killed[0])
        return out
    finally:
        fleet.stop()


def exactly_once(store: JobStore, ids: list[str], recs: list[JobRecord]) -> dict[str, Any]:
    """Every job succeeded with one end event, and nothing is left pending in the bulk stream."""
    ends = []
    for jid in ids:
        events = store.r.xrange(store.keys.events(jid))
        ends.append(sum(1 for _, f in events if f.get("type") == "end"))
    pending = store.r.xpending(store.keys.stream("bulk"), "workers")["pending"]
    return {
        "all_succeeded_once": all(e == 1 for e in ends)
        and all(r.status == JobStatus.SUCCEEDED for r in recs)
        and len(recs) == len(ids),
        "redelivered": sum(r.deliveries > 1 for r in recs),
        "pending_left": int(pending),
    }


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (seconds), for tests")
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-wait-ms", type=int, default=600_000, help="admission aging bound")
    ap.add_argument("--no-kill", action="store_true", help="skip the run with a worker killed")
    ap.add_argument(
        "--model", type=Path, default=None, help="default: the bench checkpoint (--quick: tiny)"
    )
    args = ap.parse_args(argv)
    s = setup_of(args)
    with tempfile.TemporaryDirectory(prefix="bulk-prefix-") as tmp:
        work = Path(tmp)
        # The bench checkpoint by default: with a tiny model prefill costs almost nothing and the
        # ratio measures the queue's overhead rather than what the cache saves.
        model = args.model or build_model("tiny" if args.quick else "bench", work)
        srv = LocalRedisServer().start()
        runs: dict[str, list[dict[str, Any]]] = {"fcfs": [], "prefix": []}
        try:
            for _ in range(args.rounds):
                for mode in ("fcfs", "prefix"):  # alternating rounds, same process
                    runs[mode].append(run_mode(srv, model, s, mode, work))
            kill = None if args.no_kill else run_mode(srv, model, s, "prefix", work, kill_at=1 / 3)
        finally:
            srv.stop()
    fig: dict[str, Any] = {"setup": {**s.__dict__, "num_kv_blocks": s.num_kv_blocks}}
    fig.update({mode: rs[-1] if len(rs) == 1 else rs for mode, rs in runs.items()})
    fig["throughput_ratio"] = round(
        median_of(runs["prefix"], "jobs_per_s") / median_of(runs["fcfs"], "jobs_per_s"), 3
    )
    fig["hit_vs_ideal"] = median_of(runs["prefix"], "hit_vs_ideal")
    fig["killed_run"] = kill
    emit("bulk_prefix", fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
