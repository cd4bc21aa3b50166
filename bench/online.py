"""Online serving: N concurrent streaming chat clients (the official ``openai`` client) against a
live stack (a private redis-server, one ``pagedserve worker``, ``pagedserve api`` under gunicorn)
vs the offline engine on the same requests, in the same run, alternating rounds.

Each client sends its share of the requests one after another with ``stream=True`` (greedy,
``ignore_eos``, so every request produces exactly its ``max_tokens``). Reported: requests/s and
output tok/s of the online runs, time to first token (TTFT: request sent -> first content chunk)
and inter-token latency (ITL: gaps between content chunks; ``tpot``: (last - first chunk) /
(tokens - 1) per request) at p50 / p99, online tok/s as a fraction of the offline engine's
(goal >= 0.9 at 32 clients), and how long ``GET /v1/pool`` took while the streams ran.

Usage: ``python -m bench.online [--clients 32] [--requests 96] [--rounds 2]
[--preset tiny|bench|smollm2 | --model DIR|FILE.gguf] [--threads 1] [--device cpu]
[--dtype float32]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import emit
from bench.service import pick_model, start_worker
from pagedserve.params import SamplingParams
from pagedserve.redis_util import LocalRedisServer

WORDS = ("river", "stone", "lantern", "orbit", "maple", "signal", "copper", "harbor", "violet",
         "engine", "quiet", "meadow", "falcon", "ember", "glacier", "thunder")  # fmt: skip


@dataclass(frozen=True)
class Request:
    messages: list[dict[str, str]]
    max_tokens: int


@dataclass
class Timings:
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def make_requests(n: int, seed: int) -> list[Request]:
    """Chat requests with user messages of 8-200 words and 16-128 output tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 200)))
        out.append(Request([{"role": "user", "content": text}], rng.randint(16, 128)))
    return out


def params_of(r: Request) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)


def run_offline(engine: Any, reqs: list[Request]) -> float:
    """Seconds for the offline engine to run every request (all queued at once)."""
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add_request(
            f"off-{time.monotonic_ns()}-{i}", None, params_of(r), messages=r.messages
        )
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(c.token_ids) for o in engine.step() if o.finished for c in o.outputs)
    wall = time.perf_counter() - t0
    if tokens != sum(r.max_tokens for r in reqs):
        raise RuntimeError(f"offline engine generated {tokens} tokens")
    return wall


def _one(oa: Any, model: str, r: Request, t: Timings) -> None:
    t0 = time.perf_counter()
    stream = oa.chat.completions.create(
        model=model, messages=r.messages, max_tokens=r.max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    stamps, tokens = [], 0
    for c in stream:
        if c.choices and c.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if c.usage is not None:
            tokens = c.usage.completion_tokens
    if tokens != r.max_tokens or not stamps:
        raise RuntimeError(f"a request generated {tokens} of {r.max_tokens} tokens")
    with t.lock:
        t.ttft.append(stamps[0] - t0)
        t.gaps += [b - a for a, b in itertools.pairwise(stamps)]
        t.tpot.append((stamps[-1] - stamps[0]) / max(1, tokens - 1))
        t.tokens += tokens


def run_online(
    base_url: str, model: str, reqs: list[Request], clients: int
) -> tuple[float, Timings, list[float]]:
    """Wall seconds, client timings and ``GET /v1/pool`` latencies of one online round."""
    import http.client
    from urllib.parse import urlparse

    import openai

    oa = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    t, errors, pool_s = Timings(), [], []
    shares = [reqs[i::clients] for i in range(clients)]

    def client(share: list[Request]) -> None:
        try:
            for r in share:
                _one(oa, model, r, t)
        except BaseException as e:  # reported after the round
            errors.append(e)

    threads = [threading.Thread(target=client, args=(s,)) for s in shares if s]
    u = urlparse(base_url)
    probe = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    while any(th.is_alive() for th in threads):
        p0 = time.perf_counter()
        probe.request("GET", "/v1/pool")
        probe.getresponse().read()
        pool_s.append(time.perf_counter() - p0)
        time.sleep(0.25)
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    probe.close()
    if errors:
        raise RuntimeError(f"{len(errors)} clients failed, the first: {errors[0]!r}")
    return wall, t, pool_s


def cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by process ``root`` and its live children (the
    gunicorn master's workers), from /proc; 0.0 where /proc cannot be read."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(pid: str) -> list[str] | None:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None

    total = 0.0
    for pid in [d for d in os.listdir("/proc") if d.isdigit()]:
        f = stat(pid)
        if f is not None and (int(pid) == root or int(f[1]) == root):
            total += (int(f[11]) + int(f[12])) / tick
    return total


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def ms(x: float) -> float:
    return round(x * 1e3, 2)


def start_api(redis_url: str, threads: int, log: Path) -> tuple[Any, str]:
    """``pagedserve api`` (gunicorn, 2 workers) on a free port; (process, base URL of /v1)."""
    import os
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "stack", "--redis", redis_url, "api", "--port", str(port),
           "--workers", "2", "--threads", str(threads)]  # fmt: skip
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
            return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the API did not start:\n{log.read_text()[-3000:]}")


def figures(walls: list[float], offline: list[float], t: Timings, pool_s: list[float],
            reqs: list[Request], args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    tokens = sum(r.max_tokens for r in reqs)
    ratios = [o / w for o, w in zip(offline, walls, strict=True)]  # tok/s online / offline
    return {
        "clients": args.clients,
        "requests": len(reqs),
        "rounds": args.rounds,
        "output_tokens": tokens,
        "threads": args.threads,
        "online_requests_per_s": round(len(reqs) / statistics.median(walls), 3),
        "online_tok_s": round(tokens / statistics.median(walls), 1),
        "offline_tok_s": round(tokens / statistics.median(offline), 1),
        "online_over_offline": round(statistics.median(ratios), 3),
        "paired_ratios": [round(x, 3) for x in ratios],
        "ttft_ms_p50": ms(pct(t.ttft, 0.5)),
        "ttft_ms_p99": ms(pct(t.ttft, 0.99)),
        "itl_ms_p50": ms(pct(t.gaps, 0.5)),
        "itl_ms_p99": ms(pct(t.gaps, 0.99)),
        "tpot_ms_p50": ms(pct(t.tpot, 0.5)),
        "tpot_ms_p99": ms(pct(t.tpot, 0.99)),
        "pool_get_ms_p50": ms(pct(pool_s, 0.5)),
        "pool_get_ms_max": ms(max(pool_s, default=float("nan"))),
        "pool_gets": len(pool_s),
    }


@dataclass
class Rounds:
    """What the alternating rounds measured."""

    walls: list[float] = field(default_factory=list)
    offline: list[float] = field(default_factory=list)
    pool_s: list[float] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    cpu: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # worker, API, clients
    offline_cpu: float = 0.0

    def run(self, engine: Any, stack: tuple[int, int, str], name: str, reqs: list[Request],
            clients: int) -> None:  # fmt: skip
        """One offline run, then one online run (``stack``: worker pid, API pid, base URL)."""
        t0 = os.times()
        self.offline.append(run_offline(engine, reqs))
        t1 = os.times()
        self.offline_cpu += t1.user + t1.system - t0.user - t0.system
        before = _cpu(*stack[:2])
        wall, t, p = run_online(stack[2], name, reqs, clients)
        spent = [b - a for a, b in zip(before, _cpu(*stack[:2]), strict=True)]
        self.cpu = [c + x for c, x in zip(self.cpu, spent, strict=True)]
        self.walls.append(wall)
        self.pool_s += p
        self.timings.ttft += t.ttft
        self.timings.gaps += t.gaps
        self.timings.tpot += t.tpot

    def report(self, reqs: list[Request], args: argparse.Namespace) -> dict[str, Any]:
        out = figures(self.walls, self.offline, self.timings, self.pool_s, reqs, args)
        # On a shared 2-core machine the API and the clients take CPU from the worker's thread.
        out |= dict(zip(("cpu_s_worker", "cpu_s_api", "cpu_s_clients"),
                        [round(c, 1) for c in self.cpu], strict=True))  # fmt: skip
        out["online_wall_s"] = round(sum(self.walls), 1)
        out["offline_cpu_s"] = round(self.offline_cpu, 1)
        # Load-independent: the worker's CPU for the requests against the offline engine's
        # (1.0: serving costs the engine nothing; the API's and clients' CPU are listed above).
        ratio = self.cpu[0] / self.offline_cpu if self.offline_cpu else None
        out["worker_cpu_over_offline_cpu"] = round(ratio, 3) if ratio else None
        return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF checkpoint dir or .gguf file")
    ap.add_argument("--preset", choices=("tiny", "bench", "smollm2"), default="bench")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2, help="alternating offline/online rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both engines)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda[:n] (both engines)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (both)")
    ap.add_argument("--api-threads", type=int, default=64, help="gunicorn threads per worker")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    from bench.service import offline_engine

    reqs, rounds = make_requests(args.requests, args.seed), Rounds()
    with tempfile.TemporaryDirectory(prefix="psbench-") as tmp:
        work = Path(tmp)
        name, model = pick_model(args, work)
        engine = offline_engine(model, args)
        with LocalRedisServer() as server:
            worker = start_worker(server.url, model, args, work / "worker.log")
            api, base = start_api(server.url, args.api_threads, work / "api.log")
            try:
                _one_warm(base, name, reqs[0])
                for _ in range(args.rounds):
                    rounds.run(engine, (worker.pid, api.pid, base), name, reqs, args.clients)
            finally:
                api.terminate()
                worker.terminate()
                api.wait(timeout=30)
                worker.wait(timeout=60)
    emit("online", {"model": name, **rounds.report(reqs, args)})


def _cpu(worker_pid: int, api_pid: int) -> list[float]:
    t = os.times()
    return [cpu_s(worker_pid), cpu_s(api_pid), t.user + t.system]


def _one_warm(base: str, model: str, r: Request) -> None:
    """One request through the stack before timing (the worker's first step, connections)."""
    run_online(base, model, [Request(r.messages, 4)], 1)


if __name__ == "__main__":
    main()
