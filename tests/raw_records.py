"""Jobs whose stored request was written by something other than today's client (a pre-upgrade
record, a broken client, a tampered hash): how tests put such a record in the queue."""

from __future__ import annotations

from pagedserve.client import new_job_id
from pagedserve.schemas import JobRequest
from pagedserve.store import JobStore


def inject(store: JobStore, raw_request: str) -> str:
    """Queue a job whose stored request is ``raw_request``, bypassing validation; its id."""
    jid = new_job_id()
    keys, args = store.enqueue_args(jid, JobRequest(prompt=[1]))
    store.ensure_groups()
    store.load_scripts()
    pipe = store.r.pipeline(transaction=True)
    jid = args[0]  # the store's pick (an id in the right shard on a cluster)
    pipe.execute_command("EVALSHA", store.script("enqueue").sha, len(keys), *keys, *args)
    pipe.hset(store.keys.job(jid), "request", raw_request)
    pipe.execute()
    return jid
