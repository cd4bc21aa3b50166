"""Sending control-plane tasks by name: the Celery side of the contract.

The task names are the wire contract between a sender (the API, the CLI, a user's Celery
pipeline) and the control plane that runs them (:mod:`stack.celery_app`): sending needs only the
names and a Celery app configured like the control plane's (the same broker, result backend and
JSON-only serialization), never the task code. ``unix://`` Redis URLs become ``redis+socket://``;
Sentinel URLs kombu's ``sentinel://`` list with the master name as a transport option. kombu
has no Redis Cluster transport: with the job store on a cluster, ``PAGEDSERVE_BROKER_URL`` names
a single Redis (or Sentinel) for the tasks.
"""

from __future__ import annotations

from celery import Celery

from pagedserve.redis_url import kombu_options
from pagedserve.redis_util import default_url
from pagedserve.settings import BROKER_URL

#: Task names, as senders and the control plane spell them (changing one breaks the wire).
FAN_OUT = "batches.fan_out"
FINALIZE_READY = "batches.finalize_ready"
EXPIRE = "batches.expire"
CANCEL = "batches.cancel"
GENERATE = "pagedserve.generate"


def celery_url(url: str) -> str:
    """A redis-py URL as kombu and Celery's Redis backend spell it (unix sockets and Sentinel
    differ; a Sentinel URL's master name goes in the transport options: see make_sender)."""
    return kombu_options(url)[0]


def make_sender(redis_url: str | None = None) -> Celery:
    """A Celery app that sends tasks by name and reads their JSON results; it registers none.
    Its broker is ``PAGEDSERVE_BROKER_URL`` when set, else ``redis_url``."""
    url, transport = kombu_options(BROKER_URL.raw() or redis_url or default_url())
    app = Celery("pagedserve", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        broker_transport_options=transport,
        result_backend_transport_options=transport,
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        result_expires=3600,
        broker_connection_retry_on_startup=True,
    )
    return app
