"""The Celery control plane against a real worker subprocess (``worker -B --pool=solo``) and a
private redis-server on a unix socket (kombu and Celery's backend take ``redis+socket://``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery, chain, group

from pagedserve.batches import BatchStore
from pagedserve.openai_format import COMPLETIONS_URL
from pagedserve.redis_util import URL_ENV, LocalRedisServer
from pagedserve.schemas import Completion, JobResult
from pagedserve.store import Finish, JobStore
from stack.celery_app import make_app

from .fixtures.procs import stop_process
from .fixtures.redis_server import REDIS_BINARY

MODEL = "tiny"


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedisServer]:
    s = LocalRedisServer(binary=REDIS_BINARY).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def app(server: LocalRedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Celery]:
    env = dict(os.environ, **{URL_ENV: server.url}, PAGEDSERVE_FINALIZE_EVERY_S="0.5")
    log = tmp_path_factory.mktemp("celery") / "worker.log"
    celery_bin = str(Path(sys.executable).with_name("celery"))
    cmd = [celery_bin, "-A", "stack.celery_app", "worker", "-B", "--pool=solo",
           "--concurrency=1", "--loglevel=INFO", "--without-gossip", "--without-mingle",
           "-s", str(log.with_name("beat-schedule"))]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    a = make_app(server.url)
    try:
        deadline = time.monotonic() + 20
        while not (a.control.ping(timeout=0.5) or []):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "celery worker did not start"
        yield a
    finally:
        stop_process(proc, 10)


class PlayWorker:
    """A thread that claims jobs from the store and completes them (echoing the prompt)."""

    def __init__(self, url: str) -> None:
        self.store = JobStore(url)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for lease in self.store.claim("play", 8, block_ms=100):
                text = f"echo:{lease.request.prompt}"
                res = JobResult(
                    completions=[
                        Completion(index=0, text=text, token_ids=[1], finish_reason="stop")
                    ],
                    prompt_tokens=2,
                    completion_tokens=1,
                )
                self.store.commit_step(finished=[Finish(lease, "succeeded", result=res)])

    def __enter__(self) -> PlayWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def test_fan_out_and_beat_finalize(app: Celery, server: LocalRedisServer) -> None:
    bs = BatchStore(server.url, known_models=[MODEL])
    lines = [
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": COMPLETIONS_URL,
                    "body": {"model": MODEL, "prompt": f"p{i}", "max_tokens": 2}})
        for i in range(3)
    ]  # fmt: skip
    f = bs.files.create("\n".join(lines).encode(), "in.jsonl")
    b = bs.create(f.id, COMPLETIONS_URL)
    got = app.send_task("batches.fan_out", [b.id]).get(timeout=15)
    assert got["status"] == "in_progress" and got["request_counts"]["total"] == 3
    with PlayWorker(server.url):
        deadline = time.monotonic() + 15
        while (cur := bs.get(b.id)).status != "completed":  # beat's finalize_ready gets there
            assert time.monotonic() < deadline, cur
            time.sleep(0.1)
    out = [json.loads(x) for x in bs.files.content(cur.output_file_id).splitlines()]
    texts = {o["custom_id"]: o["response"]["body"]["choices"][0]["text"] for o in out}
    assert texts == {f"r{i}": f"echo:p{i}" for i in range(3)}
    assert cur.request_counts.completed == 3
    assert app.send_task("batches.finalize_ready").get(timeout=10) == []


def test_cancel_task(app: Celery, server: LocalRedisServer) -> None:
    bs = BatchStore(server.url, known_models=[MODEL])
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": COMPLETIONS_URL,
        "body": {"model": MODEL, "prompt": "x"},
    }
    f = bs.files.create(json.dumps(line).encode(), "in.jsonl")
    b = bs.create(f.id, COMPLETIONS_URL)
    bs.fan_out(b.id)
    got = app.send_task("batches.cancel", [b.id]).get(timeout=10)
    assert got["status"] == "cancelled"
    assert bs.jobs.statuses(bs.job_ids(b.id)) == ["cancelled"]


def test_generate_in_chain_and_group(app: Celery, server: LocalRedisServer) -> None:
    gen = app.signature("pagedserve.generate", kwargs={"params": {"max_tokens": 2}, "timeout": 20})
    pick = app.signature("celery.accumulate", kwargs={"index": 0})
    with PlayWorker(server.url):
        res = chain(gen.clone(args=("hello",)), pick).apply_async().get(timeout=20)
        assert res["status"] == "succeeded"
        assert res["result"]["completions"][0]["text"] == "echo:hello"
        both = group(gen.clone(args=(p,)) for p in ("a", "b")).apply_async().get(timeout=20)
    assert [r["result"]["completions"][0]["text"] for r in both] == ["echo:a", "echo:b"]
