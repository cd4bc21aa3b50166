// pagedserve dashboard: polls the API every second; no build step, no dependencies.
"use strict";

const REFRESH_MS = 1000;
const HISTORY_POINTS = 300; // five minutes at one point per second
const STATES = ["free", "in_use", "cached", "shared"]; // block_states chars "0".."3"
const COLORS = {};
const history = [];

function apiKey() {
  const fromUrl = new URLSearchParams(location.search).get("key");
  if (fromUrl) localStorage.setItem("pagedserve-key", fromUrl);
  return fromUrl || localStorage.getItem("pagedserve-key") || "";
}

async function getJson(path) {
  const key = apiKey();
  const headers = key ? { Authorization: "Bearer " + key } : {};
  const resp = await fetch(path, { headers, cache: "no-store" });
  if (resp.status === 401) document.getElementById("auth-hint").hidden = false;
  if (!resp.ok) {
    let msg = resp.status + "";
    try { msg = (await resp.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(path + ": " + msg);
  }
  return resp.json();
}

function setText(el, value, attr, attrValue) {
  el.textContent = value;
  if (attr) el.setAttribute(attr, String(attrValue));
}

function workerElement(id) {
  const root = document.getElementById("workers");
  let el = root.querySelector(`article[data-worker-id="${CSS.escape(id)}"]`);
  if (el) return el;
  el = document.getElementById("worker-template").content.firstElementChild.cloneNode(true);
  el.dataset.workerId = id;
  el.id = "worker-" + id;
  root.appendChild(el);
  return el;
}

function drawBlocks(el, pool) {
  // One cell per block, coloured by state; the canvas records how many it drew of each.
  const box = el.querySelector(".blocks");
  let canvas = box.querySelector("canvas");
  if (!canvas) {
    canvas = document.createElement("canvas");
    canvas.className = "block-canvas";
    box.appendChild(canvas);
  }
  const states = pool.block_states || "";
  const n = states.length;
  const width = Math.max(200, Math.min(box.clientWidth || 960, 1200));
  const cell = Math.max(2, Math.min(10, Math.floor(Math.sqrt((width * 360) / Math.max(1, n)))));
  const perRow = Math.max(1, Math.floor(width / cell));
  canvas.width = width;
  canvas.height = Math.max(cell, Math.ceil(n / perRow) * cell);
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const drawn = { free: 0, in_use: 0, cached: 0, shared: 0 };
  const gap = cell > 3 ? 1 : 0;
  for (let i = 0; i < n; i++) {
    const name = STATES[states.charCodeAt(i) - 48] || "free";
    drawn[name] += 1;
    ctx.fillStyle = COLORS[name];
    ctx.fillRect((i % perRow) * cell, Math.floor(i / perRow) * cell, cell - gap, cell - gap);
  }
  for (const name of STATES) {
    canvas.setAttribute("data-drawn-" + name.replace("_", "-"), String(drawn[name]));
  }
  canvas.setAttribute("data-drawn-total", String(n));
}

function renderJobs(el, jobs) {
  const ul = el.querySelector(".jobs");
  ul.replaceChildren();
  for (const job of jobs) {
    const li = document.createElement("li");
    li.dataset.jobId = job.id;
    const pct = job.fraction == null ? null : Math.round(job.fraction * 100);
    const bar = document.createElement("span");
    bar.className = "bar";
    const fill = document.createElement("span");
    fill.style.width = (pct == null ? 100 : pct) + "%";
    if (pct == null) fill.style.opacity = "0.35";
    bar.appendChild(fill);
    const label = document.createElement("span");
    label.textContent = `${job.id.slice(0, 12)} ${job.tokens}` +
      (job.max_tokens ? `/${job.max_tokens}` : "") + " tok";
    li.dataset.progress = pct == null ? "" : String(pct);
    li.append(label, bar);
    ul.appendChild(li);
  }
}

// The prefix groups a worker serves (prefix-aware admission): signature, cached blocks, hits.
function renderPrefixes(el, prefixes) {
  const body = el.querySelector(".prefixes tbody");
  body.replaceChildren();
  for (const g of prefixes || []) {
    const tr = document.createElement("tr");
    tr.dataset.signature = g.signature;
    tr.dataset.blocks = g.blocks;
    tr.dataset.hits = g.hits;
    const flag = g.warming ? "warming" : (g.owned ? "owned" : "");
    for (const v of [g.signature, g.blocks, g.jobs, g.hits, g.running, flag]) {
      const td = document.createElement("td");
      td.textContent = String(v);
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

function renderWorker(w, info) {
  const el = workerElement(w.worker_id);
  el.querySelector(".worker-id").textContent = w.worker_id;
  el.querySelector(".worker-model").textContent = w.model;
  el.querySelector(".worker-state").textContent =
    `${w.state} · ${w.running} running · ${w.waiting} waiting · ` +
    `hit rate ${(100 * w.prefix_cache_hit_rate).toFixed(1)}%`;
  const pool = w.pool;
  if (pool) {
    for (const name of STATES) {
      const b = el.querySelector(`.count[data-state="${name}"]`);
      setText(b, pool.block_state_counts[name], "data-count", pool.block_state_counts[name]);
    }
    const stats = el.querySelector(".pool-stats");
    stats.dataset.blocksTotal = pool.blocks_total;
    stats.dataset.blocksFree = pool.blocks_free;
    stats.dataset.blocksInUse = pool.blocks_in_use;
    stats.dataset.blocksCached = pool.blocks_cached;
    stats.dataset.blocksShared = pool.blocks_shared;
    stats.textContent =
      `${pool.blocks_total} blocks × ${pool.block_size} · free ${pool.blocks_free} ` +
      `(cached ${pool.blocks_cached}) · in use ${pool.blocks_in_use} ` +
      `(shared ${pool.blocks_shared}) · usage ${(100 * pool.usage).toFixed(1)}% · ` +
      `${pool.tokens_stored} tokens stored · fragmentation ${(100 * pool.fragmentation).toFixed(1)}%` +
      (pool.kv_cache_dtype
        ? ` · ${pool.kv_cache_dtype} cache ${(pool.kv_cache_bytes / 2 ** 20).toFixed(1)} MiB`
        : "");
    drawBlocks(el, pool);
  }
  renderPrefixes(el, w.prefixes);
  renderJobs(el, info ? info.jobs : []);
}

function drawSparkline() {
  const canvas = document.getElementById("sparkline");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (history.length < 2) return;
  const max = Math.max(1, ...history);
  ctx.strokeStyle = COLORS.in_use;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  history.forEach((v, i) => {
    const x = (i / (HISTORY_POINTS - 1)) * canvas.width;
    const y = canvas.height - 2 - (v / max) * (canvas.height - 4);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
  canvas.dataset.points = String(history.length);
}

function renderSummary(pool, workers) {
  for (const prio of ["interactive", "bulk"]) {
    const depth = pool.queues[prio] || 0;
    setText(document.getElementById("queue-" + prio), depth, "data-depth", depth);
  }
  const count = pool.workers.length;
  setText(document.getElementById("worker-count"), count, "data-count", count);
  const tput = pool.workers.reduce((s, w) => s + w.throughput_tok_s, 0);
  setText(document.getElementById("throughput"), tput.toFixed(1), "data-value", tput);
  let queried = 0, hits = 0;
  for (const w of pool.workers) {
    queried += w.prefix_cache.queried_tokens;
    hits += w.prefix_cache.hit_tokens;
  }
  const rate = queried ? hits / queried : 0;
  setText(document.getElementById("hit-rate"), queried ? (100 * rate).toFixed(1) + "%" : "–",
    "data-value", rate);
  history.push(tput);
  if (history.length > HISTORY_POINTS) history.shift();
  drawSparkline();
  const byId = Object.fromEntries(workers.data.map((w) => [w.worker_id, w]));
  const live = new Set();
  for (const w of pool.workers) {
    live.add(w.worker_id);
    renderWorker(w, byId[w.worker_id]);
  }
  for (const el of document.querySelectorAll("#workers article")) {
    if (!live.has(el.dataset.workerId)) el.remove();
  }
}

function renderTenants(tenants) {
  const section = document.getElementById("tenants");
  const body = section.querySelector("tbody");
  body.replaceChildren();
  for (const t of tenants.data) {
    const row = document.createElement("tr");
    row.dataset.tenant = t.tenant;
    for (const key of ["tenant", "queued", "running", "tokens_generated", "jobs_finished",
      "file_bytes"]) {
      const cell = document.createElement("td");
      cell.textContent = String(t[key]);
      cell.dataset.field = key;
      row.append(cell);
    }
    body.append(row);
  }
  section.hidden = tenants.data.length === 0;
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const [pool, workers, tenants] = await Promise.all(
      [getJson("v1/pool"), getJson("v1/workers"), getJson("v1/tenants")]);
    renderSummary(pool, workers);
    renderTenants(tenants);
    setText(status, "live", "data-state", "ok");
    document.getElementById("updated").textContent = new Date().toLocaleTimeString();
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  } catch (err) {
    setText(status, String(err.message || err), "data-state", "error");
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

const css = getComputedStyle(document.documentElement);
for (const name of STATES) COLORS[name] = css.getPropertyValue("--" + name).trim();
refresh();
