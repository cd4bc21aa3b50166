"""OpenAI batches against a real redis-server: validation, fan-out, fenced batch lines, finalize,
cancel, expire, pagination."""

from __future__ import annotations

import json
import threading

import pytest

from pagedserve.batches import BatchStore
from pagedserve.openai_format import (
    CHAT_URL,
    COMPLETIONS_URL,
    LineInvalid,
    parse_file,
    parse_line,
)
from pagedserve.schemas import Completion, JobResult, TokenLogprob
from pagedserve.store import Finish, JobStore, Lease, batch_keys

MODEL = "tiny"


def line(cid: str, body: dict | None = None, url: str = COMPLETIONS_URL, **kw: object) -> str:
    obj = {
        "custom_id": cid,
        "method": "POST",
        "url": url,
        "body": body or {"model": MODEL, "prompt": "hi"},
    }
    obj.update(kw)
    return json.dumps(obj)


def err_of(text: str, seen: set[str] | None = None, endpoint: str | None = None):
    with pytest.raises(LineInvalid) as ei:
        parse_line(text, 7, endpoint=endpoint, known_models=[MODEL], seen_ids=seen)
    e = ei.value.error
    assert e.line == 7 and "line 7" in str(e)
    return e


@pytest.mark.parametrize(
    ("text", "code", "fatal", "words"),
    [
        ("{not json", "invalid_json", True, "not valid JSON"),
        ("[1, 2]", "invalid_json", True, "JSON object"),
        (
            json.dumps({"method": "POST", "url": COMPLETIONS_URL, "body": {}}),
            "missing_custom_id",
            True,
            "custom_id",
        ),
        (line("a", method="GET"), "invalid_method", True, "'GET'"),
        (line("a", url="/v1/embeddings"), "invalid_url", True, "/v1/embeddings"),
        (line("a", {"model": "gpt-9", "prompt": "x"}), "model_not_found", False, "gpt-9"),
        (
            line("a", {"model": MODEL, "prompt": "x", "temperature": -1}),
            "invalid_request",
            False,
            "temperature",
        ),
        (
            line("a", {"model": MODEL, "prompt": "x", "stream": True}),
            "invalid_request",
            False,
            "stream",
        ),
        (
            line("a", {"model": MODEL, "prompt": "x", "tools": []}),
            "invalid_request",
            False,
            "tools",
        ),
        (line("a", {"model": MODEL}), "invalid_request", False, "prompt"),
        (
            line("a", {"model": MODEL, "prompt": "x"}, url=CHAT_URL),
            "invalid_request",
            False,
            "messages",
        ),
        (line("a", {"prompt": "x"}), "invalid_request", False, "model"),
    ],
)
def test_line_errors(text: str, code: str, fatal: bool, words: str) -> None:
    e = err_of(text)
    assert e.code == code and e.fatal is fatal
    assert words in e.message
    if code not in ("invalid_json", "missing_custom_id"):
        assert e.custom_id == "a" and "custom_id 'a'" in str(e)


def test_duplicate_and_mismatched_url() -> None:
    seen: set[str] = set()
    parse_line(line("a"), 1, seen_ids=seen)
    e = err_of(line("a"), seen)
    assert e.code == "duplicate_custom_id" and e.fatal
    e = err_of(
        line("b", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, url=CHAT_URL),
        endpoint=COMPLETIONS_URL,
    )
    assert e.code == "mismatched_url"


def test_parse_maps_params() -> None:
    comp = parse_line(
        line(
            "c1",
            {
                "model": MODEL,
                "prompt": [1, 2, 3],
                "max_tokens": 5,
                "temperature": 0,
                "top_p": 0.5,
                "n": 2,
                "stop": "\n",
                "seed": 3,
                "logprobs": 2,
                "presence_penalty": 0.5,
                "frequency_penalty": 0.1,
            },
        ),
        1,
        batch_id="batch_x",
    )
    r = comp.request
    assert r.prompt == [1, 2, 3] and r.priority == "bulk" and r.model == MODEL
    p = r.params
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.stop, p.seed, p.logprobs) == (
        5,
        0.0,
        0.5,
        2,
        ["\n"],
        3,
        2,
    )
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, 0.1)
    assert r.metadata == {
        "batch_id": "batch_x",
        "custom_id": "c1",
        "url": COMPLETIONS_URL,
        "model": MODEL,
    }
    chat = parse_line(
        line(
            "c2",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hey"}]}],
                "max_completion_tokens": 9,
                "logprobs": True,
                "top_logprobs": 3,
            },
            url=CHAT_URL,
        ),
        2,
    )
    assert chat.request.messages[0].content == "hey"
    assert chat.request.params.max_tokens == 9 and chat.request.params.logprobs == 3


def test_parse_file_splits_errors() -> None:
    text = "\n".join([line("a"), "", line("b", {"model": "nope", "prompt": "x"}), line("c")]) + "\n"
    pf = parse_file(text, endpoint=COMPLETIONS_URL, known_models=[MODEL])
    assert [x.custom_id for x in pf.lines] == ["a", "c"] and [x.line for x in pf.lines] == [1, 4]
    assert [(e.line, e.code) for e in pf.request_errors] == [(3, "model_not_found")]
    assert pf.total == 3 and not pf.format_errors
    assert parse_file("\n\n").format_errors[0].code == "empty_file"


# ----------------------------------------------------------------------------- store-backed
@pytest.fixture
def bs(redis_url: str) -> BatchStore:
    return BatchStore(JobStore(redis_url, lease_ms=60_000), known_models=[MODEL])


def submit(bs: BatchStore, lines: list[str], endpoint: str = COMPLETIONS_URL, window: str = "24h"):
    f = bs.files.create(("\n".join(lines) + "\n").encode(), "in.jsonl")
    assert f.id.startswith("file-") and f.object == "file" and f.purpose == "batch"
    assert bs.files.get(f.id).bytes == f.bytes
    b = bs.create(f.id, endpoint, window, metadata={"k": "v"})
    assert b.status == "validating" and b.id.startswith("batch_")
    return bs.fan_out(b.id)


def result(text: str = "out", n: int = 1, logprobs: bool = False) -> JobResult:
    lp = (
        [TokenLogprob(token_id=5, logprob=-0.5, top_logprobs={5: -0.5, 6: -1.0})]
        if logprobs
        else None
    )
    comps = [
        Completion(index=i, text=text, token_ids=[5], finish_reason="stop", logprobs=lp)
        for i in range(n)
    ]
    return JobResult(completions=comps, prompt_tokens=3, completion_tokens=n)


def finish(
    bs: BatchStore,
    lease: Lease,
    status: str = "succeeded",
    res: JobResult | None = None,
    error: str | None = None,
) -> bool:
    res = res if res is not None or status != "succeeded" else result()
    step = bs.jobs.commit_step(finished=[Finish(lease, status, result=res, error=error)])  # type: ignore[arg-type]
    return not step.lost


def test_fan_out_enqueues_bulk_jobs(bs: BatchStore) -> None:
    b = submit(
        bs,
        [
            line("a"),
            line("b", {"model": "nope", "prompt": "x"}),
            line("c", {"model": MODEL, "prompt": "y", "max_tokens": 3}),
        ],
    )
    assert b.status == "in_progress" and b.in_progress_at is not None
    assert b.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 1}
    assert bs.jobs.queue_lengths() == {"interactive": 0, "bulk": 2}
    recs = bs.jobs.get_many(bs.job_ids(b.id))
    assert [r.request.metadata["custom_id"] for r in recs] == ["a", "c"]
    assert all(r.priority == "bulk" and r.request.metadata["batch_id"] == b.id for r in recs)
    assert recs[1].request.params.max_tokens == 3 and recs[1].request.prompt == "y"
    # a second fan-out (a redelivered task) queues nothing more
    assert bs.fan_out(b.id).status == "in_progress"
    assert bs.jobs.queue_lengths()["bulk"] == 2


def test_invalid_file_fails_batch(bs: BatchStore) -> None:
    b = submit(bs, [line("a"), "{oops", line("a")])
    assert b.status == "failed" and b.failed_at is not None
    codes = [(e["line"], e["code"]) for e in b.errors.data]
    assert codes == [(2, "invalid_json"), (3, "duplicate_custom_id")]
    assert bs.jobs.queue_lengths()["bulk"] == 0
    assert bs.active() == []


def test_lines_counted_once_and_finalize(bs: BatchStore) -> None:
    b = submit(bs, [line("a"), line("b"), line("bad", {"model": "nope", "prompt": "x"})])
    leases = bs.jobs.claim("w1", 10)
    assert len(leases) == 2
    by_cid = {x.request.metadata["custom_id"]: x for x in leases}
    # worker w1 stalls on "a"; w2 reclaims it and finishes it; w1's late write is refused
    stolen = bs.jobs.reclaim("w2", 0, 1)
    assert [x.job_id for x in stolen] == [by_cid["a"].job_id]
    assert finish(bs, stolen[0], res=result("A", n=2))
    assert not finish(bs, by_cid["a"], res=result("stale"))
    assert finish(bs, by_cid["b"], status="failed", error="engine crashed")
    got = bs.get(b.id)
    assert got.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 2}
    assert bs.finalize_ready() == [b.id]
    done = bs.get(b.id)
    assert done.status == "completed" and done.finalizing_at and done.completed_at
    out = [json.loads(x) for x in bs.files.content(done.output_file_id).splitlines()]
    assert len(out) == 1
    o = out[0]
    assert (
        o["custom_id"] == "a" and o["error"] is None and o["id"] == f"batch_req_{stolen[0].job_id}"
    )
    assert o["response"]["status_code"] == 200 and o["response"]["request_id"]
    body = o["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert [c["text"] for c in body["choices"]] == ["A", "A"]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    errs = {
        json.loads(x)["custom_id"]: json.loads(x)
        for x in bs.files.content(done.error_file_id).splitlines()
    }
    assert set(errs) == {"b", "bad"}
    assert errs["b"]["response"]["status_code"] == 500
    assert "engine crashed" in errs["b"]["response"]["body"]["error"]["message"]
    assert errs["bad"]["response"]["status_code"] == 400
    assert errs["bad"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert bs.files.get(done.output_file_id).purpose == "batch_output"
    assert bs.active() == []


def test_chat_output_line(bs: BatchStore) -> None:
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "q"}],
        "logprobs": True,
        "top_logprobs": 1,
    }
    b = submit(bs, [line("x", chat, url=CHAT_URL)], endpoint=CHAT_URL)
    (lease,) = bs.jobs.claim("w", 5)
    assert finish(bs, lease, res=result("hello", logprobs=True))
    done = bs.finalize(b.id)
    assert done.status == "completed" and done.error_file_id is None
    body = json.loads(bs.files.content(done.output_file_id))["response"]["body"]
    assert body["object"] == "chat.completion"
    ch = body["choices"][0]
    assert (
        ch["message"] == {"role": "assistant", "content": "hello"} and ch["finish_reason"] == "stop"
    )
    assert ch["logprobs"]["content"][0]["logprob"] == -0.5
    assert len(ch["logprobs"]["content"][0]["top_logprobs"]) == 2


def test_finalize_waits_for_all(bs: BatchStore) -> None:
    b = submit(bs, [line("a"), line("b")])
    (l1, l2) = bs.jobs.claim("w", 5)
    assert finish(bs, l1)
    assert bs.finalize(b.id).status == "in_progress"
    assert bs.finalize_ready() == []
    assert finish(bs, l2)
    assert bs.finalize(b.id).status == "completed"


def test_cancel(bs: BatchStore) -> None:
    b = submit(bs, [line("a"), line("b"), line("c")])
    (running,) = bs.jobs.claim("w", 1)
    c = bs.cancel(b.id)
    assert c.status == "cancelling" and c.cancelling_at
    sts = {
        bs.jobs.get(j).request.metadata["custom_id"]: s
        for j, s in zip(bs.job_ids(b.id), bs.jobs.statuses(bs.job_ids(b.id)), strict=True)
    }
    assert sorted(sts.values()) == ["cancelled", "cancelled", "cancelling"]
    assert bs.jobs.pop_cancels("w") == {running.job_id}
    assert bs.finalize_ready() == []  # still running
    assert finish(bs, running, status="cancelled")
    assert bs.finalize_ready() == [b.id]
    final = bs.get(b.id)
    assert final.status == "cancelled" and final.cancelled_at and final.output_file_id is None
    errs = [json.loads(x) for x in bs.files.content(final.error_file_id).splitlines()]
    # the two queued jobs at once (cancel.lua), the running one by its worker's cancelled write
    assert [e["error"]["code"] for e in errs] == ["batch_cancelled"] * 3
    assert sorted(e["custom_id"] for e in errs) == ["a", "b", "c"]
    assert errs[-1]["id"] == f"batch_req_{running.job_id}"
    assert all(e["response"] is None for e in errs)
    assert final.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}
    assert bs.cancel(b.id).status == "cancelled"  # idempotent
    assert bs.get(b.id).request_counts.failed == 3


def test_expire_keeps_partial_output(bs: BatchStore) -> None:
    b = submit(bs, [line("a"), line("b")], window="1h")
    assert b.expires_at == b.created_at + 3600
    (l1,) = bs.jobs.claim("w", 1)
    assert finish(bs, l1)
    assert bs.expire(now=b.expires_at - 1) == []
    assert bs.expire(now=b.expires_at) == [b.id]
    e = bs.get(b.id)
    assert e.status == "expired" and e.expired_at == b.expires_at
    assert len(bs.files.content(e.output_file_id).splitlines()) == 1
    assert bs.jobs.statuses(bs.job_ids(b.id))[1] == "cancelled"
    (err,) = [json.loads(x) for x in bs.files.content(e.error_file_id).splitlines()]
    assert err["custom_id"] == "b" and err["error"]["code"] == "batch_expired"
    assert err["response"] is None and "expired" in err["error"]["message"]
    assert e.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}


def lines_of(bs: BatchStore, file_id: str | None) -> list[dict]:
    return (
        [json.loads(x) for x in (bs.files.content(file_id) or "").splitlines()] if file_id else []
    )


def test_dead_lettered_job_finalizes(redis_url: str) -> None:
    bs = BatchStore(JobStore(redis_url, lease_ms=60_000, max_deliveries=1), known_models=[MODEL])
    b = submit(bs, [line("a"), line("b")])
    by_cid = {x.request.metadata["custom_id"]: x for x in bs.jobs.claim("w1", 5)}
    assert finish(bs, by_cid["b"])
    # w1 stalls on "a"; its second delivery (to w2) exceeds max_deliveries: dead-lettered
    assert bs.jobs.reclaim("w2", 0, 5) == [] and bs.jobs.stats.dead_lettered == 1
    assert not finish(bs, by_cid["a"], res=result("late"))  # w1's late write is refused
    assert bs.get(b.id).request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
    assert bs.finalize_ready() == [b.id]
    done = bs.get(b.id)
    assert done.status == "completed"
    assert [o["custom_id"] for o in lines_of(bs, done.output_file_id)] == ["b"]
    (err,) = lines_of(bs, done.error_file_id)
    assert err["custom_id"] == "a" and err["id"] == f"batch_req_{by_cid['a'].job_id}"
    assert (
        err["error"]["code"] == "dead_lettered" and "delivered 2 times" in err["error"]["message"]
    )
    assert err["response"] is None


def test_cancel_queued_batch_ends_at_once(bs: BatchStore) -> None:
    b = submit(bs, [line("a"), line("b"), line("bad", {"model": "nope", "prompt": "x"})])
    c = bs.cancel(b.id)
    assert c.status == "cancelled"  # nothing was running
    assert c.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}
    errs = {e["custom_id"]: e for e in lines_of(bs, c.error_file_id)}
    assert set(errs) == {"a", "b", "bad"}
    assert errs["a"]["error"]["code"] == errs["b"]["error"]["code"] == "batch_cancelled"
    assert errs["bad"]["response"]["status_code"] == 400
    assert bs.active() == [] and bs.jobs.claim("w", 5) == []


def test_single_job_cancel_counts_for_its_batch(bs: BatchStore) -> None:
    """A batch job cancelled through the jobs API (not the batch) still gets its line."""
    b = submit(bs, [line("a"), line("b")])
    ja, jb = bs.job_ids(b.id)
    assert bs.jobs.cancel(ja) == "cancelled"
    assert bs.jobs.cancel(ja) == "cancelled"  # a repeated cancel counts nothing more
    (lease,) = bs.jobs.claim("w", 5)
    assert lease.job_id == jb and finish(bs, lease)
    assert bs.finalize_ready() == [b.id]
    done = bs.get(b.id)
    assert done.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
    assert [e["custom_id"] for e in lines_of(bs, done.error_file_id)] == ["a"]


def test_expire_writes_batch_expired_lines(bs: BatchStore) -> None:
    b = submit(bs, [line("a"), line("b"), line("c")], window="1h")
    la, lb = bs.jobs.claim("w", 2)
    assert finish(bs, la)
    assert bs.expire(now=b.expires_at) == [b.id]
    e = bs.get(b.id)
    assert e.status == "expired"
    assert e.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 2}
    errs = {x["custom_id"]: x for x in lines_of(bs, e.error_file_id)}
    assert set(errs) == {"b", "c"}  # b was running, c never ran
    assert {x["error"]["code"] for x in errs.values()} == {"batch_expired"}
    # b's worker honours the cancel later: its write is accepted but counts nothing more
    assert bs.jobs.pop_cancels("w") == {lb.job_id}
    assert finish(bs, lb, status="cancelled")
    assert bs.get(b.id).request_counts.model_dump() == e.request_counts.model_dump()
    assert bs.expire(now=b.expires_at + 1) == [] and bs.finalize_ready() == []


def test_reconcile_counts_jobs_ended_without_a_line(bs: BatchStore) -> None:
    """A job whose record is gone (expired, deleted) never gets a final write: finalize_ready's
    reconcile adds its ``job_lost`` line, once. (A drain handing back a job being cancelled,
    release.lua, gets its line at once.)"""
    bs.reconcile_every_s = 3600
    b = submit(bs, [line("a"), line("b"), line("c")])
    la, lb, lc = bs.jobs.claim("w", 3)
    assert bs.reconcile(b.id) == 0  # all running: nothing to add (and not due for an hour)
    assert bs.jobs.cancel(la.job_id) == "cancelling"
    assert bs.jobs.release(la) == "cancelled"
    assert bs.get(b.id).request_counts.failed == 1  # its line came with the release
    bs.r.delete(bs.keys.job(lc.job_id))
    assert finish(bs, lb)
    assert bs.finalize_ready() == [] and bs.get(b.id).status == "in_progress"
    bs.reconcile_every_s = 0
    assert bs.finalize_ready() == [b.id]
    done = bs.get(b.id)
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 2}
    errs = {e["id"]: e for e in lines_of(bs, done.error_file_id)}
    assert errs[f"batch_req_{la.job_id}"]["custom_id"] == "a"
    assert errs[f"batch_req_{la.job_id}"]["error"]["code"] == "batch_cancelled"
    assert errs[f"batch_req_{lc.job_id}"]["error"]["code"] == "job_lost"
    assert bs.reconcile(b.id) == 0


def test_reconcile_races_worker_writes(bs: BatchStore) -> None:
    """Workers' final writes (with and without their batch line) and job cancels race two
    reconcile loops: every job ends with exactly one line and one count."""
    n = 60
    b = submit(bs, [line(f"r{i}") for i in range(n)])
    leases = bs.jobs.claim("w", n)
    assert len(leases) == n
    stop = threading.Event()
    errors: list[BaseException] = []

    def reconciler() -> None:
        try:
            while not stop.is_set():
                bs.reconcile(b.id)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reconciler) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i, lease in enumerate(leases):
            kind = i % 4
            if kind == 0:  # a worker's write with its line
                assert finish(bs, lease)
            elif kind == 1:  # a write without the line (the reconcile builds it)
                assert bs.jobs.complete(lease, result(f"x{i}"))
            elif kind == 2:
                assert finish(bs, lease, status="failed", error="boom")
            else:  # cancelled, then handed back by a draining worker (its line follows)
                bs.jobs.cancel(lease.job_id)
                bs.jobs.release(lease)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors
    bs.reconcile(b.id)
    got = bs.get(b.id)
    assert got.request_counts.model_dump() == {"total": n, "completed": n // 2, "failed": n // 2}
    _, out_key, err_key, counted_key = batch_keys(bs.keys, b.id)
    ids = [json.loads(x)["id"] for x in bs.r.lrange(out_key, 0, -1) + bs.r.lrange(err_key, 0, -1)]
    assert sorted(ids) == sorted(f"batch_req_{x.job_id}" for x in leases)
    assert bs.r.scard(counted_key) == n
    assert bs.finalize_ready() == [b.id] and bs.get(b.id).status == "completed"


def test_list_pagination(bs: BatchStore) -> None:
    f = bs.files.create(line("a").encode(), "in.jsonl")
    ids = [bs.create(f.id, COMPLETIONS_URL).id for _ in range(5)]
    page = bs.list(limit=2)
    assert [x["id"] for x in page["data"]] == ids[::-1][:2] and page["has_more"]
    page2 = bs.list(after=page["last_id"], limit=2)
    assert [x["id"] for x in page2["data"]] == ids[::-1][2:4] and page2["has_more"]
    page3 = bs.list(after=page2["last_id"], limit=2)
    assert [x["id"] for x in page3["data"]] == ids[:1] and not page3["has_more"]


def test_file_limits(redis_url: str) -> None:
    bs = BatchStore(redis_url, max_file_bytes=10)
    with pytest.raises(ValueError, match="limit"):
        bs.files.create(b"x" * 11, "big.jsonl")
    with pytest.raises(ValueError, match="UTF-8"):
        bs.files.create(b"\xff\xfe", "bin.jsonl")
    with pytest.raises(KeyError):
        bs.create("file-missing", COMPLETIONS_URL)
