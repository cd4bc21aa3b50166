"""The Celery control plane: batch fan-out, finalize, expire, cancel, and ``pagedserve.generate``.

Generation requests never travel through Celery: ``pagedserve.generate`` submits a job to the Redis
job store and waits for it. Configured from the environment: ``PAGEDSERVE_REDIS_URL`` (broker and
result backend; ``unix://`` URLs become ``redis+socket://``), ``PAGEDSERVE_PREFIX``,
``PAGEDSERVE_FINALIZE_EVERY_S`` and ``PAGEDSERVE_EXPIRE_EVERY_S`` (beat periods). JSON only.

Run: ``celery -A stack.celery_app worker -B --pool=solo`` (or ``pagedserve control-plane``).
Senders need none of this module: :mod:`pagedserve.celery_client` holds the task names and the
app that sends them.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from celery import Celery

from pagedserve import settings
from pagedserve.batches import BatchStore
from pagedserve.celery_client import (
    CANCEL,
    EXPIRE,
    FAN_OUT,
    FINALIZE_READY,
    GENERATE,
    make_sender,
)
from pagedserve.client import Client
from pagedserve.keys import env_prefix


def _prefix() -> str:
    return env_prefix()


def make_app(redis_url: str | None = None) -> Celery:
    """The control plane: the sender's configuration, the worker's settings, beat, the tasks."""
    app = make_sender(redis_url)
    finalize_s = settings.FINALIZE_EVERY_S.number()
    expire_s = settings.EXPIRE_EVERY_S.number()
    app.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        beat_schedule_filename=os.path.join(
            tempfile.gettempdir(), f"pagedserve-beat-{os.getuid()}"
        ),
        beat_schedule={
            "finalize-ready": {"task": FINALIZE_READY, "schedule": finalize_s},
            "expire": {"task": EXPIRE, "schedule": expire_s},
        },
    )
    _register(app, redis_url)
    return app


def _register(app: Celery, redis_url: str | None) -> None:
    def batches() -> BatchStore:
        return BatchStore(redis_url, prefix=_prefix())

    @app.task(name=FAN_OUT, shared=False)
    def fan_out(batch_id: str) -> dict[str, Any] | None:
        b = batches().fan_out(batch_id)
        return b.model_dump(mode="json") if b else None

    @app.task(name=FINALIZE_READY, shared=False)
    def finalize_ready() -> list[str]:
        return batches().finalize_ready()

    @app.task(name=EXPIRE, shared=False)
    def expire() -> list[str]:
        return batches().expire()

    @app.task(name=CANCEL, shared=False)
    def cancel(batch_id: str) -> dict[str, Any] | None:
        b = batches().cancel(batch_id)
        return b.model_dump(mode="json") if b else None

    @app.task(name=GENERATE, shared=False)
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
