"""Redis connections and a private ``redis-server`` process (for tests, benchmarks, demos)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from pagedserve.redis_url import connect_url
from pagedserve.settings import REDIS_URL

DEFAULT_URL = REDIS_URL.default
URL_ENV = REDIS_URL.name


def default_url() -> str:
    """The Redis URL from ``PAGEDSERVE_REDIS_URL``, else the local default."""
    return REDIS_URL.text()


def connect(url: str | None = None) -> redis.Redis:
    """A client that decodes replies to ``str`` (everything we store is text or JSON); ``url``
    may name a Sentinel-managed master (:mod:`pagedserve.redis_url`)."""
    return connect_url(url or default_url(), decode_responses=True)


def stream_entries(reply: Any) -> list[tuple[str, list[tuple[str, Any]]]]:
    """An XREAD / XREADGROUP reply (RESP2 list, or RESP3 dict whose entries come wrapped in a
    list) -> ``(stream, entries)`` pairs."""
    out: list[tuple[str, list[tuple[str, Any]]]] = []
    for stream, entries in reply.items() if isinstance(reply, dict) else reply or []:
        if isinstance(entries, list) and entries and isinstance(entries[0], list):
            entries = entries[0]  # RESP3 wraps the entries in a list
        out.append((stream, entries))
    return out


class LocalRedisServer:
    """A ``redis-server`` child process listening only on a unix socket in ``data_dir``.

    No TCP port (``port 0``), so it can never collide with a shared Redis. With ``aof=True`` every
    write is fsynced to an append-only file, so :meth:`kill` (SIGKILL) followed by :meth:`start`
    on the same directory shows what survives a crash.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        aof: bool = False,
        binary: str | None = None,
    ) -> None:
        self._own_dir = data_dir is None
        # Unix socket paths are limited to ~107 bytes: keep the directory short.
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="psredis-", dir="/tmp"))
        self.aof = aof
        self.binary = binary or shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        return self.data_dir / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}?db=0"

    def _args(self) -> list[str]:
        args = [
            self.binary,
            "--port", "0",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir),
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip
        if self.aof:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        return args

    def start(self, timeout: float = 10.0) -> LocalRedisServer:
        """Start (or restart) the server and wait until it answers PING."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.socket_path.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                log = (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            if self.socket_path.exists():
                try:
                    client = connect(self.url)
                    try:
                        if client.ping():
                            return self
                    finally:
                        client.close()
                except (redis.ConnectionError, redis.BusyLoadingError):
                    pass
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server did not start within {timeout} s")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL: no shutdown save, like a crashed host."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        """Terminate the server; remove the directory if this object created it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
