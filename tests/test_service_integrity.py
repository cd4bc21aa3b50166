"""A real worker against jobs that try to reach into batches or break their own writes, and a
follower of a job whose worker is killed mid-run."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from pagedserve.batches import BatchStore
from pagedserve.client import Client, accumulate, new_job_id
from pagedserve.openai_format import COMPLETIONS_URL
from pagedserve.schemas import DeltaEvent, JobRequest, JobStatus
from pagedserve.store import JobStore
from tests.fixtures.workers import StartWorker, wait_for
from tests.raw_records import inject

SHORT = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def model_dir(make_tiny_model) -> Path:  # type: ignore[no-untyped-def]
    return make_tiny_model("llama")


def batch_file(model: str, cids: list[str]) -> str:
    out = []
    for c in cids:
        body = {"model": model, "prompt": f"say {c}", "max_tokens": 3, "temperature": 0}
        out.append(json.dumps({"custom_id": c, "method": "POST", "url": COMPLETIONS_URL,
                               "body": body}))  # fmt: skip
    return "\n".join(out) + "\n"


def test_spoofed_batch_ids_never_reach_a_batch_or_stop_the_worker(
    redis_url: str, model_dir: Path, start_worker: StartWorker
) -> None:
    bs = BatchStore(JobStore(redis_url))
    client = Client(redis_url)
    f = bs.files.create(batch_file(model_dir.name, [f"r{i}" for i in range(6)]), "in.jsonl")
    bid = bs.create(f.id, COMPLETIONS_URL).id
    bs.fan_out(bid)
    spoofed = [
        inject(client.store, json.dumps({"prompt": "x", "params": SHORT, "metadata": m}))
        for m in (
            {"batch_id": bid, "custom_id": "evil"},
            {"batch_id": f"{bid}:jobs", "custom_id": "evil"},
            {"batch_id": f"{bid}:output", "custom_id": "evil"},
            {"batch_id": bid},
        )
    ]
    w = start_worker(redis_url, model_dir, "w")
    recs = client.wait_many(spoofed + bs.job_ids(bid), timeout=60)
    assert [r.status for r in recs] == [JobStatus.SUCCEEDED] * 10
    wait_for(lambda: bs.finalize_ready() == [bid], what="the batch to finalize")
    done = bs.get(bid)
    assert done is not None and done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 6, "completed": 6, "failed": 0}
    text = bs.files.content(done.output_file_id or "") or ""
    assert sorted(json.loads(x)["custom_id"] for x in text.split("\n") if x) == [
        f"r{i}" for i in range(6)
    ]
    assert w.proc.poll() is None
    assert client.wait(client.submit("after", SHORT), timeout=30).status == JobStatus.SUCCEEDED


def test_a_job_whose_writes_raise_fails_and_the_worker_goes_on(
    redis_url: str, model_dir: Path, start_worker: StartWorker
) -> None:
    client = Client(redis_url)
    store = client.store
    w = start_worker(redis_url, model_dir, "w")
    # A job whose events key is not a stream: its progress write raises WRONGTYPE.
    broken = new_job_id()
    keys, args = store.enqueue_args(broken, JobRequest(prompt="x", params=SHORT))  # type: ignore[arg-type]
    pipe = store.r.pipeline(transaction=True)
    pipe.set(store.keys.events(broken), "not a stream")
    pipe.execute_command("EVALSHA", store.script("enqueue").sha, len(keys), *keys, *args)
    store.load_scripts()
    pipe.execute()
    # A queued entry whose job key is not a hash: its lease raises WRONGTYPE. Broken in the
    # enqueue's own transaction: an idle worker claims a new job within milliseconds, and one
    # leased before the key was replaced would fail as a job, not be dead-lettered.
    gone = new_job_id()
    keys, args = store.enqueue_args(gone, JobRequest(prompt="y", params=SHORT))  # type: ignore[arg-type]
    pipe = store.r.pipeline(transaction=True)
    pipe.execute_command("EVALSHA", store.script("enqueue").sha, len(keys), *keys, *args)
    pipe.delete(store.keys.job(gone))
    pipe.set(store.keys.job(gone), "not a hash")
    pipe.execute()
    nxt = client.submit("the next job", SHORT)
    assert client.wait(nxt, timeout=60).status == JobStatus.SUCCEEDED
    wait_for(lambda: store.status(broken).terminal, what="the broken job to end")
    rec = store.r.hgetall(store.keys.job(broken))
    assert rec["status"] == "failed" and "WRONGTYPE" in rec["error"], rec
    dead = wait_for(store.dead_letters, what="a dead letter")
    assert [d["job"] for d in dead] == [gone] and "WRONGTYPE" in dead[0]["reason"]
    assert w.proc.poll() is None
    assert client.wait(client.submit("and one more", SHORT), timeout=30).status == "succeeded"


def test_follower_of_a_reclaimed_job_sees_its_result_exactly(
    redis_url: str, model_dir: Path, start_worker: StartWorker
) -> None:
    client = Client(redis_url)
    # Long enough that worker "a" is still generating when it is killed: with 240 tokens it
    # had finished between the poll that saw 40 and the kill in 5 of 8 runs on a Zen 4 (the
    # tiny model steps in about a millisecond), and the job then succeeded on "a". The test
    # workers' context (512) would end the job at 500: both get the model's 2048.
    max_tokens = 2000
    long_context = ("--max-model-len", "2048")
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    jid = client.submit([7] * 12, params)
    events: list[DeltaEvent] = []
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            events.extend(Client(redis_url).stream(jid, timeout=120))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=follow)
    t.start()
    a = start_worker(redis_url, model_dir, "a", *long_context)
    wait_for(lambda: (r := client.get(jid)) and r.tokens_generated >= 40, what="40 tokens")
    a.kill()
    start_worker(redis_url, model_dir, "b", *long_context)
    rec = client.wait(jid, timeout=120)
    t.join(timeout=30)
    assert not errors and rec.status == JobStatus.SUCCEEDED and rec.worker == "b"
    assert rec.result is not None
    types: list[Any] = [e.type for e in events]
    assert types.count("restart") == 1 and types[-1] == "end"
    acc = accumulate(events)
    assert acc.token_ids == {0: rec.result.completions[0].token_ids}
    assert acc.texts == {0: rec.result.completions[0].text} and acc.restarts == 1
    assert len(rec.result.completions[0].token_ids) == max_tokens


def test_job_state_replay_resends_everything_after_a_restart(redis_url: str) -> None:
    """A job re-delivered to the worker that still runs it (it reclaimed its own entry) gets a
    restart event from the lease; the worker then sends all it has so far again, so that a
    follower that started over ends with the whole text."""
    from worker.outputs import CompletionOutput, RequestOutput
    from worker.service import JobState

    def output(ids: list[int], text: str) -> RequestOutput:  # the engine's cumulative output
        return RequestOutput(jid, [7], [CompletionOutput(0, ids, text, num_new_tokens=1)])

    client = Client(redis_url)
    store = client.store
    jid = client.submit("p", SHORT)
    (first,) = store.claim("w", 1)
    st = JobState(first, 0.0, 4)
    st.observe(output([1, 2], "ab"))
    assert store.commit_step(progress=st.take_progress()).lost == []
    st.observe(output([1, 2, 3], "abc"))  # the last token not sent yet
    (again,) = store.reclaim("w", 0, 1)
    assert again.deliveries == 2
    st.lease = again
    st.replay()
    assert store.commit_step(progress=st.take_progress()).lost == []
    events = [DeltaEvent.from_stream(i, f) for i, f in store.r.xrange(store.keys.events(jid))]
    acc = accumulate(events)
    assert acc.restarts == 1 and acc.token_ids == {0: [1, 2, 3]} and acc.texts == {0: "abc"}
