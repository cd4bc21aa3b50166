"""Hypothesis throws random metadata, idempotency keys, ids and parameters at the API, the Client
and the store (as legacy records) while a real worker runs; afterwards the worker is alive, the
jobs nobody cancelled succeeded, and every batch's counts equal its lines. It runs open and with
tenants on (two tenants' keys, the batches one tenant's): then every job also carries its
submitter's tenant and each tenant's open-jobs count drains to zero."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.batches import BatchStore
from pagedserve.client import Client
from pagedserve.openai_format import COMPLETIONS_URL
from pagedserve.schemas import JobStatus
from pagedserve.store import JobStore
from tests.api_fixtures import make_app
from tests.fixtures.workers import StartWorker, wait_for
from tests.raw_records import inject
from tests.test_service_integrity import batch_file

CIDS = [f"r{i}" for i in range(4)]
#: Keys of the tenants run: the batches are team-a's, the Client is team-b's.
FUZZ_KEYS = "team-a:fuzz-key-a,team-b:fuzz-key-b"
CALLERS = {"team-a": {"Authorization": "Bearer fuzz-key-a"},
           "team-b": {"Authorization": "Bearer fuzz-key-b"}}  # fmt: skip


@pytest.fixture
def model_dir(make_tiny_model) -> Path:  # type: ignore[no-untyped-def]
    return make_tiny_model("llama")


def actions(bids: list[str], job_ids: list[str]) -> st.SearchStrategy[tuple[str, Any]]:
    suffixes = st.sampled_from(["", "", ":jobs", ":members", ":output", ":errors", ":counted"])
    batchish = st.builds(lambda b, s: b + s, st.sampled_from(bids), suffixes)
    value = st.one_of(
        batchish,
        st.text(max_size=12),
        st.integers(),
        st.none(),
        st.lists(st.integers(), max_size=2),
    )
    key = st.one_of(
        st.sampled_from(["batch_id", "custom_id", "url", "model", "x"]), st.text(max_size=6)
    )
    spoof = st.fixed_dictionaries(
        {"batch_id": batchish},
        optional={"custom_id": st.one_of(st.sampled_from([*CIDS, "evil"]), st.integers())},
    )
    metadata = st.one_of(
        st.none(),
        spoof,
        st.dictionaries(key, value, max_size=4),
        st.builds(lambda a, b: {**a, **b}, st.dictionaries(key, value, max_size=2), spoof),
    )
    idem = st.one_of(
        st.none(),
        st.builds(
            lambda b, h: f"batch:{b}:{h}",
            st.sampled_from(bids),
            st.text("0123456789abcdef", min_size=1, max_size=32),
        ),
        st.text(min_size=1, max_size=20),
    )
    params = st.fixed_dictionaries(
        {"max_tokens": st.sampled_from([1, 3, 0, -2])},
        optional={"temperature": st.sampled_from([0, 0.7, -1]), "n": st.sampled_from([1, 2, 0])},
    )
    job = st.fixed_dictionaries(
        {"prompt": st.text(min_size=1, max_size=30), "params": params},
        optional={"metadata": metadata, "idempotency_key": idem},
    )
    spoofed = st.fixed_dictionaries(
        {"prompt": st.text(min_size=1, max_size=30), "params": params, "metadata": spoof}
    )
    # No '/' in a free-text id: it makes another path, which the router answers (a leading one
    # or '//' is a 308 to the merged path), before any job route is reached. UTF-8 only: a lone
    # surrogate cannot be put in a URL at all (the test client raised before any request).
    free_id = st.text(st.characters(codec="utf-8", exclude_characters="/"), min_size=1,
                      max_size=20)  # fmt: skip
    ids = st.one_of(st.sampled_from(job_ids), batchish, free_id)
    submit = st.sampled_from(["api_submit", "client_submit", "legacy_record"])
    return st.one_of(
        st.tuples(submit, job),
        st.tuples(submit, spoofed),
        st.tuples(st.just("api_cancel"), ids),
        st.tuples(st.just("api_get"), ids),
    )


@pytest.mark.parametrize("tenants", [False, True], ids=["open", "tenants"])
def test_fuzz_never_breaks_the_worker_or_a_batch(
    redis_url: str, model_dir: Path, start_worker: StartWorker, tenants: bool
) -> None:
    started = time.monotonic()
    bs = BatchStore(JobStore(redis_url))
    client = Client(redis_url, tenant="team-b" if tenants else None)
    api = make_app(redis_url, api_keys=FUZZ_KEYS if tenants else ()).test_client()
    callers = sorted(CALLERS) if tenants else [None]
    owner = "team-a" if tenants else None
    bids = []
    for _ in range(2):
        f = bs.files.create(batch_file(model_dir.name, CIDS), "in.jsonl", tenant=owner)
        bids.append(bs.create(f.id, COMPLETIONS_URL, tenant=owner).id)
        bs.fan_out(bids[-1])
    batch_jobs = [j for b in bids for j in bs.job_ids(b)]
    w = start_worker(redis_url, model_dir, "w")
    accepted: list[str] = []
    # The tenant each accepted job must carry (a legacy record has none).
    tenant_of: dict[str, str | None] = {}
    # Cancel answers per job: "cancelled" (final), or "cancelling" (it may still succeed).
    cancels: dict[str, str] = {}

    def submit(kind: str, body: dict[str, Any], who: str | None) -> None:
        if kind == "api_submit":
            resp = api.post("/v1/jobs", json=body, headers=CALLERS.get(who or "", {}))
            assert resp.status_code in (202, 400, 422), resp.get_json()
            if resp.status_code == 202:
                accepted.append(resp.get_json()["id"])
                tenant_of[accepted[-1]] = who
            return
        if kind == "legacy_record":  # what a client could once store, parsed or not
            accepted.append(inject(client.store, json.dumps(body)))
            tenant_of[accepted[-1]] = None
            return
        with contextlib.suppress(ValueError):  # reserved names, invalid params (pydantic's too)
            accepted.append(client.submit(body["prompt"], body["params"],
                                          metadata=body.get("metadata"),
                                          idempotency_key=body.get("idempotency_key")))  # fmt: skip
            tenant_of[accepted[-1]] = client.tenant

    @settings(max_examples=50, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.lists(st.tuples(actions(bids, batch_jobs), st.sampled_from(callers)),
                    min_size=1, max_size=4))  # fmt: skip
    def run(steps: list[tuple[tuple[str, Any], str | None]]) -> None:
        for (kind, arg), who in steps:
            headers = CALLERS.get(who or "", {})
            if kind == "api_cancel":
                resp = api.delete(f"/v1/jobs/{arg}", headers=headers)
                assert resp.status_code in (200, 404), (arg, resp.get_json())
                # Another tenant's job (team-b cancelling a batch job) is not found, untouched.
                assert resp.status_code == 404 or arg not in batch_jobs or who != "team-b"
                status = resp.get_json().get("status")
                if resp.status_code == 200 and status in ("cancelled", "cancelling"):
                    cancels[arg] = cancels.get(arg) or status
            elif kind == "api_get":
                resp = api.get(f"/v1/jobs/{arg}", headers=headers)
                assert resp.status_code in (200, 404), (arg, resp.get_json())
            else:
                submit(kind, arg, who)

    run()
    assert w.proc.poll() is None, w.log()
    wait_for(
        lambda: all(s.terminal for s in client.store.statuses(accepted + batch_jobs)),
        timeout=60,
        what="every job to end",
    )
    for jid, (status, error, request, tenant) in zip(
        accepted,
        [client.r.hmget(client.keys.job(j), "status", "error", "request", "tenant")
         for j in accepted],
        strict=True,
    ):  # fmt: skip
        assert jid not in cancels  # the fuzz cancels only batch jobs, by id
        valid = _valid(request)
        assert status == ("succeeded" if valid else "failed"), (jid, status, error, request)
        assert tenant == tenant_of[jid], (jid, tenant, tenant_of[jid])
    for t in callers if tenants else []:
        assert client.store.tenants.open_jobs(str(t), force=True) == 0, t
    assert {client.r.hget(client.keys.job(j), "tenant") for j in batch_jobs} == {owner}
    for jid, s in zip(batch_jobs, client.store.statuses(batch_jobs), strict=True):
        allowed = {
            None: {JobStatus.SUCCEEDED},
            "cancelled": {JobStatus.CANCELLED},
            "cancelling": {JobStatus.CANCELLED, JobStatus.SUCCEEDED},
        }[cancels.get(jid)]
        assert s in allowed, (jid, s, cancels.get(jid))
    for bid in bids:
        _check_batch(bs, bid)
    assert w.proc.poll() is None
    assert client.wait(client.submit("the last one", {"max_tokens": 2}), timeout=30).status == (
        JobStatus.SUCCEEDED
    )
    assert time.monotonic() - started < 90


def _valid(raw: str) -> bool:
    """Whether a stored request is one a worker runs (legacy records may not parse)."""
    from pagedserve.schemas import JobRequest

    try:
        JobRequest.model_validate_json(raw)
    except ValueError:
        return False
    return True


def _check_batch(bs: BatchStore, bid: str) -> None:
    def final() -> bool:
        bs.finalize_ready()
        b = bs.get(bid)
        return b is not None and b.status == "completed"

    wait_for(final, timeout=30, what=f"batch {bid} to complete")
    b = bs.get(bid)
    assert b is not None
    c = b.request_counts
    out = [json.loads(x) for x in (bs.files.content(b.output_file_id or "") or "").split("\n") if x]
    errs = [json.loads(x) for x in (bs.files.content(b.error_file_id or "") or "").split("\n") if x]
    assert (c.total, c.completed, c.failed) == (len(CIDS), len(out), len(errs))
    assert sorted(x["custom_id"] for x in out + errs) == CIDS
