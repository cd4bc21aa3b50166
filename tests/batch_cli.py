"""A batch end to end the way an operator runs one: the Celery control plane as a process, then
``pagedserve [connection flags] batch submit FILE --wait --output OUT`` (shared by the Sentinel
and Cluster tests, which differ only in how each process reaches Redis)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.fixtures.procs import stop_process


def run_cli_batch(
    tmp_path: Path, model: str, env: Mapping[str, str], connection: Sequence[str], n: int,
    timeout: float,
) -> dict[str, Any]:  # fmt: skip
    """Submit ``n`` completion lines, wait for the batch; check every line answered 200 once;
    returns the batch object the CLI printed."""
    env = {**env, "PAGEDSERVE_FINALIZE_EVERY_S": "0.5"}
    log = tmp_path / "celery.log"
    with log.open("wb") as out:
        plane = subprocess.Popen([sys.executable, "-m", "stack", "control-plane"], env=env,
                                 stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        lines = [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": f"line {i}", "max_tokens": 5, "temperature": 0}}
            for i in range(n)
        ]  # fmt: skip
        src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_text("".join(json.dumps(x) + "\n" for x in lines))
        got = subprocess.run(
            [sys.executable, "-m", "stack", *connection, "batch", "submit", str(src),
             "--wait", "--poll", "0.2", "--output", str(dst)],
            capture_output=True, text=True, timeout=timeout, env=env,
        )  # fmt: skip
        assert got.returncode == 0, (got.stdout, got.stderr[-2000:], log.read_text()[-2000:])
        batch = json.loads(got.stdout.strip().splitlines()[-1])
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == n
        out = [json.loads(x) for x in dst.read_text().splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(n))
        assert all(o["response"]["status_code"] == 200 for o in out)
        return batch
    finally:
        stop_process(plane, 15)
