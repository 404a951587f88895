// hybridflow view: polls the server's JSON endpoints (server.py) and draws the run.
// Curves are SVG paths drawn here; data is only ever put in the page as text
// (textContent), never as HTML: a generation may hold anything.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const DEFAULT_CURVES = ["reward/mean", "val/reward/mean", "response_length/mean", "timing/step"];
const KNOWN_SAMPLE_KEYS = new Set([
  "step", "split", "sample", "prompt_index", "data_source", "prompt", "response",
  "prompt_ids", "response_ids", "reward", "advantage", "response_length", "turns", "num_turns", "env_reward",
]);
const TIMING_WINDOW = 20; // steps the timing table averages over

const state = {
  rows: [], // metrics.jsonl rows so far
  generation: -1,
  next: 0,
  names: [],
  selected: [],
  picked: false, // the user chose curves: defaults no longer apply
  sampleQuery: null,
  sampleTotal: -1,
  sampleLimit: 100,
  pollMs: 3000,
  timer: null,
  files: {},
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(typeof c === "string" ? document.createTextNode(c) : c);
  }
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  if (Number.isInteger(v)) return String(v);
  return String(Number(v.toPrecision(4)));
}

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) {
    let why = r.statusText;
    try { why = (await r.json()).error || why; } catch (_) { /* not JSON */ }
    throw new Error(`${url}: ${r.status} ${why}`);
  }
  return r.json();
}

function notice(text) {
  const n = $("notice");
  n.hidden = !text;
  n.textContent = text || "";
}

// -- polling --------------------------------------------------------------------------
async function poll() {
  try {
    const info = await getJSON("/api/run");
    state.pollMs = info.poll_ms || state.pollMs;
    state.files = info.files;
    renderInfo(info);
    const m = await getJSON(`/api/metrics?since=${state.next}&generation=${state.generation}`);
    if (m.reset) state.rows = [];
    if (m.reset || m.rows.length) {
      state.rows.push(...m.rows);
      updateNames();
      renderMetricList();
      renderCharts();
      renderTiming();
    }
    state.next = m.next;
    state.generation = m.generation;
    if (!info.files["metrics.jsonl"] && !state.rows.length) {
      $("charts").replaceChildren(el("div", { class: "empty" }, "This run has no metrics.jsonl (the jsonl metrics backend writes it)."));
    }
    await refreshSamples(info.samples);
    notice("");
  } catch (e) {
    notice(`The viewer does not answer (${e.message}); retrying.`);
  }
  schedule();
}

function schedule() {
  clearTimeout(state.timer);
  if ($("live").checked) state.timer = setTimeout(poll, state.pollMs);
}

function renderInfo(info) {
  $("run-name").textContent = info.name;
  document.title = `${info.name} · hybridflow view`;
  const st = info.status;
  const badge = $("run-state");
  let text = st ? st.state : (info.summary ? "finished" : "no status");
  if (st && st.state === "running" && Date.now() / 1000 - st.updated > 30) text = "running? (no update for 30 s)";
  badge.textContent = text;
  badge.className = `badge ${st ? st.state : ""}`;
  const parts = [];
  if (info.last_step !== null) parts.push(`last step ${info.last_step}`);
  parts.push(`${info.train_steps} training rows, ${info.metric_rows - info.train_steps} validation rows`);
  parts.push(`${info.samples} samples`);
  if (st && st.error) parts.push(`error: ${st.error}`);
  const bad = info.bad_lines.metrics + info.bad_lines.samples;
  if (bad) parts.push(`${bad} unreadable line(s) skipped`);
  $("run-progress").textContent = parts.join(" · ");
  $("updated").textContent = `read ${new Date().toLocaleTimeString()}`;
}

// -- curves ---------------------------------------------------------------------------
function updateNames() {
  const seen = new Set();
  for (const r of state.rows) {
    for (const [k, v] of Object.entries(r)) if (k !== "step" && typeof v === "number") seen.add(k);
  }
  state.names = [...seen].sort((a, b) => {
    const va = a.startsWith("val/"), vb = b.startsWith("val/");
    return va === vb ? a.localeCompare(b) : (va ? 1 : -1);
  });
  if (!state.picked) {
    let chosen = DEFAULT_CURVES.filter((n) => seen.has(n));
    if (!chosen.length) chosen = state.names.slice(0, 2);
    state.selected = chosen;
  } else {
    state.selected = state.selected.filter((n) => seen.has(n));
  }
}

function toggle(name) {
  state.picked = true;
  const i = state.selected.indexOf(name);
  if (i >= 0) state.selected.splice(i, 1);
  else state.selected.push(name);
  renderMetricList();
  renderCharts();
}

function renderMetricList() {
  const filter = $("metric-filter").value.trim().toLowerCase();
  const list = $("metric-list");
  const out = [];
  let group = null;
  for (const name of state.names) {
    if (filter && !name.toLowerCase().includes(filter)) continue;
    const g = name.startsWith("val/") ? "validation" : (name.includes("/") ? name.split("/")[0] : "other");
    if (g !== group) {
      group = g;
      out.push(el("div", { class: "group" }, g));
    }
    const b = el("button", { type: "button", class: state.selected.includes(name) ? "on" : "", "data-metric": name }, name);
    b.addEventListener("click", () => toggle(name));
    out.push(b);
  }
  if (!out.length) out.push(el("div", { class: "empty" }, state.names.length ? "no metric matches" : "no metrics yet"));
  list.replaceChildren(...out);
}

function renderCharts() {
  const charts = $("charts");
  const cards = state.selected.map((name) => chartCard(name));
  if (!cards.length) cards.push(el("div", { class: "empty" }, state.names.length ? "pick a metric on the left" : "waiting for the first step"));
  charts.replaceChildren(...cards);
}

function series(name) {
  const pts = [];
  for (const r of state.rows) {
    const v = r[name];
    if (typeof v === "number" && Number.isFinite(v) && typeof r.step === "number") pts.push([r.step, v]);
  }
  pts.sort((a, b) => a[0] - b[0]);
  return pts;
}

function ticks(lo, hi, n) {
  if (hi === lo) return [lo];
  const raw = (hi - lo) / n;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Number(t.toPrecision(12)));
  return out;
}

function chartCard(name) {
  const pts = series(name);
  const W = 420, H = 200, L = 48, R = 10, T = 10, B = 24;
  const val = name.startsWith("val/");
  const svg = svgEl("svg", { class: `chart${val ? " val" : ""}`, viewBox: `0 0 ${W} ${H}`, "data-metric": name, role: "img" });
  const title = el("div", { class: "title" }, name);
  const last = pts.length ? pts[pts.length - 1] : null;
  title.append(el("span", { class: "last" }, last ? `step ${last[0]}: ${fmt(last[1])}` : "no points"));
  const close = el("button", { type: "button", class: "close", title: "remove" }, "×");
  close.addEventListener("click", () => toggle(name));
  title.append(close);
  const card = el("div", { class: "chart-card" }, title);
  card.append(svg);
  if (!pts.length) return card;

  let x0 = pts[0][0], x1 = pts[pts.length - 1][0];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const pad = (y1 - y0) * 0.05;
  y0 -= pad; y1 += pad;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);

  for (const t of ticks(y0, y1, 4)) {
    svg.append(svgEl("line", { class: "axis", x1: L, x2: W - R, y1: sy(t), y2: sy(t) }));
    const label = svgEl("text", { class: "tick", x: L - 4, y: sy(t) + 3, "text-anchor": "end" });
    label.textContent = fmt(t);
    svg.append(label);
  }
  for (const t of ticks(x0, x1, 5).filter((t) => Number.isInteger(t))) {
    const label = svgEl("text", { class: "tick", x: sx(t), y: H - 8, "text-anchor": "middle" });
    label.textContent = String(t);
    svg.append(label);
  }
  const d = pts.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
  svg.append(svgEl("path", { class: "line", d, "data-points": pts.length }));
  if (pts.length <= 40) {
    for (const p of pts) svg.append(svgEl("circle", { cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1), r: 2.2 }));
  }
  const cursor = svgEl("line", { class: "cursor", y1: T, y2: H - B, visibility: "hidden" });
  const hover = svgEl("text", { class: "hover", x: L + 4, y: T + 10 });
  svg.append(cursor, hover);
  svg.addEventListener("mousemove", (ev) => {
    const box = svg.getBoundingClientRect();
    const x = x0 + ((ev.clientX - box.left) * (W / box.width) - L) / (W - L - R) * (x1 - x0);
    let best = pts[0];
    for (const p of pts) if (Math.abs(p[0] - x) < Math.abs(best[0] - x)) best = p;
    cursor.setAttribute("x1", sx(best[0]));
    cursor.setAttribute("x2", sx(best[0]));
    cursor.setAttribute("visibility", "visible");
    hover.textContent = `step ${best[0]}: ${fmt(best[1])}`;
  });
  svg.addEventListener("mouseleave", () => {
    cursor.setAttribute("visibility", "hidden");
    hover.textContent = "";
  });
  return card;
}

// -- timing ---------------------------------------------------------------------------
function renderTiming() {
  const train = state.rows.filter((r) => Object.keys(r).some((k) => k.startsWith("timing/")));
  const recent = train.slice(-TIMING_WINDOW);
  const box = $("timing");
  if (!recent.length) {
    box.replaceChildren(el("div", { class: "empty" }, "no timing/* metrics yet"));
    $("timing-note").textContent = "";
    return;
  }
  const mean = (key) => {
    const vs = recent.map((r) => r[key]).filter((v) => typeof v === "number");
    return vs.length ? vs.reduce((a, b) => a + b, 0) / vs.length : null;
  };
  const phases = [...new Set(recent.flatMap((r) => Object.keys(r)))]
    .filter((k) => k.startsWith("timing/") && k !== "timing/step" && k !== "timing/period")
    .map((k) => k.slice("timing/".length));
  const stepS = mean("timing/step");
  const rows = phases.map((p) => ({ p, wall: mean(`timing/${p}`), compute: mean(`compute/${p}`) }))
    .sort((a, b) => (b.wall || 0) - (a.wall || 0));
  const top = Math.max(stepS || 0, ...rows.map((r) => r.wall || 0)) || 1;
  const body = rows.map((r) => {
    // Widths through the CSSOM: the page's CSP refuses inline style attributes.
    const bar = el("div", { class: "bar-wrap" });
    const wall = el("div", { class: "wall" });
    wall.style.width = `${(100 * (r.wall || 0) / top).toFixed(1)}%`;
    bar.append(wall);
    if (r.compute !== null) {
      const compute = el("div", { class: "compute" });
      compute.style.width = `${(100 * r.compute / top).toFixed(1)}%`;
      bar.append(compute);
    }
    return el("tr", { "data-phase": r.p },
      el("td", {}, r.p),
      el("td", { class: "num" }, `${fmt(r.wall)} s`),
      el("td", { class: "num" }, r.compute === null ? "–" : `${fmt(r.compute)} s`),
      el("td", { class: "num" }, stepS ? `${Math.round((100 * (r.wall || 0)) / stepS)}%` : "–"),
      el("td", { class: "bar" }, bar));
  });
  const head = el("tr", {}, el("th", {}, "phase"), el("th", {}, "wall"), el("th", {}, "compute"), el("th", {}, "of step"), el("th", {}, ""));
  const foot = el("tr", {}, el("th", {}, "step"), el("th", { class: "num" }, `${fmt(stepS)} s`), el("th", {}, ""), el("th", {}, ""), el("th", {}, ""));
  box.replaceChildren(el("table", {}, el("thead", {}, head), el("tbody", {}, ...body, foot)));
  $("timing-note").textContent = `mean of the last ${recent.length} step(s); wall: the phase's first dispatch to its last result (streamed phases overlap, so shares may add past 100%); compute: time inside the ops`;
}

// -- samples --------------------------------------------------------------------------
function sampleQuery() {
  const q = new URLSearchParams();
  const put = (k, v) => { if (v !== "" && v !== null && v !== undefined) q.set(k, v); };
  put("split", $("f-split").value);
  put("step", $("f-step").value);
  if ($("f-source").value !== "*") q.set("source", $("f-source").value);
  put("min_reward", $("f-min").value);
  put("max_reward", $("f-max").value);
  put("q", $("f-q").value.trim());
  q.set("limit", String(state.sampleLimit));
  return q.toString();
}

async function refreshSamples(total, force) {
  const query = sampleQuery();
  if (!force && query === state.sampleQuery && total === state.sampleTotal) return;
  const seq = (state.sampleSeq = (state.sampleSeq || 0) + 1);
  const res = await getJSON(`/api/samples?${query}`);
  // A newer request (a filter changed, or the next poll) went out meanwhile: its answer,
  // not this older one, is what the table must show (responses may arrive out of order).
  if (seq !== state.sampleSeq || query !== sampleQuery()) return;
  state.sampleQuery = query;
  state.sampleTotal = res.total;
  fillSelect($("f-split"), res.splits, "", "all");
  fillSelect($("f-step"), res.steps.map(String), "", "all");
  fillSelect($("f-source"), res.sources, "*", "all", (s) => s || "(none)");
  renderSamples(res);
}

function fillSelect(select, values, allValue, allLabel, label) {
  const current = select.value;
  const want = [allValue, ...values].join("\u0000");
  if (select.dataset.values === want) return;
  select.dataset.values = want;
  const opts = [el("option", { value: allValue }, allLabel)];
  for (const v of values) opts.push(el("option", { value: v }, label ? label(v) : v));
  select.replaceChildren(...opts);
  select.value = [allValue, ...values].includes(current) ? current : allValue;
}

function textCell(text) {
  return el("td", {}, el("pre", { class: "text" }, text === undefined ? "" : String(text)));
}

function idsOr(row, key) {
  if (row[key] !== undefined) return row[key];
  const ids = row[`${key}_ids`];
  return ids ? `[token ids] ${ids.join(" ")}` : "";
}

function scorerCell(row) {
  const td = el("td", {});
  const keys = Object.keys(row).filter((k) => !KNOWN_SAMPLE_KEYS.has(k));
  keys.sort((a, b) => (a === "ground_truth" ? -1 : b === "ground_truth" ? 1 : 0));
  for (const k of keys) {
    const v = row[k];
    const shown = typeof v === "object" && v !== null ? JSON.stringify(v) : fmt(v);
    td.append(el("span", { class: "chip", "data-key": k }, `${k}: ${shown}`));
  }
  return td;
}

function turnsCell(row) {
  const td = el("td", { class: "turns" });
  if (!Array.isArray(row.turns)) {
    td.textContent = "1";
    return td;
  }
  const details = el("details", {}, el("summary", {}, `${row.num_turns ?? row.turns.length} turns` + (row.env_reward !== undefined ? ` · env ${fmt(row.env_reward)}` : "")));
  row.turns.forEach((t, i) => {
    const turn = el("div", { class: "turn" }, el("div", { class: "label" }, `turn ${i + 1}`));
    turn.append(el("pre", { class: "text" }, idsOr(t, "response")));
    for (const c of t.tool_calls || []) {
      turn.append(c.error
        ? el("div", { class: "call error" }, `✗ ${c.error}`)
        : el("div", { class: "call" }, `→ ${c.name}(${JSON.stringify(c.arguments)})`));
    }
    if (t.observation !== undefined || t.observation_ids !== undefined) {
      turn.append(el("pre", { class: "text obs" }, idsOr(t, "observation")));
    }
    details.append(turn);
  });
  td.append(details);
  return td;
}

function renderSamples(res) {
  const body = $("samples").tBodies[0];
  const rows = res.rows.map((r) => el("tr", { class: "sample", "data-step": r.step, "data-split": r.split || "train" },
    el("td", { class: "num" }, String(r.step)),
    el("td", {}, r.split || "train"),
    el("td", {}, r.data_source || ""),
    textCell(idsOr(r, "prompt")),
    textCell(idsOr(r, "response")),
    el("td", { class: "num" }, fmt(r.reward)),
    el("td", { class: "num" }, fmt(r.advantage)),
    el("td", { class: "num" }, fmt(r.response_length)),
    scorerCell(r),
    turnsCell(r)));
  body.replaceChildren(...rows);
  $("samples-count").textContent = `${res.rows.length} shown of ${res.matched} matching (${res.total} in samples.jsonl)`;
  const empty = $("samples-empty");
  empty.hidden = res.total > 0;
  empty.textContent = state.files["samples.jsonl"]
    ? "No samples yet: the first lines come when the first step finishes."
    : "This run has no samples.jsonl: it was written by a version without samples, with metrics.samples_per_step: 0, or without the jsonl backend.";
  $("samples").hidden = res.total === 0;
  $("more").hidden = res.rows.length >= res.matched;
}

// -- wiring ---------------------------------------------------------------------------
function init() {
  $("metric-filter").addEventListener("input", renderMetricList);
  for (const id of ["f-split", "f-step", "f-source", "f-min", "f-max", "f-q"]) {
    $(id).addEventListener("input", () => { state.sampleLimit = 100; refreshSamples(state.sampleTotal, true).catch((e) => notice(e.message)); });
  }
  $("sample-filters").addEventListener("submit", (ev) => ev.preventDefault());
  $("more").addEventListener("click", () => { state.sampleLimit += 100; refreshSamples(state.sampleTotal, true).catch((e) => notice(e.message)); });
  $("live").addEventListener("change", () => { if ($("live").checked) poll(); else clearTimeout(state.timer); });
  poll();
}

document.addEventListener("DOMContentLoaded", init);
