"""``pagedserve demo`` and ``pagedserve up`` as real process trees: a private redis-server, a
worker, the Celery control plane and the API, started and stopped by the supervisor.

Each test runs the command as a subprocess under a temporary ``--home`` and a free API port, with
bounded waits, and checks afterwards that no process it started is left: neither the children the
supervisor reports (each leads its own session, so their own children, such as gunicorn workers or
celery beat, share its session id) nor anything whose command line names the temporary home.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.client import Client
from pagedserve.keys import DEFAULT_PREFIX

#: Test-sized worker options (passed through the supervisor's --worker-arg).
WORKER_ARGS = (
    "--worker-arg=--num-threads=1",
    "--worker-arg=--num-kv-blocks=256",
    "--worker-arg=--block-size=16",
    "--worker-arg=--max-model-len=512",
    "--worker-arg=--log-level=WARNING",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(tmp: Path) -> dict[str, str]:
    """Our environment without any Redis URL or prefix (so the supervisor starts its own Redis),
    with quick control-plane beats and one thread per process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env.update(OMP_NUM_THREADS="1", PAGEDSERVE_FINALIZE_EVERY_S="0.5", TMPDIR=str(tmp))
    return env


def _session_and_state(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session ...
    return int(fields[3]), fields[0]


def leftovers(home: Path, sessions: set[int]) -> list[str]:
    """Live processes in one of ``sessions`` or whose command line mentions ``home``."""
    out = []
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        pid = int(d.name)
        got = _session_and_state(pid)
        if got is None or got[1] == "Z":
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if got[0] in sessions or str(home) in cmd:
            out.append(f"{pid}: {cmd[:200]}")
    return out


def wait_no_leftovers(home: Path, sessions: set[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := leftovers(home, sessions)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left running: {left}"


def child_sessions(pids: dict[str, int]) -> set[int]:
    return {pid for name, pid in pids.items() if name != "supervisor"}


def kill_all(proc: subprocess.Popen[bytes], sessions: set[int]) -> None:
    """Teardown after a failure: the supervisor and every child's process group."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
    for sid in sessions:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(sid, signal.SIGKILL)


def logs(home: Path) -> str:
    parts = []
    for f in sorted((home / "logs").glob("*.log")):
        parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}")
    return "\n".join(parts)


def test_demo_runs_and_leaves_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    cmd = [sys.executable, "-m", "pagedserve", "demo", "--home", str(home)]
    cmd += ["--port", str(free_port()), "--jobs", "4", "--grace-s", "10", *WORKER_ARGS]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_for(tmp_path)
    )
    sessions: set[int] = set()
    try:
        try:
            out, err = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=10)
            pytest.fail(f"demo timed out:\n{err.decode()[-3000:]}\n{logs(home)}")
        text = err.decode(errors="replace")
        assert proc.returncode == 0, f"{text[-3000:]}\n{logs(home)}"
        up = json.loads(next(x for x in text.splitlines() if x.startswith('{"up"')))
        summary = json.loads(out)
        sessions = child_sessions(summary["pids"]) | child_sessions(up["pids"])
        assert set(up["up"]) == {"worker", "control-plane", "api"}
        assert {"redis", "worker", "control-plane", "api"} <= set(summary["pids"])
        assert summary["jobs"] == 4 and summary["statuses"] == {"succeeded": 4}
        assert summary["sample"]["completion"]
        batch = summary["batch"]
        assert batch["status"] == "completed" and batch["output_file_id"]
        assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert summary["look"]["api"].startswith("http://127.0.0.1:")
        assert (home / "models" / "tiny-llama" / "config.json").exists()  # built on the fly
        wait_no_leftovers(home, sessions)
    finally:
        kill_all(proc, sessions)


def read_json_line(proc: subprocess.Popen[bytes], timeout: float) -> dict:
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(b"{"):
                return json.loads(line)
        elif proc.poll() is not None:
            break
    raise AssertionError(f"no JSON line from `up` (exit {proc.poll()})")


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


@pytest.fixture
def up_proc(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple]:
    home = tmp_path / "home"
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve", "up", "--home", str(home), "--port", str(port)]
    cmd += ["--model", str(tiny_model_dir), "--grace-s", "10", *WORKER_ARGS]
    with (tmp_path / "up.stderr").open("wb") as errf:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, env=env_for(tmp_path))
    sessions: set[int] = set()
    try:
        yield proc, home, port, sessions
    finally:
        kill_all(proc, sessions)
        if proc.stdout is not None:
            proc.stdout.close()


def test_up_serves_and_stops_on_sigint(up_proc: tuple) -> None:
    proc, home, port, sessions = up_proc
    up = read_json_line(proc, timeout=60)
    sessions |= child_sessions(up["pids"])
    assert (
        set(up["up"]) == {"worker", "control-plane", "api"} and up["pids"]["supervisor"] == proc.pid
    )
    base = f"http://127.0.0.1:{port}"
    assert up["api"] == base
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if http_status(f"{base}/healthz") == 200 and http_status(f"{base}/readyz") == 200:
            break
        assert proc.poll() is None, logs(home)
        time.sleep(0.3)
    else:
        pytest.fail(f"/healthz and /readyz not both 200 within 60 s\n{logs(home)}")

    with Client(up["redis"], prefix=DEFAULT_PREFIX) as client:
        job = client.submit("Hello there", {"max_tokens": 8, "temperature": 0})
        rec = client.wait(job, timeout=60)
    assert rec.status == "succeeded", rec.error
    assert rec.result is not None and rec.result.completion_tokens > 0

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=40) == 0, logs(home)
    wait_no_leftovers(home, sessions)
