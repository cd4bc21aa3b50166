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
import re
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
from stack.demo import BATCH_QUESTIONS, DEMO_QUESTIONS
from stack.supervisor import RestartPolicy
from worker.model_source import DEFAULT_MODEL_NAME, default_model_path

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
    """The demo serves the embedded default when its wheel is installed (else the tiny random
    model, built on the fly): its greedy answers to simple questions, asked as chat jobs and as
    batch lines, are right, and the batch's output file holds them."""
    real = default_model_path() is not None
    home = tmp_path / "home"
    cmd = [sys.executable, "-m", "stack", "demo", "--home", str(home)]
    cmd += ["--port", str(free_port()), "--jobs", "4", "--batch-lines", "16", "--grace-s", "10"]
    proc = subprocess.Popen(
        [*cmd, *WORKER_ARGS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_for(tmp_path)
    )
    sessions: set[int] = set()
    try:
        try:
            out, err = proc.communicate(timeout=300)
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
        answers = [a["answer"] for a in summary["answers"]]
        assert [a["question"] for a in summary["answers"]] == list(DEMO_QUESTIONS[:4])
        assert all(answers)
        batch = summary["batch"]
        assert batch["status"] == "completed" and batch["output_file_id"]
        assert batch["request_counts"] == {"total": 16, "completed": 16, "failed": 0}
        lines = [json.loads(x) for x in Path(batch["output_path"]).read_text().splitlines()]
        assert sorted(x["custom_id"] for x in lines) == sorted(f"q-{i}" for i in range(16))
        by_id = {x["custom_id"]: x["response"]["body"] for x in lines}
        assert all(b["choices"][0]["message"]["content"] for b in by_id.values())
        assert {b["model"] for b in by_id.values()} == {summary["model"]}
        assert summary["look"]["api"].startswith("http://127.0.0.1:")
        if real:
            assert summary["model"] == DEFAULT_MODEL_NAME
            assert "serving the embedded default" in text
            assert "Paris" in answers[0] and re.search(r"\b4\b", answers[1]), answers
            assert BATCH_QUESTIONS[0] == "What is the capital of France?"
            assert "Paris" in by_id["q-0"]["choices"][0]["message"]["content"]
            assert BATCH_QUESTIONS[15] == "What is 2+2?"
            assert re.search(r"\b4\b", by_id["q-15"]["choices"][0]["message"]["content"])
            assert not (home / "models").exists()  # nothing built
        else:
            assert summary["model"] == "tiny-llama" and "tiny RANDOM model" in text
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
    cmd = [sys.executable, "-m", "stack", "up", "--home", str(home), "--port", str(port)]
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


# ------------------------------------------------------------------------------ restart policy
def test_restart_policy_backs_off_and_forgets_old_restarts() -> None:
    policy = RestartPolicy(backoff_s=0.5, max_backoff_s=3.0, max_restarts=3, window_s=60.0)
    assert [policy.backoff(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.recent([10.0, 50.0, 100.0], now=105.0) == [50.0, 100.0]


def wait_until_healthy(proc: subprocess.Popen[bytes], home: Path, base: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if http_status(f"{base}/healthz") == 200 and http_status(f"{base}/readyz") == 200:
            return
        assert proc.poll() is None, logs(home)
        time.sleep(0.3)
    pytest.fail(f"/healthz and /readyz not both 200 within 60 s\n{logs(home)}")


def worker_pid(client: Client, timeout: float, not_pid: int | None = None) -> int:
    """The pid in local-worker-0's heartbeat, once it differs from ``not_pid``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hb = client.store.workers().get("local-worker-0")
        if hb is not None and hb.get("pid") not in (None, not_pid):
            return int(hb["pid"])
        time.sleep(0.2)
    raise AssertionError(f"no heartbeat from a worker other than pid {not_pid} in {timeout} s")


def test_up_restarts_a_killed_worker_and_counts_it(up_proc: tuple) -> None:
    proc, home, port, sessions = up_proc
    up = read_json_line(proc, timeout=60)
    sessions |= child_sessions(up["pids"])
    base = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, home, base)
    with Client(up["redis"], prefix=DEFAULT_PREFIX) as client:
        old = worker_pid(client, timeout=60)
        assert old == up["pids"]["worker"]
        params = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}
        jobs = client.submit_many([f"job {i}" for i in range(8)], params)
        os.kill(old, signal.SIGKILL)
        new = worker_pid(client, timeout=60, not_pid=old)
        sessions.add(new)  # the restarted worker leads its own session too
        jobs.append(client.submit("after the restart", params))
        recs = [client.wait(j, timeout=90) for j in jobs]
    assert [r.status for r in recs] == ["succeeded"] * len(jobs), [r.error for r in recs]
    assert all(r.result is not None and r.result.completion_tokens == 64 for r in recs)
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert 'pagedserve:child_restarts_total{child="worker"} 1.0' in metrics, metrics[-2000:]
    assert "restarting in" in (home.parent / "up.stderr").read_text()

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=40) == 0, logs(home)
    wait_no_leftovers(home, sessions)


def test_up_stops_everything_when_a_child_crash_loops(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A worker that can never start (an unknown option) is restarted twice, then `up` gives up."""
    home = tmp_path / "home"
    cmd = [sys.executable, "-m", "stack", "up", "--home", str(home), "--no-api"]
    cmd += ["--no-control-plane", "--model", str(tiny_model_dir), "--max-restarts", "2"]
    cmd += ["--restart-backoff-s", "0.1", "--worker-arg=--no-such-option"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_for(tmp_path)
    )
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        kill_all(proc, set())
    text = err.decode(errors="replace")
    assert proc.returncode == 1, text[-3000:]
    assert text.count("restarting in") == 2 and "crash loop" in text, text[-3000:]
    up = json.loads(out.decode().splitlines()[0])
    assert up["up"] == ["worker"]
    wait_no_leftovers(home, child_sessions(up["pids"]))
