"""The dashboard in a real headless Chromium against a live worker running real jobs.

redis-server, one ``pagedserve worker`` (tiny Llama), ``pagedserve api`` under gunicorn; 40 long
generations sharing a 64-token prefix keep the KV pool busy (blocks in use and shared). While they
run, the worker is frozen with SIGSTOP, so its last heartbeat stays put: the page must then draw
exactly what ``/v1/pool`` and ``/v1/workers`` report (block states, counts, running jobs, queues).
After SIGCONT the jobs finish and the page must show no block in use and no running job.

Needs Debian's Chromium (/usr/bin/chromium) and the ``playwright`` package (never
``playwright install``); skipped with the reason otherwise.
"""

from __future__ import annotations

import math
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedserve.store import JobStore
from tests.api_live import ApiServer, JsonClient, api_server
from tests.fixtures.workers import StartWorker, wait_for

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
KEY = "live-dash-key"
WORKER_ID = "live-w1"
#: 8 sequences of ~470 tokens (30 blocks each) fill most of the 256-block test pool.
WORKER_ARGS = ("--max-model-len", "1024", "--max-num-seqs", "8")
NUM_JOBS = 40
MAX_TOKENS = 400
SHARED_PREFIX = [(7 * k) % 400 + 20 for k in range(64)]  # four full blocks, shared by all jobs
#: The heartbeat key expires 10 s after the last publication: unfreeze well before that.
MAX_FREEZE_S = 8.0


@pytest.fixture
def api(redis_url: str, tmp_path: Path) -> Iterator[ApiServer]:
    with api_server(redis_url, tmp_path / "api.log", workers=1, threads=8, api_keys=KEY) as s:
        yield s


def page_view(page: Any) -> dict[str, Any]:
    """Everything the page shows for the worker and the summary, read in one evaluation."""
    return page.evaluate(
        """(wid) => {
          const art = document.querySelector(`article[data-worker-id="${wid}"]`);
          if (!art) return null;
          const canvas = art.querySelector("canvas.block-canvas");
          const stats = art.querySelector(".pool-stats").dataset;
          const out = {legend: {}, drawn: {}, blocks: {}};
          for (const st of ["free", "in_use", "cached", "shared"]) {
            out.legend[st] = Number(art.querySelector(`.count[data-state="${st}"]`).dataset.count);
            out.drawn[st] = Number(canvas.getAttribute("data-drawn-" + st.replace("_", "-")));
          }
          out.drawn.total = Number(canvas.getAttribute("data-drawn-total"));
          for (const k of ["blocksTotal", "blocksFree", "blocksInUse", "blocksCached",
                           "blocksShared"]) out.blocks[k] = Number(stats[k]);
          out.jobs = Object.fromEntries([...art.querySelectorAll("li[data-job-id]")]
            .map((li) => [li.dataset.jobId, li.dataset.progress]));
          out.state_text = art.querySelector(".worker-state").textContent;
          out.pool_text = art.querySelector(".pool-stats").textContent;
          out.queues = {
            interactive: Number(document.getElementById("queue-interactive").dataset.depth),
            bulk: Number(document.getElementById("queue-bulk").dataset.depth),
          };
          out.workers = Number(document.getElementById("worker-count").dataset.count);
          out.throughput = Number(document.getElementById("throughput").dataset.value);
          out.status = document.getElementById("status").dataset.state;
          out.refreshes = Number(document.body.dataset.refreshes || 0);
          return out;
        }""",
        WORKER_ID,
    )


def js_round(x: float) -> int:
    """JavaScript's ``Math.round`` (halves up; Python's ``round`` rounds them to even)."""
    return math.floor(x + 0.5)


def api_view(pool: dict[str, Any], workers: dict[str, Any]) -> dict[str, Any]:
    """What the page should show, from ``/v1/pool`` and ``/v1/workers`` (same heartbeat)."""
    (pw,) = [w for w in pool["workers"] if w["worker_id"] == WORKER_ID]
    (ww,) = [w for w in workers["data"] if w["worker_id"] == WORKER_ID]
    p = pw["pool"]
    counts = p["block_state_counts"]
    return {
        "legend": dict(counts),
        "drawn": {**counts, "total": p["blocks_total"]},
        "blocks": {
            "blocksTotal": p["blocks_total"],
            "blocksFree": p["blocks_free"],
            "blocksInUse": p["blocks_in_use"],
            "blocksCached": p["blocks_cached"],
            "blocksShared": p["blocks_shared"],
        },
        "jobs": {
            j["id"]: "" if j["fraction"] is None else str(js_round(j["fraction"] * 100))
            for j in ww["jobs"]
        },
        "queues": pool["queues"],
        "workers": len(pool["workers"]),
        "throughput": pw["throughput_tok_s"],
        "running": pw["running"],
    }


def comparable(view: dict[str, Any]) -> dict[str, Any]:
    keys = ("legend", "drawn", "blocks", "jobs", "queues", "workers", "throughput")
    return {k: view[k] for k in keys}


def test_dashboard_follows_a_live_worker(
    browser: Any,
    api: ApiServer,
    redis_url: str,
    make_tiny_model,  # type: ignore[no-untyped-def]
    start_worker: StartWorker,
) -> None:
    worker = start_worker(redis_url, make_tiny_model("llama"), WORKER_ID, *WORKER_ARGS)
    client = JsonClient(api.port, api_key=KEY)
    store = JobStore(redis_url)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    stopped = False
    try:
        page.goto(api.base_url + f"/?key={KEY}")
        page.wait_for_selector(f'article[data-worker-id="{WORKER_ID}"] canvas', timeout=20_000)
        idle = page_view(page)
        assert idle["status"] == "ok" and idle["drawn"]["in_use"] == 0 and not idle["jobs"], idle

        ids = []
        for i in range(NUM_JOBS):
            body = {
                "prompt": [*SHARED_PREFIX, 100 + i, 200 + i, 300 + i],
                "params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
                "priority": "bulk" if i % 2 else "interactive",
            }
            status, resp = client.request("POST", "/v1/jobs", body)
            assert status == 202, resp
            ids.append(resp["id"])

        # Busy: a heartbeat with jobs running and blocks in use; then freeze the worker.
        def busy() -> bool:
            (w,) = client.get("/v1/pool")["workers"]
            # Several sequences holding the shared prefix at once, so all four states can show.
            pool = w["pool"]
            return bool(
                w["running"] >= 2 and pool["blocks_in_use"] > 0 and pool["blocks_shared"] > 0
            )

        wait_for(busy, timeout=30, what="a heartbeat with running jobs sharing prefix blocks")
        os.kill(worker.proc.pid, signal.SIGSTOP)
        stopped = True
        t_stop = time.monotonic()
        # Two full page refreshes that began after the stop: the page shows the last heartbeat.
        r0 = page_view(page)["refreshes"]
        page.wait_for_function(
            f"Number(document.body.dataset.refreshes || 0) >= {r0 + 2}", timeout=6_000
        )
        workers_before = client.get("/v1/workers")
        pool = client.get("/v1/pool")
        shown = page_view(page)
        workers_after = client.get("/v1/workers")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard_live.png"), full_page=True)
        frozen_s = time.monotonic() - t_stop
        os.kill(worker.proc.pid, signal.SIGCONT)
        stopped = False

        steps = [w["steps"] for w in workers_before["data"] + workers_after["data"]]
        assert len(set(steps)) == 1, f"the heartbeat moved while frozen: steps {steps}"
        assert frozen_s < MAX_FREEZE_S, f"frozen for {frozen_s:.1f} s"
        want = api_view(pool, workers_after)
        assert shown["status"] == "ok"
        assert comparable(shown) == comparable(want)
        assert shown["drawn"]["in_use"] + shown["drawn"]["shared"] > 0
        assert shown["blocks"]["blocksInUse"] > 0
        assert shown["drawn"]["shared"] > 0, "jobs share a 4-block prefix: some blocks shared"
        assert want["running"] > 0 and len(shown["jobs"]) > 0
        assert f"{want['running']} running" in shown["state_text"]
        # the cache in memory beside the pool (the worker's float32 default)
        (pw,) = pool["workers"]
        shown_mib = re.search(r"float32 cache ([0-9.]+) MiB", shown["pool_text"])
        assert shown_mib, shown["pool_text"]
        assert float(shown_mib[1]) == pytest.approx(pw["pool"]["kv_cache_bytes"] / 2**20, abs=0.06)
        assert set(shown["jobs"]) <= set(ids)

        # The jobs end; the page shows an empty pool (prefix blocks may stay cached) and no job.
        store_ok = wait_for(
            lambda: all(s.terminal for s in store.statuses(ids)),
            timeout=120,
            what="all jobs finished",
        )
        assert store_ok
        for rec in store.get_many(ids):
            assert rec is not None and rec.status == "succeeded", rec
            assert rec.result is not None and rec.result.completion_tokens == MAX_TOKENS
        page.wait_for_function(
            """(wid) => {
              const art = document.querySelector(`article[data-worker-id="${wid}"]`);
              const c = art && art.querySelector("canvas.block-canvas");
              return c && c.getAttribute("data-drawn-in-use") === "0"
                && c.getAttribute("data-drawn-shared") === "0"
                && art.querySelector(".pool-stats").dataset.blocksInUse === "0"
                && !art.querySelector("li[data-job-id]");
            }""",
            arg=WORKER_ID,
            timeout=20_000,
        )
        end = page_view(page)
        assert end["legend"]["in_use"] == end["legend"]["shared"] == 0
        assert end["drawn"]["free"] + end["drawn"]["cached"] == end["drawn"]["total"] == 256
        (pw,) = client.get("/v1/pool")["workers"]
        assert pw["pool"]["blocks_in_use"] == 0 and pw["running"] == 0
    except BaseException:
        print(f"--- worker log tail:\n{worker.log()}\n--- api log tail:\n{api.log()}")
        raise
    finally:
        if stopped:
            os.kill(worker.proc.pid, signal.SIGCONT)
        page.close()
        client.close()
        store.r.close()
