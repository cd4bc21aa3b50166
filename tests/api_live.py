"""Shared code of the live-API tests: ``pagedserve api`` as a real HTTP server in a subprocess
(gunicorn, as production runs it), a keep-alive JSON client on the standard library
(``http.client``), and small process probes.

``api_server(redis_url, log_path, ...)`` is a context manager: the server is started on a free
loopback port, waited for (``/healthz``), and always stopped (its whole process group: the
gunicorn master and its workers) when the block exits, also on failure.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.redis_util import URL_ENV

HOST = "127.0.0.1"


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the server may still lose a race)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@dataclass
class ApiServer:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the master (gunicorn stops its workers), then SIGKILL the process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        # The group is the master's (start_new_session): catches workers left behind either way.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection(HOST, port, timeout=1)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def launch_api(
    redis_url: str,
    log_path: Path,
    *,
    workers: int = 2,
    threads: int = 8,
    api_keys: str | None = None,
    dev: bool = False,
    timeout: float = 30.0,
    env_extra: dict[str, str] | None = None,
) -> ApiServer:
    """Start ``python -m stack api`` and wait for ``/healthz`` (retries a lost port race)."""
    env = dict(os.environ, **{URL_ENV: redis_url})
    env.pop("PAGEDSERVE_API_KEYS", None)
    env.update(env_extra or {})
    last = ""
    for _attempt in range(3):
        port = free_port()
        cmd = [sys.executable, "-m", "stack", "--redis", redis_url, "api"]
        cmd += ["--host", HOST, "--port", str(port)]
        cmd += ["--workers", str(workers), "--threads", str(threads)]
        if api_keys is not None:
            cmd += ["--api-keys", api_keys]
        if dev:
            cmd.append("--dev")
        with log_path.open("ab") as logf:
            proc = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        server = ApiServer(proc, port, log_path)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if _healthy(port):
                return server
            time.sleep(0.05)
        last = server.log()
        server.stop()
        if "Address already in use" not in last:
            break
    raise RuntimeError(f"pagedserve api did not come up:\n{last}")


@contextlib.contextmanager
def api_server(redis_url: str, log_path: Path, **kwargs: Any) -> Iterator[ApiServer]:
    server = launch_api(redis_url, log_path, **kwargs)
    try:
        yield server
    finally:
        server.stop()


class JsonClient:
    """One keep-alive HTTP/1.1 connection speaking JSON (not thread-safe: one per thread).

    A request that finds the connection closed by the server (keep-alive timeout) is sent again
    once on a fresh connection; callers make POSTs safe to resend with an idempotency key.
    """

    def __init__(self, port: int, api_key: str | None = None, timeout: float = 30.0) -> None:
        self.port = port
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
        self.reconnects = 0

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        for attempt in range(2):
            try:
                self.conn.request(method, path, body=data, headers=self.headers)
                resp = self.conn.getresponse()
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                self.conn = http.client.HTTPConnection(HOST, self.port, timeout=self.timeout)
                self.reconnects += 1
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get(self, path: str) -> Any:
        status, body = self.request("GET", path)
        assert status == 200, (path, status, body)
        return body

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> JsonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rss_kib(pid: int) -> int:
    """Resident set size of a live process (``VmRSS`` of /proc/PID/status), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")
