"""The Celery control plane: batch fan-out, finalize, expire, cancel, and ``pagedserve.generate``.

Generation requests never travel through Celery: ``pagedserve.generate`` submits a job to the Redis
job store and waits for it. Configured from the environment: ``PAGEDSERVE_REDIS_URL`` (broker and
result backend; ``unix://`` URLs become ``redis+socket://``), ``PAGEDSERVE_PREFIX``,
``PAGEDSERVE_FINALIZE_EVERY_S`` and ``PAGEDSERVE_EXPIRE_EVERY_S`` (beat periods). JSON only.

Run: ``celery -A pagedserve.celery_app worker -B --pool=solo`` (or ``pagedserve control-plane``).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any
from urllib.parse import parse_qs, urlparse

from celery import Celery

from pagedserve.batches import BatchStore
from pagedserve.client import Client
from pagedserve.keys import env_prefix
from pagedserve.redis_util import default_url


def celery_url(url: str) -> str:
    """A redis-py URL as kombu and Celery's Redis backend spell it (unix sockets differ)."""
    u = urlparse(url)
    if u.scheme != "unix":
        return url
    db = parse_qs(u.query).get("db", ["0"])[0]
    return f"redis+socket://{u.path}?virtual_host={db}"


def _prefix() -> str:
    return env_prefix()


def make_app(redis_url: str | None = None) -> Celery:
    url = celery_url(redis_url or default_url())
    app = Celery("pagedserve", broker=url, backend=url, set_as_current=False)
    finalize_s = float(os.environ.get("PAGEDSERVE_FINALIZE_EVERY_S", "2"))
    expire_s = float(os.environ.get("PAGEDSERVE_EXPIRE_EVERY_S", "30"))
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        result_expires=3600,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        beat_schedule_filename=os.path.join(
            tempfile.gettempdir(), f"pagedserve-beat-{os.getuid()}"
        ),
        beat_schedule={
            "finalize-ready": {"task": "batches.finalize_ready", "schedule": finalize_s},
            "expire": {"task": "batches.expire", "schedule": expire_s},
        },
    )
    _register(app, redis_url)
    return app


def _register(app: Celery, redis_url: str | None) -> None:
    def batches() -> BatchStore:
        return BatchStore(redis_url, prefix=_prefix())

    @app.task(name="batches.fan_out", shared=False)
    def fan_out(batch_id: str) -> dict[str, Any] | None:
        b = batches().fan_out(batch_id)
        return b.model_dump(mode="json") if b else None

    @app.task(name="batches.finalize_ready", shared=False)
    def finalize_ready() -> list[str]:
        return batches().finalize_ready()

    @app.task(name="batches.expire", shared=False)
    def expire() -> list[str]:
        return batches().expire()

    @app.task(name="batches.cancel", shared=False)
    def cancel(batch_id: str) -> dict[str, Any] | None:
        b = batches().cancel(batch_id)
        return b.model_dump(mode="json") if b else None

    @app.task(name="pagedserve.generate", shared=False)
    def generate(
        prompt_or_messages: Any,
        params: dict[str, Any] | None = None,
        priority: str = "interactive",
        timeout: float | None = None,
        model: str | None = None,
    ) -> dict[str, Any]:
        """Run one job through the job store; returns ``{id, status, result}``. Raises on a
        failed or cancelled job, and cancels the job on timeout."""
        with Client(redis_url, prefix=_prefix()) as client:
            job_id = client.submit(prompt_or_messages, params, priority=priority, model=model)  # type: ignore[arg-type]
            try:
                rec = client.wait(job_id, timeout=timeout)
            except TimeoutError:
                client.cancel(job_id)
                raise
        if rec.status != "succeeded":
            raise RuntimeError(f"job {job_id} {rec.status.value}: {rec.error or ''}")
        assert rec.result is not None
        return {
            "id": job_id,
            "status": rec.status.value,
            "result": rec.result.model_dump(mode="json"),
        }


app = make_app()
