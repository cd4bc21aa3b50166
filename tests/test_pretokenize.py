"""Tokenizing a newly admitted job never blocks the worker's step loop; the heartbeat carries the
served model's context (``max_model_len``, ``max_token_bytes``) for the API's length check."""

from __future__ import annotations

import threading
from typing import Any

from pagedserve.client import Client
from pagedserve.params import SamplingParams
from pagedserve.schemas import JobStatus
from pagedserve.store import JobStore
from tests.fixtures.workers import loop_once, run_loop_until
from worker.engine import Engine
from worker.pretokenize import max_token_bytes
from worker.service import ServiceConfig

LONG = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_tokenizing_runs_off_the_step_loop(
    make_worker: Any, redis_url: str, loop_engine: Engine
) -> None:
    store = JobStore(redis_url, lease_ms=60_000)
    w = make_worker(loop_engine, store, ServiceConfig(worker_id="w", redis_url=redis_url))
    # Tokenization of text is held until the test lets it go: a stand-in for a very long prompt.
    release, started = threading.Event(), threading.Event()
    real = w.pretok.tokenize

    def held(prompt, messages):  # type: ignore[no-untyped-def]
        started.set()
        assert release.wait(30)
        return real(prompt, messages)

    w.pretok.tokenize = held
    client = Client(redis_url)
    running = client.submit([5, 6, 7, 8], LONG)
    run_loop_until(w, lambda: loop_engine.has_unfinished())
    text_job = client.submit("Once upon a time", SHORT)
    run_loop_until(w, started.is_set)
    steps = loop_engine.stats().steps
    for _ in range(20):  # the loop keeps stepping the running job meanwhile
        loop_once(w)
    assert loop_engine.stats().steps >= steps + 20
    assert client.status(text_job) == JobStatus.RUNNING and text_job in w.jobs
    assert client.store.get(running).tokens_generated > 0  # type: ignore[union-attr]
    release.set()
    run_loop_until(w, lambda: client.status(text_job).terminal)
    rec = client.get(text_job)
    assert rec is not None and rec.status == JobStatus.SUCCEEDED, rec and rec.error
    # The same tokens as when the engine tokenizes the text itself.
    offline = Engine(loop_engine.model_dir, loop_engine.config)
    offline.add_request("x", "Once upon a time", SHORT)
    done = []
    while offline.has_unfinished():
        done += [o for o in offline.step() if o.finished]
    assert rec.result is not None
    assert rec.result.completions[0].token_ids == done[0].outputs[0].token_ids
    assert rec.result.prompt_tokens == len(done[0].prompt_token_ids)


def test_cancelled_while_tokenizing_and_template_errors(
    make_worker: Any, redis_url: str, loop_engine: Engine
) -> None:
    store = JobStore(redis_url, lease_ms=60_000)
    # An id of its own: no other worker of the suite may drain this worker's cancel set.
    w = make_worker(
        loop_engine, store, ServiceConfig(worker_id="pretok-cancel", redis_url=redis_url)
    )
    release = threading.Event()
    real = w.pretok.tokenize
    w.pretok.tokenize = lambda p, m: (release.wait(30), real(p, m))[1]
    client = Client(redis_url)
    jid = client.submit("to be cancelled", SHORT)
    run_loop_until(w, lambda: jid in w.jobs)
    client.cancel(jid)
    run_loop_until(w, lambda: client.status(jid).terminal)
    release.set()
    run_loop_until(w, lambda: not w.pretok.pending)
    loop_once(w)
    assert client.status(jid) == JobStatus.CANCELLED and not loop_engine.has_unfinished()
    # A tokenizer error fails the job with the reason; the worker goes on.
    w.pretok.tokenize = lambda p, m: (_ for _ in ()).throw(RuntimeError("no vocab"))
    bad = client.submit("x", SHORT)
    run_loop_until(w, lambda: client.status(bad).terminal)
    rec = client.get(bad)
    assert rec is not None and rec.status == JobStatus.FAILED
    assert rec.error == "rejected: RuntimeError: no vocab"


def test_heartbeat_carries_the_context(
    make_worker: Any, redis_url: str, loop_engine: Engine
) -> None:
    store = JobStore(redis_url)
    w = make_worker(loop_engine, store, ServiceConfig(worker_id="w", redis_url=redis_url))
    w._heartbeat()
    assert w.writer.flush(10)  # (written by the writer's thread)
    hb = store.workers()["w"]
    assert hb["max_model_len"] == 512 == loop_engine.max_model_len
    mtb = hb["max_token_bytes"]
    assert isinstance(mtb, int) and mtb >= 1 and mtb == max_token_bytes(loop_engine.tokenizer)
    # Sound: no token of the vocabulary decodes to more bytes than that.
    tok = loop_engine.tokenizer
    longest = max(len(tok.decode([i]).encode()) for i in range(len(tok)))
    assert longest <= mtb
