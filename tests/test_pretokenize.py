"""Tokenizing a newly admitted job never blocks the worker's step loop; the heartbeat carries the
served model's context (``max_model_len``, ``max_token_bytes``) for the API's length check."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from pagedserve.client import Client
from pagedserve.params import SamplingParams
from pagedserve.schemas import JobStatus
from pagedserve.store import JobStore
from worker.engine import Engine
from worker.outputs import EngineConfig
from worker.pretokenize import max_token_bytes
from worker.service import ServiceConfig, Worker

LONG = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(make_tiny_model) -> Engine:  # type: ignore[no-untyped-def]
    cfg = EngineConfig(num_kv_blocks=256, max_model_len=512, num_threads=1)
    return Engine(make_tiny_model("llama"), cfg)


def loop_once(w: Worker) -> None:
    w.housekeeping()
    w.step()
    w.commit()


def run_until(w: Worker, cond, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        loop_once(w)


def test_tokenizing_runs_off_the_step_loop(
    make_worker: Any, redis_url: str, engine: Engine
) -> None:
    store = JobStore(redis_url, lease_ms=60_000)
    w = make_worker(engine, store, ServiceConfig(worker_id="w", redis_url=redis_url))
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
    run_until(w, lambda: engine.has_unfinished())
    text_job = client.submit("Once upon a time", SHORT)
    run_until(w, started.is_set)
    steps = engine.stats().steps
    for _ in range(20):  # the loop keeps stepping the running job meanwhile
        loop_once(w)
    assert engine.stats().steps >= steps + 20
    assert client.status(text_job) == JobStatus.RUNNING and text_job in w.jobs
    assert client.store.get(running).tokens_generated > 0  # type: ignore[union-attr]
    release.set()
    run_until(w, lambda: client.status(text_job).terminal)
    rec = client.get(text_job)
    assert rec is not None and rec.status == JobStatus.SUCCEEDED, rec and rec.error
    # The same tokens as when the engine tokenizes the text itself.
    offline = Engine(engine.model_dir, engine.config)
    offline.add_request("x", "Once upon a time", SHORT)
    done = []
    while offline.has_unfinished():
        done += [o for o in offline.step() if o.finished]
    assert rec.result is not None
    assert rec.result.completions[0].token_ids == done[0].outputs[0].token_ids
    assert rec.result.prompt_tokens == len(done[0].prompt_token_ids)


def test_cancelled_while_tokenizing_and_template_errors(
    make_worker: Any, redis_url: str, engine: Engine
) -> None:
    store = JobStore(redis_url, lease_ms=60_000)
    # An id of its own: no other worker of the suite may drain this worker's cancel set.
    w = make_worker(engine, store, ServiceConfig(worker_id="pretok-cancel", redis_url=redis_url))
    release = threading.Event()
    real = w.pretok.tokenize
    w.pretok.tokenize = lambda p, m: (release.wait(30), real(p, m))[1]
    client = Client(redis_url)
    jid = client.submit("to be cancelled", SHORT)
    run_until(w, lambda: jid in w.jobs)
    client.cancel(jid)
    run_until(w, lambda: client.status(jid).terminal)
    release.set()
    run_until(w, lambda: not w.pretok.pending)
    loop_once(w)
    assert client.status(jid) == JobStatus.CANCELLED and not engine.has_unfinished()
    # A tokenizer error fails the job with the reason; the worker goes on.
    w.pretok.tokenize = lambda p, m: (_ for _ in ()).throw(RuntimeError("no vocab"))
    bad = client.submit("x", SHORT)
    run_until(w, lambda: client.status(bad).terminal)
    rec = client.get(bad)
    assert rec is not None and rec.status == JobStatus.FAILED
    assert rec.error == "rejected: RuntimeError: no vocab"


def test_heartbeat_carries_the_context(make_worker: Any, redis_url: str, engine: Engine) -> None:
    store = JobStore(redis_url)
    w = make_worker(engine, store, ServiceConfig(worker_id="w", redis_url=redis_url))
    w._heartbeat()
    hb = store.workers()["w"]
    assert hb["max_model_len"] == 512 == engine.max_model_len
    mtb = hb["max_token_bytes"]
    assert isinstance(mtb, int) and mtb >= 1 and mtb == max_token_bytes(engine.tokenizer)
    # Sound: no token of the vocabulary decodes to more bytes than that.
    tok = engine.tokenizer
    longest = max(len(tok.decode([i]).encode()) for i in range(len(tok)))
    assert longest <= mtb
