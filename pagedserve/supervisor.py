"""``pagedserve up`` and ``pagedserve demo``: the whole service on one machine, as child processes.

``up`` starts, under one supervising process: a local ``redis-server`` with AOF (unless ``--redis``
names one), the tiny model (built with ``pagedserve make-model`` unless ``--model`` names one), a
worker, the Celery control plane and the HTTP API (each only when its package is installed).
Everything lives under ``./.pagedserve/`` (Redis data, models, one log per child). Ctrl-C or
SIGTERM stops the children in reverse order (SIGTERM, then SIGKILL after a grace period).

``demo`` does ``up`` in the background, queues sample jobs (and a sample OpenAI batch), shows them
complete with a progress bar, prints where to look, then stops everything (``--keep``: keeps
serving until Ctrl-C).

No torch here: the model and the worker run in child processes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.keys import DEFAULT_PREFIX, PREFIX_ENV, env_prefix
from pagedserve.redis_util import URL_ENV, LocalRedisServer

log = logging.getLogger("pagedserve.supervisor")

DEFAULT_HOME = Path(".pagedserve")
#: Longest unix socket path redis accepts (sun_path is 108 bytes with the NUL).
_MAX_SOCKET = 100


@dataclass
class Child:
    name: str
    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as logf:
            # Own session: a terminal's Ctrl-C reaches only the supervisor, which stops children
            # in order.
            self.proc = subprocess.Popen(
                self.cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM, SIGKILL after ``grace_s``; then SIGKILL whatever the child left in its
        process group (gunicorn's workers, celery's beat) so nothing outlives the supervisor."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: pgid == its pid
        return self.proc.returncode


@dataclass
class UpConfig:
    home: Path = DEFAULT_HOME
    model: Path | None = None
    redis_url: str | None = None
    prefix: str = DEFAULT_PREFIX
    port: int = 8000
    host: str = "127.0.0.1"
    worker_args: list[str] = field(default_factory=list)
    api: bool = True
    control_plane: bool = True
    grace_s: float = 30.0


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedserve", *args]


class Supervisor:
    """Starts and stops the local service (see the module docstring)."""

    def __init__(self, cfg: UpConfig) -> None:
        self.cfg = cfg
        self.home = cfg.home.resolve()
        self.redis: LocalRedisServer | None = None
        self.redis_url = cfg.redis_url or ""
        self.model: Path | None = cfg.model
        self.children: list[Child] = []
        self._stop = False

    # ----------------------------------------------------------------- pieces
    def start_redis(self) -> str:
        if self.cfg.redis_url:
            return self.cfg.redis_url
        data = self.home / "redis"
        if len(str(data / "redis.sock")) > _MAX_SOCKET:
            data = Path(tempfile.gettempdir()) / f"pagedserve-{os.getuid()}"
            log.warning("%s is too deep for a unix socket; Redis data in %s", self.home, data)
        data.mkdir(parents=True, exist_ok=True)
        self.redis = LocalRedisServer(data, aof=True).start()
        return self.redis.url

    def ensure_model(self) -> Path:
        if self.cfg.model is not None:
            return self.cfg.model
        out = self.home / "models" / "tiny-llama"
        if not (out / "config.json").exists():
            print(f"building the tiny model into {out} ...", file=sys.stderr)
            cmd = _cli("make-model", "--family", "llama", "--preset", "tiny", "--out", str(out))
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return out

    def env(self) -> dict[str, str]:
        return dict(os.environ, **{URL_ENV: self.redis_url, PREFIX_ENV: self.cfg.prefix})

    def plan(self) -> list[Child]:
        logs = self.home / "logs"
        assert self.model is not None
        worker_cmd = _cli("worker", "--model", str(self.model), "--worker-id", "local-worker-0")
        children = [Child("worker", worker_cmd + self.cfg.worker_args, logs / "worker.log")]
        if (
            self.cfg.control_plane
            and _has_module("celery")
            and _has_module("pagedserve.celery_app")
        ):
            children.append(Child("control-plane", _cli("control-plane"), logs / "control.log"))
        if self.cfg.api and _has_module("api.server") and _has_module("flask"):
            api_cmd = _cli("api", "--host", self.cfg.host, "--port", str(self.cfg.port))
            children.append(Child("api", api_cmd, logs / "api.log"))
        return children

    # ----------------------------------------------------------------- life cycle
    def start(self) -> Supervisor:
        self.home.mkdir(parents=True, exist_ok=True)
        self.redis_url = self.start_redis()
        self.model = self.ensure_model()
        self.children = self.plan()
        env = self.env()
        for child in self.children:
            child.start(env)
        return self

    def request_stop(self, *_: object) -> None:
        self._stop = True

    def wait(self) -> int:
        """Until a stop is requested (0) or a child exits on its own (1)."""
        while not self._stop:
            for child in self.children:
                if not child.running:
                    code = child.proc.returncode if child.proc else None
                    print(f"{child.name} exited with {code}; see {child.log_path}", file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop(self.cfg.grace_s)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def pids(self) -> dict[str, int]:
        """The supervisor's and every started child's pid (each child leads its own session)."""
        out = {"supervisor": os.getpid()}
        if self.redis is not None and self.redis.proc is not None:
            out["redis"] = self.redis.proc.pid
        out |= {c.name: c.proc.pid for c in self.children if c.proc is not None}
        return out

    def urls(self) -> dict[str, str]:
        out = {"redis": self.redis_url, "logs": str(self.home / "logs")}
        if any(c.name == "api" for c in self.children):
            base = f"http://{self.cfg.host}:{self.cfg.port}"
            out |= {"api": base, "dashboard": f"{base}/dashboard", "metrics": f"{base}/metrics"}
        return out

    def has(self, name: str) -> bool:
        return any(c.name == name and c.running for c in self.children)

    def wait_worker(self, timeout: float = 120.0) -> None:
        from pagedserve.store import JobStore

        store = JobStore(self.redis_url, prefix=self.cfg.prefix)
        deadline = time.monotonic() + timeout
        worker = next(c for c in self.children if c.name == "worker")
        while time.monotonic() < deadline:
            if "local-worker-0" in store.workers():
                return
            if not worker.running:
                raise RuntimeError(f"the worker exited; see {worker.log_path}")
            time.sleep(0.2)
        raise TimeoutError(f"the worker did not start within {timeout} s")


def _install_signals(sup: Supervisor) -> None:
    signal.signal(signal.SIGTERM, sup.request_stop)
    signal.signal(signal.SIGINT, sup.request_stop)


# --------------------------------------------------------------------------- demo
BATCH_FINAL = ("completed", "failed", "expired", "cancelled")
DEMO_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three laws of robotics are",
    "SELECT name FROM users WHERE",
    "A haiku about Redis:",
]


def _demo_batch(sup: Supervisor) -> tuple[Any, str] | None:
    """A three-line OpenAI batch, fanned out directly (None when batches are not installed)."""
    if not _has_module("pagedserve.batches"):
        return None
    from pagedserve.batches import BatchStore

    bs = BatchStore(sup.redis_url, prefix=sup.cfg.prefix)
    lines = [
        {
            "custom_id": f"demo-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny-llama", "prompt": p, "max_tokens": 16, "temperature": 0},
        }
        for i, p in enumerate(DEMO_PROMPTS[:3])
    ]
    text = "".join(json.dumps(x) + "\n" for x in lines)
    f = bs.files.create(text, "demo.jsonl")
    b = bs.create(f.id, "/v1/completions")
    bs.fan_out(b.id)
    return bs, b.id


def run_demo(sup: Supervisor, jobs: int) -> dict[str, Any]:
    from tqdm import tqdm

    from pagedserve.client import Client

    sup.wait_worker()
    client = Client(sup.redis_url, prefix=sup.cfg.prefix)
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(jobs)]
    params = {"max_tokens": 32, "temperature": 0.7, "seed": 0}
    ids = client.submit_many(prompts[: jobs // 2], params)
    ids += client.submit_many(prompts[jobs // 2 :], params, priority="bulk")
    batch = _demo_batch(sup)
    with tqdm(total=len(ids), desc="demo jobs", unit="job", file=sys.stderr) as bar:
        while True:
            done = sum(s.terminal for s in client.store.statuses(ids))
            bar.update(done - bar.n)
            if done == len(ids):
                break
            time.sleep(0.1)
    recs = client.store.get_many(ids)
    summary: dict[str, Any] = {"jobs": len(ids), "statuses": {}}
    for r in recs:
        if r is not None:
            summary["statuses"][r.status.value] = summary["statuses"].get(r.status.value, 0) + 1
    first = recs[0]
    if first is not None and first.result is not None:
        summary["sample"] = {"prompt": prompts[0], "completion": first.result.completions[0].text}
    if batch is not None:
        bs, batch_id = batch
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            b = bs.get(batch_id)
            c = b.request_counts
            # Counted by the worker; the control plane then writes the files and completes it.
            counted = c.total and c.completed + c.failed >= c.total
            if counted and (b.status in BATCH_FINAL or not sup.has("control-plane")):
                break
            time.sleep(0.1)
        summary["batch"] = {
            "id": batch_id,
            "status": b.status,
            "request_counts": c.model_dump(),
            "output_file_id": b.output_file_id,
        }
    summary["look"] = sup.urls()
    return summary


# --------------------------------------------------------------------------- CLI
def _parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"pagedserve {prog}", description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: tiny llama)")
    ap.add_argument("--redis", default=None, help="Redis URL (default: a local redis-server)")
    ap.add_argument("--prefix", default=None, help="key prefix (default: $PAGEDSERVE_PREFIX/ps)")
    ap.add_argument("--port", type=int, default=8000, help="API port")
    ap.add_argument("--host", default="127.0.0.1", help="API address")
    ap.add_argument("--home", type=Path, default=DEFAULT_HOME, help="state directory")
    ap.add_argument("--no-api", action="store_true")
    ap.add_argument("--no-control-plane", action="store_true")
    ap.add_argument("--grace-s", type=float, default=30.0, help="stop: SIGTERM, then SIGKILL")
    ap.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra worker option (repeatable), e.g. --worker-arg=--max-num-seqs=64",
    )
    if prog == "demo":
        ap.add_argument("--jobs", type=int, default=24)
        ap.add_argument("--keep", action="store_true", help="keep serving after the demo")
    return ap


def _config(args: argparse.Namespace) -> UpConfig:
    return UpConfig(
        home=args.home,
        model=args.model,
        redis_url=args.redis or os.environ.get(URL_ENV) or None,
        prefix=args.prefix or env_prefix(),
        port=args.port,
        host=args.host,
        worker_args=list(args.worker_arg),
        api=not args.no_api,
        control_plane=not args.no_control_plane,
        grace_s=args.grace_s,
    )


def _up_line(sup: Supervisor) -> dict[str, Any]:
    """What ``up`` prints once started (``demo``: on stderr): children, URLs and pids."""
    return {"up": [c.name for c in sup.children], **sup.urls(), "pids": sup.pids()}


def up_main(argv: Sequence[str] | None = None) -> int:
    args = _parser("up").parse_args(argv)
    sup = Supervisor(_config(args))
    _install_signals(sup)
    try:
        sup.start()
        print(json.dumps(_up_line(sup)), flush=True)
        return sup.wait()
    finally:
        sup.stop()


def demo_main(argv: Sequence[str] | None = None) -> int:
    args = _parser("demo").parse_args(argv)
    sup = Supervisor(_config(args))
    _install_signals(sup)
    try:
        sup.start()
        print(json.dumps(_up_line(sup)), file=sys.stderr, flush=True)
        summary = run_demo(sup, args.jobs)
        summary["pids"] = sup.pids()
        print(json.dumps(summary, indent=2), flush=True)
        if args.keep:
            print("serving; Ctrl-C stops everything", file=sys.stderr)
            return sup.wait()
        return 0
    finally:
        sup.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``pagedserve up`` (``pagedserve demo`` is :func:`demo_main`, via :mod:`pagedserve.demo`)."""
    return up_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
