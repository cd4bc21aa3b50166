"""The pagedserve CLI as users run it: ``python -m stack`` subprocesses against the fixture
server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from pagedserve.redis_util import URL_ENV
from pagedserve.schemas import JobStatus
from pagedserve.store import JobStore
from stack.cli import _split_delegated


def cli(redis_url: str, *args: str) -> tuple[int, Any]:
    env = {k: v for k, v in os.environ.items() if k != URL_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "stack", "--redis", redis_url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.stdout.count("\n") == 1, (proc.stdout, proc.stderr)
    return proc.returncode, json.loads(proc.stdout)


def test_submit_status_cancel(redis_url: str) -> None:
    rc, out = cli(
        redis_url,
        "submit",
        "hello there",
        "--max-tokens",
        "7",
        "--temperature",
        "0",
        "--priority",
        "bulk",
        "--stop",
        "\n",
        "--metadata",
        '{"team": "a"}',
    )
    assert rc == 0
    jid = out["id"]
    rec = JobStore(redis_url).get(jid)
    assert rec is not None and rec.priority == "bulk"
    assert rec.request.params.max_tokens == 7 and rec.request.params.stop == ["\n"]
    assert rec.request.metadata == {"team": "a"}

    rc, out = cli(redis_url, "status", jid)
    assert rc == 0 and out["id"] == jid and out["status"] == "queued"
    assert out["request"]["prompt"] == "hello there"

    rc, out = cli(redis_url, "cancel", jid)
    assert (rc, out) == (0, {"id": jid, "status": "cancelled"})
    assert JobStore(redis_url).status(jid) == JobStatus.CANCELLED

    rc, out = cli(redis_url, "status", "nope")
    assert (rc, out) == (1, {"id": "nope", "status": "not_found"})


def test_submit_chat_and_wait_timeout(redis_url: str) -> None:
    msgs = json.dumps([{"role": "user", "content": "hi"}])
    rc, out = cli(redis_url, "submit", msgs, "--chat", "--wait", "--timeout", "0.2")
    assert rc == 3 and "still queued" in out["error"]
    rec = JobStore(redis_url).get(out["id"])
    assert rec is not None and rec.request.messages is not None


def test_invalid_request_is_reported(redis_url: str) -> None:
    rc, out = cli(redis_url, "submit", "x", "--temperature", "-3")
    assert rc == 2 and out["error"] == "invalid request"
    assert "temperature" in out["detail"]
    assert JobStore(redis_url).queue_lengths() == {"interactive": 0, "bulk": 0}


def test_light_subcommands_do_not_import_torch(redis_url: str) -> None:
    code = (
        "import sys; from stack.cli import main; "
        f"main(['--redis', {redis_url!r}, 'status', 'x']); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'flask', 'worker')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout.splitlines()[-1] == "[]"


def test_delegated_subcommands_split_their_arguments() -> None:
    assert _split_delegated(["worker", "--gpu", "0"]) == ({}, "worker.service", ["--gpu", "0"])
    assert _split_delegated(["--redis", "unix:///s", "--prefix=p", "make-model", "--out", "d"]) == (
        {"redis": "unix:///s", "prefix": "p"},
        "worker.make_model",
        ["--out", "d"],
    )
    assert _split_delegated(["submit", "worker"]) is None
    assert _split_delegated(["--redis", "u", "status", "x"]) is None


def test_python_m_pagedserve_points_to_the_cli() -> None:
    """The contract package does not import the application layer, so its ``__main__`` cannot be
    the CLI: it exits 2 and names the CLI's two spellings, having imported nothing of ``stack``."""
    code = (
        "import runpy, sys\n"
        "try:\n    runpy.run_module('pagedserve', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print(e.code, sorted(m for m in sys.modules if m.split('.')[0] == 'stack'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "2 []"
    assert "python -m stack" in proc.stderr and "`pagedserve`" in proc.stderr
