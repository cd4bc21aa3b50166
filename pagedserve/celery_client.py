"""Sending control-plane tasks by name: the Celery side of the contract.

The task names are the wire contract between a sender (the API, the CLI, a user's Celery
pipeline) and the control plane that runs them (:mod:`stack.celery_app`): sending needs only the
names and a Celery app configured like the control plane's (the same broker, result backend and
JSON-only serialization), never the task code. ``unix://`` Redis URLs become ``redis+socket://``.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

from celery import Celery

from pagedserve.redis_util import default_url

#: Task names, as senders and the control plane spell them (changing one breaks the wire).
FAN_OUT = "batches.fan_out"
FINALIZE_READY = "batches.finalize_ready"
EXPIRE = "batches.expire"
CANCEL = "batches.cancel"
GENERATE = "pagedserve.generate"


def celery_url(url: str) -> str:
    """A redis-py URL as kombu and Celery's Redis backend spell it (unix sockets differ)."""
    u = urlparse(url)
    if u.scheme != "unix":
        return url
    db = parse_qs(u.query).get("db", ["0"])[0]
    return f"redis+socket://{u.path}?virtual_host={db}"


def make_sender(redis_url: str | None = None) -> Celery:
    """A Celery app that sends tasks by name and reads their JSON results; it registers none."""
    url = celery_url(redis_url or default_url())
    app = Celery("pagedserve", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        result_expires=3600,
        broker_connection_retry_on_startup=True,
    )
    return app
