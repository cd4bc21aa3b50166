"""The live stack of the online tests: a private redis-server, one real worker on the tiny
Llama checkpoint and ``pagedserve api`` under gunicorn (``threads`` enough for 64 streams),
module-scoped (``from tests.online_live import stack`` in a test module)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pagedserve.redis_util import LocalRedisServer
from pagedserve.store import JobStore
from tests.api_live import ApiServer, launch_api
from tests.fixtures.models import MakeTinyModel
from tests.fixtures.redis_server import REDIS_BINARY
from tests.fixtures.workers import WorkerProcess, launch_worker


@dataclass
class Stack:
    redis_url: str
    api: ApiServer
    worker: WorkerProcess
    model_dir: Path
    model: str

    @property
    def base_url(self) -> str:
        return f"{self.api.base_url}/v1"

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0)


@contextlib.contextmanager
def live_stack(tmp: Path, model_dir: Path, *worker_args: str, threads: int = 72) -> Iterator[Stack]:
    """Redis, one worker on ``model_dir`` and the API (2 gunicorn workers), stopped on exit."""
    server = LocalRedisServer(binary=REDIS_BINARY).start()
    worker = launch_worker(server.url, model_dir, "online-w", tmp / "worker.log", *worker_args)
    api: ApiServer | None = None
    try:
        worker.wait_ready(timeout=180)
        api = launch_api(server.url, tmp / "api.log", workers=2, threads=threads)
        hb = JobStore(server.url).workers()["online-w"]
        yield Stack(server.url, api, worker, model_dir, hb["model"])
    finally:
        if api is not None:
            api.stop()
        worker.kill()
        server.stop()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, make_tiny_model: MakeTinyModel
) -> Iterator[Stack]:
    with live_stack(tmp_path_factory.mktemp("online"), make_tiny_model("llama")) as s:
        yield s
