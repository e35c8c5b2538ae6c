// edgeswarm dashboard: draws the server's snapshots (pushed as Server-Sent Events on /api/events) with plain DOM and
// SVG. No third-party library and no build step. Everything in a snapshot came from the cluster's messages: it is
// only ever set as text (textContent, attribute values), never parsed as HTML.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let latest = null;
let receivedAt = 0;
let connected = false;

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  return fill(el, attrs, children);
}
function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  return fill(el, attrs, children);
}
function fill(el, attrs, children) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined && v !== false) el.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.appendChild(typeof c === "object" ? c : document.createTextNode(String(c)));
  }
  return el;
}
function replace(id, ...children) {
  const el = document.getElementById(id);
  el.replaceChildren(...children.flat().filter((c) => c));
}

function bytes(b) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i += 1; }
  return (i === 0 || b >= 100 ? b.toFixed(0) : b.toFixed(1)) + " " + units[i];
}
function secs(v) { return v === null || v === undefined ? "-" : v < 1 ? (v * 1000).toFixed(1) + " ms" : v.toFixed(2) + " s"; }
function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }
function fmt(v, unit) {
  if (unit === "s") return secs(v);
  if (!unit && Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  const text = a >= 1000 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : a >= 0.01 ? v.toFixed(3) : v.toPrecision(2);
  return unit ? text + " " + unit : text;
}
function cls(text) { return String(text).replace(/[^a-z0-9_-]/gi, "_"); }

// --- nodes ---------------------------------------------------------------------------------------------------

function memoryBar(n) {
  const w = 250, budget = Math.max(n.memory_budget_bytes, 1);
  const used = Math.min(1, n.memory_used_bytes / budget), reserved = Math.min(1, n.reserved_memory_bytes / budget);
  const colour = (r) => (r >= 0.9 ? "#dc2626" : r >= 0.75 ? "#d97706" : "#1f9d55");
  return s("svg", { width: w, height: 34, class: "memory", "aria-label": "memory" },
    s("rect", { x: 0, y: 2, width: w, height: 10, fill: "#eef0f3", stroke: "#d8dce3" }),
    s("rect", { x: 0, y: 2, width: w * used, height: 10, fill: colour(used) }),
    s("rect", { x: 0, y: 14, width: w, height: 6, fill: "#eef0f3" }),
    s("rect", { x: 0, y: 14, width: w * reserved, height: 6, fill: "#7c3aed" }),
    s("line", { x1: w * 0.9, x2: w * 0.9, y1: 0, y2: 22, stroke: "#dc2626", "stroke-dasharray": "2,2" }),
    s("text", { x: 0, y: 32 }, `used ${bytes(n.memory_used_bytes)}, reserved ${bytes(n.reserved_memory_bytes)} / ${bytes(n.memory_budget_bytes)}`),
    s("title", {}, "memory: used (top bar), reserved for jobs (bottom bar), against the node's budget; the dashed line is 90 %"));
}

function gauge(label, value, max, text) {
  const r = 22, c = Math.PI * r, frac = Math.max(0, Math.min(1, value / max));
  return s("svg", { width: 64, height: 46, class: "gauge", "data-gauge": label },
    s("path", { d: `M 10 36 A ${r} ${r} 0 0 1 54 36`, fill: "none", stroke: "#eef0f3", "stroke-width": 7 }),
    s("path", { d: `M 10 36 A ${r} ${r} 0 0 1 54 36`, fill: "none", stroke: frac > 0.85 ? "#dc2626" : "#2563eb",
      "stroke-width": 7, "stroke-dasharray": `${c * frac} ${c}` }),
    s("text", { x: 32, y: 34, "text-anchor": "middle" }, text),
    s("text", { x: 32, y: 45, "text-anchor": "middle" }, label));
}

function nodeCard(n) {
  const gauges = [];
  if (n.accelerator_utilization !== null && n.accelerator_utilization !== undefined)
    gauges.push(gauge("accel use", n.accelerator_utilization, 1, Math.round(n.accelerator_utilization * 100) + "%"));
  if (n.accelerator_temperature_c !== null && n.accelerator_temperature_c !== undefined)
    gauges.push(gauge("temp", n.accelerator_temperature_c, 100, Math.round(n.accelerator_temperature_c) + "\u00b0C"));
  return h("div", { class: `card node ${n.state === "offline" ? "state-offline-card" : ""}`, "data-node": n.node, "data-state": n.state },
    h("h3", {}, n.node, " ", h("span", { class: `badge state-${cls(n.state)}`, "data-role": "state" }, n.state)),
    h("dl", { class: "kv" },
      h("dt", {}, "class"), h("dd", {}, n.device_class),
      h("dt", {}, "compute"), h("dd", {}, n.compute || "-"),
      h("dt", {}, "heartbeat"), h("dd", {}, n.heartbeat_age_s === null ? "-" : n.heartbeat_age_s.toFixed(1) + " s ago"),
      h("dt", {}, "data URL"), h("dd", {}, n.data_url || "-")),
    n.memory_budget_bytes > 0 ? memoryBar(n) : null,
    gauges.length ? h("div", { class: "gauges" }, gauges) : null,
    h("ul", { class: "services" }, n.services.map((sv) =>
      h("li", { class: `svc-${cls(sv.state)}` }, `${sv.service} (${sv.state}${sv.heartbeat_age_s !== null ? ", " + sv.heartbeat_age_s.toFixed(1) + " s" : ""})`))));
}

// --- links ---------------------------------------------------------------------------------------------------

function linkMatrix(links) {
  if (!links.length) return h("p", { class: "muted" }, "no link measured yet (profiles are measured when a job is planned)");
  const names = [...new Set(links.flatMap((l) => [l.src, l.dst]))].sort();
  const by = new Map(links.map((l) => [l.src + "->" + l.dst, l]));
  return h("table", { class: "matrix", id: "link-matrix" },
    h("tr", {}, h("th", {}, "from \\ to"), names.map((d) => h("th", {}, d))),
    names.map((src) => h("tr", {}, h("th", {}, src), names.map((dst) => {
      const l = by.get(src + "->" + dst);
      return h("td", {}, l ? `${(l.bandwidth_bps / 1e6).toFixed(1)} MB/s, ${secs(l.latency_s)}` : src === dst ? "" : "-");
    }))));
}

// --- jobs ----------------------------------------------------------------------------------------------------

function planDrawing(plan, nodeStates) {
  const groups = plan.groups;
  const chain = plan.layout === "chain";
  const bw = 180, bh = 34, gap = chain ? 40 : 16, pad = 18;
  const rows = Math.max(...groups.map((g) => g.blocks.length), 1);
  const width = chain ? groups.length * (bw + gap) : Math.max(...groups.map((g) => g.blocks.length)) * (bw + 10) + 10;
  const height = chain ? pad + rows * (bh + 6) + 6 : groups.length * (pad + bh + 8) + 4;
  const svg = s("svg", { width: Math.max(width, 200), height, class: "plan", "data-layout": plan.layout });
  groups.forEach((g, gi) => {
    const gx = chain ? gi * (bw + gap) : 4, gy = chain ? 0 : gi * (pad + bh + 8);
    svg.appendChild(s("text", { x: gx, y: gy + 12, class: "plan-group" }, g.label));
    g.blocks.forEach((b, bi) => {
      const x = chain ? gx : gx + bi * (bw + 10), y = chain ? pad + bi * (bh + 6) : gy + pad;
      const offline = nodeStates.get(b.device) === "offline";
      const block = s("g", { class: `plan-block${offline ? " offline" : ""}`, "data-device": b.device },
        s("rect", { x, y, width: bw, height: bh, rx: 4 }),
        s("rect", { x, y: y + bh - 4, width: bw * b.share, height: 4, fill: "#2563eb" }),
        s("text", { x: x + 5, y: y + 13 }, b.device + (b.share < 0.999 ? ` ${(b.share * 100).toFixed(0)}%` : "")),
        s("text", { x: x + 5, y: y + 26, class: "muted" }, b.detail.slice(0, 34)),
        s("title", {}, `${b.device}: ${b.detail}`));
      svg.appendChild(block);
    });
    if (chain && gi < groups.length - 1) {
      const ax = gx + bw + 4, ay = pad + bh / 2;
      svg.appendChild(s("path", { d: `M ${ax} ${ay} L ${ax + gap - 10} ${ay} l -5 -4 m 5 4 l -5 4`, stroke: "#6b7280", fill: "none" }));
    }
  });
  return h("figure", { class: "plan-figure" }, svg, h("figcaption", {}, `plan epoch ${plan.epoch}: ${plan.summary}`));
}

function chart(series) {
  const w = 260, hgt = 120, l = 44, b = 18, t = 8;
  const pts = series.points;
  const xs = pts.map((p) => p.x), ys = pts.map((p) => p.y);
  if (series.predicted !== null && series.predicted !== undefined) ys.push(series.predicted);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(0, ...ys), y1 = Math.max(...ys);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y1 = y0 + 1; }
  const X = (x) => l + ((x - x0) / (x1 - x0)) * (w - l - 6);
  const Y = (y) => t + (1 - (y - y0) / (y1 - y0)) * (hgt - t - b);
  const svg = s("svg", { width: w, height: hgt, class: "chart", "data-series": series.name },
    s("line", { x1: l, x2: l, y1: t, y2: hgt - b, class: "axis" }),
    s("line", { x1: l, x2: w, y1: hgt - b, y2: hgt - b, class: "axis" }),
    s("text", { x: 2, y: t + 8 }, fmt(y1, series.unit)),
    s("text", { x: 2, y: hgt - b }, fmt(y0, series.unit)),
    s("text", { x: l, y: hgt - 4 }, `${series.x_label} ${fmt(Math.round(x0 * 10) / 10)}`),
    s("text", { x: w - 40, y: hgt - 4 }, fmt(Math.round(x1 * 10) / 10)));
  if (pts.length > 1)
    svg.appendChild(s("polyline", { points: pts.map((p) => `${X(p.x)},${Y(p.y)}`).join(" "), fill: "none", stroke: "#2563eb", "stroke-width": 1.5 }));
  for (const p of pts)
    svg.appendChild(s("circle", { cx: X(p.x), cy: Y(p.y), r: 2.5, fill: "#2563eb", class: "point", "data-series": series.name, "data-x": p.x },
      s("title", {}, `${series.x_label} ${p.x}: ${fmt(p.y, series.unit)}`)));
  if (series.predicted !== null && series.predicted !== undefined)
    svg.appendChild(s("line", { x1: l, x2: w, y1: Y(series.predicted), y2: Y(series.predicted), stroke: "#d97706", "stroke-dasharray": "4,3", class: "predicted" }));
  const last = pts[pts.length - 1];
  const caption = `${series.name}: ${fmt(last.y, series.unit)}` +
    (series.predicted !== null && series.predicted !== undefined ? ` (predicted ${fmt(series.predicted, series.unit)}, dashed)` : "");
  return h("figure", {}, svg, h("figcaption", {}, caption));
}

function timeline(events, start, end) {
  const w = 420, hgt = 34, pad = 6;
  if (!events.length) return null;
  const t0 = Math.min(start, ...events.map((e) => e.at)), t1 = Math.max(end, ...events.map((e) => e.at), t0 + 1);
  const X = (t) => pad + ((t - t0) / (t1 - t0)) * (w - 2 * pad);
  return s("svg", { width: w, height: hgt, class: "timeline" },
    s("line", { x1: pad, x2: w - pad, y1: 14, y2: 14, class: "axis" }),
    events.map((e) => s("circle", { cx: X(e.at), cy: 14, r: 4, class: `ev-dot ev-${cls(e.kind)}`,
      fill: /lost|fail/.test(e.kind) ? "#dc2626" : /recover|replan|join/.test(e.kind) ? "#1f9d55" : "#6b7280" },
      s("title", {}, `${clock(e.at)} ${e.kind}: ${e.detail}`))),
    s("text", { x: pad, y: 31 }, clock(t0)),
    s("text", { x: w - 70, y: 31 }, clock(t1)));
}

function schedule(view) {
  const lanes = view.lanes, bars = view.bars;
  const end = Math.max(...bars.map((b) => b.start_s + b.dur_s), 1e-6);
  const lw = 110, w = 520, lh = 12;
  const svg = s("svg", { width: w, height: lanes.length * (2 * lh + 6) + 16, class: "schedule" });
  lanes.forEach((lane, i) => {
    const y = i * (2 * lh + 6);
    svg.appendChild(s("text", { x: 0, y: y + lh + 4 }, lane));
    for (const b of bars.filter((b) => b.lane === lane)) {
      const row = b.source === "planned" ? 0 : 1;
      svg.appendChild(s("rect", { x: lw + (b.start_s / end) * (w - lw), y: y + row * lh, width: Math.max(1, (b.dur_s / end) * (w - lw)),
        height: lh - 2, class: `bar-${b.source} cat-${cls(b.cat)}` }, s("title", {}, `${b.source} ${b.name} (${b.cat}): ${secs(b.dur_s)} at ${secs(b.start_s)}`)));
    }
  });
  svg.appendChild(s("text", { x: lw, y: lanes.length * (2 * lh + 6) + 12 }, `0 .. ${secs(end)}: planned (light) above measured (dark)`));
  return h("figure", { class: "schedule-figure" }, svg, h("figcaption", {}, `round ${view.round}: planned beside measured`));
}

function jobCard(j, nodeStates) {
  return h("div", { class: "card job", "data-job": j.job_id, "data-kind": j.kind },
    h("h3", {}, j.job_id, " ", h("span", { class: `badge status-${cls(j.status)}` }, j.status), " ",
      h("span", { class: "muted small" }, `${j.kind}, ${j.model}`), " ",
      h("a", { href: `/api/trace/${encodeURIComponent(j.job_id)}`, class: "small" }, "trace (Perfetto)")),
    h("div", { class: "progress" }, j.progress, j.figures && j.figures !== "-" ? " \u2014 " + j.figures : ""),
    j.detail ? h("div", { class: "muted" }, j.detail) : null,
    h("div", { class: "row" },
      j.plan ? planDrawing(j.plan, nodeStates) : h("p", { class: "muted" }, "no plan yet"),
      j.series.map(chart)),
    j.schedule ? schedule(j.schedule) : null,
    timeline(j.events, j.submitted_at, j.updated_at),
    h("ol", { class: "events job-events" }, j.events.slice().reverse().slice(0, 40).map((e) =>
      h("li", { class: `event ev-${cls(e.kind)}`, "data-kind": e.kind }, `${clock(e.at)} [round ${e.round}] ${e.kind}: ${e.detail}`))));
}

// --- the page ------------------------------------------------------------------------------------------------

function render(snap) {
  latest = snap;
  receivedAt = Date.now() / 1000;
  document.getElementById("hub").textContent = `hub ${snap.hub_url}`;
  replace("warnings", snap.warnings.length ? snap.warnings.map((w) =>
    h("div", { class: `card warning ${w.severity}`, "data-check": w.check },
      h("strong", {}, `${w.subject}: `), w.problem, h("div", { class: "fix" }, "fix: ", w.fix)))
    : h("p", { class: "muted", id: "healthy" }, "no warnings"));
  replace("nodes", snap.nodes.length ? snap.nodes.map(nodeCard) : h("p", { class: "muted" }, "no cluster view yet"));
  replace("links", linkMatrix(snap.links));
  const states = new Map(snap.nodes.map((n) => [n.node, n.state]));
  replace("jobs", snap.jobs.length ? snap.jobs.map((j) => jobCard(j, states)) : h("p", { class: "muted" }, "no jobs"));
  replace("cluster-events", snap.cluster_events.slice().reverse().slice(0, 60).map((e) =>
    h("li", { class: `event ev-${cls(e.kind)}`, "data-kind": e.kind }, `${clock(e.at)} ${e.node}/${e.service} ${e.kind}: ${e.detail}`)));
  freshness();
}

function freshness() {
  const el = document.getElementById("freshness");
  if (!latest) return;
  const age = Math.max(0, Date.now() / 1000 - latest.generated_at);
  const view = latest.view_at ? `, cluster view ${Math.max(0, Date.now() / 1000 - latest.view_at).toFixed(0)} s old` : "";
  el.textContent = `${connected ? "live" : "reconnecting"}: last updated ${clock(latest.generated_at)} (${age.toFixed(0)} s ago${view})`;
  el.className = `freshness ${connected && age < 30 ? "live" : "stale"}`;
  el.setAttribute("data-seq", latest.seq);
}

function connect() {
  const events = new EventSource("/api/events");
  events.addEventListener("open", () => { connected = true; freshness(); });
  events.addEventListener("error", () => {
    connected = false;
    freshness();
    // A refused stream (503: the server's streams are all taken) is not retried by the browser itself.
    if (events.readyState === EventSource.CLOSED) setTimeout(connect, 5000);
  });
  events.addEventListener("snapshot", (e) => {
    connected = true;
    try { render(JSON.parse(e.data)); } catch (err) { console.error("cannot draw the snapshot", err); }
  });
}

connect();
setInterval(freshness, 1000);  // only the "last updated" line: the data itself is pushed
