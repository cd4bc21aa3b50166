"""The dashboard page in a real headless Chromium (Playwright), against a heartbeat in Redis.

Needs ``apt-get install -y chromium`` (Debian's, /usr/bin/chromium) and ``pip install playwright``
(no ``playwright install``: the system Chromium is used). Skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask
from werkzeug.serving import make_server

from pagedserve.client import Client
from pagedserve.telemetry import PoolSnapshot
from tests.api_fixtures import heartbeat, make_app, publish

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
KEY = "dash-key"


def serve(app: Flask) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, threaded=True)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        t.join(5)


@pytest.fixture
def base_url(redis_url: str) -> Iterator[str]:
    yield from serve(make_app(redis_url, api_keys=KEY))


def get_json(url: str) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def drawn(page, worker_id: str) -> dict[str, int]:
    """What the page shows for one worker: legend counts and cells drawn per state."""
    art = page.locator(f'article[data-worker-id="{worker_id}"]')
    out = {}
    for st in ("free", "in_use", "cached", "shared"):
        out["legend_" + st] = int(
            art.locator(f'.count[data-state="{st}"]').get_attribute("data-count")
        )
        attr = "data-drawn-" + st.replace("_", "-")
        out["drawn_" + st] = int(art.locator("canvas.block-canvas").get_attribute(attr))
    stats = art.locator(".pool-stats")
    for name in ("total", "free", "in-use", "cached", "shared"):
        out["blocks_" + name] = int(stats.get_attribute("data-blocks-" + name))
    return out


def expected(pool_worker: dict) -> dict[str, int]:
    p = pool_worker["pool"]
    out = {}
    for st, n in p["block_state_counts"].items():
        out["legend_" + st] = n
        out["drawn_" + st] = n
    out.update(
        blocks_total=p["blocks_total"],
        blocks_free=p["blocks_free"],
        **{"blocks_in-use": p["blocks_in_use"]},
        blocks_cached=p["blocks_cached"],
        blocks_shared=p["blocks_shared"],
    )
    return out


def big_heartbeat():
    """A second worker with a 600-block pool in all four states."""
    states = "0" * 250 + "1" * 200 + "2" * 100 + "3" * 50
    hb = heartbeat("w2", steps=3, running=1)
    pool = PoolSnapshot(
        num_blocks=600, block_size=16, free=350, in_use=250, cached=100, shared=50,
        tokens_stored=3900, fragmentation_slots=100, usage=250 / 600, block_states=states,
    )  # fmt: skip
    return hb.model_copy(update={"pool": pool, "throughput_tok_s": 10.0})


def test_dashboard_draws_pool_blocks(browser, base_url: str, redis_url: str) -> None:
    publish(redis_url, heartbeat("w1"))
    publish(redis_url, big_heartbeat())
    with Client(redis_url) as c:
        c.submit_many(["a", "b", "c"], priority="bulk")
        c.submit("d")
    pool = get_json(base_url + "/v1/pool")
    by_id = {w["worker_id"]: w for w in pool["workers"]}

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(base_url + f"/?key={KEY}")
    page.wait_for_selector('article[data-worker-id="w2"] canvas.block-canvas', timeout=15_000)
    page.wait_for_function("Number(document.body.dataset.refreshes || 0) >= 2", timeout=15_000)
    for wid in ("w1", "w2"):
        assert drawn(page, wid) == expected(by_id[wid]), wid
    assert page.locator("#queue-bulk").get_attribute("data-depth") == "3"
    assert page.locator("#queue-interactive").get_attribute("data-depth") == "1"
    assert page.locator("#worker-count").get_attribute("data-count") == "2"
    assert float(page.locator("#throughput").get_attribute("data-value")) == 52.5
    assert float(page.locator("#hit-rate").get_attribute("data-value")) == 0.25
    job = page.locator('article[data-worker-id="w1"] li[data-job-id="job-a"]')
    assert job.get_attribute("data-progress") == "50"
    assert page.locator("#status").get_attribute("data-state") == "ok"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

    # The page follows the pool: blocks change, a worker goes away.
    states = "3" * 16
    hb = heartbeat("w1").model_copy(deep=True)
    assert hb.pool is not None
    hb.pool.block_states, hb.pool.shared, hb.pool.in_use, hb.pool.free = states, 16, 16, 0
    publish(redis_url, hb)
    with Client(redis_url) as c:
        c.r.delete(c.keys.worker("w2"))
    page.wait_for_function(
        """() => document.querySelector('article[data-worker-id="w1"] canvas')
              ?.getAttribute('data-drawn-shared') === '16'
              && !document.querySelector('article[data-worker-id="w2"]')""",
        timeout=15_000,
    )
    assert drawn(page, "w1")["legend_shared"] == 16


def test_dashboard_without_key_asks_for_one(browser, base_url: str, redis_url: str) -> None:
    publish(redis_url, heartbeat("w1"))
    page = browser.new_page()
    page.goto(base_url + "/dashboard")  # the page itself is open
    page.wait_for_selector("#status[data-state='error']", timeout=15_000)
    assert page.locator("#auth-hint").is_visible()
    assert "missing API key" in page.locator("#status").inner_text()
    assert page.locator("article[data-worker-id]").count() == 0


def test_dashboard_shows_the_callers_tenants(browser, redis_url: str) -> None:
    """Per-tenant queue depth and tokens: a tenant's key sees its own row, an admin's all."""
    keys = "team-a:key-a, ops:key-ops:admin"
    for c in (Client(redis_url, tenant="team-a"), Client(redis_url, tenant="team-b")):
        with c:
            c.submit_many(["a", "b", "c"] if c.tenant == "team-a" else ["x"], priority="bulk")
    for key, rows in (("key-a", {"team-a": "3"}), ("key-ops", {"team-a": "3", "team-b": "1"})):
        for url in serve(make_app(redis_url, api_keys=keys)):
            page = browser.new_page()
            page.goto(url + f"/?key={key}")
            page.wait_for_selector("#tenants tr[data-tenant='team-a']", timeout=15_000)
            shown = {
                row.get_attribute("data-tenant"): row.locator(
                    "td[data-field='queued']"
                ).inner_text()
                for row in page.locator("#tenants tbody tr").all()
            }
            assert shown == rows, key
            page.close()
