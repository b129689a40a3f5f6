// The fleet dashboard: state comes from GET /api/events (SSE; the login cookie authenticates it),
// actions go to the JSON API. No framework, no build step, no network beyond this origin.
"use strict";
const $ = (id) => document.getElementById(id);
const COLORS = ["#e07b39", "#3aa17e", "#8e5bd0", "#d04f7a", "#3f8fd2", "#9a8a2e", "#5e6d7e", "#c2462d"];
const state = {swarm: "", nodes: new Map(), rounds: new Map(), selected: null, es: null, connected: false,
  rollback: null, actions: [], margin: null, images: null, rollouts: new Map(), enrollments: [], auto: null, async: null,
  anomaly: new Map()};

// ---- the error banner: dismissable, and it clears itself once its condition is gone -------------
const banner = {resolved: null};
// A follower (a second fleet process on PostgreSQL) shows everything but refuses changes: say so.
function showRole(s) {
  const el = $("role");
  el.hidden = s.role !== "follower";
  el.textContent = s.leader ? `follower: changes go to ${s.leader}` : "follower: no process leads";
}

function showError(msg, resolved) {
  $("error-text").textContent = msg || "";
  $("error").hidden = !msg;
  banner.resolved = msg ? (resolved || null) : null;
}
function recheckBanner() {
  if (!$("error").hidden && banner.resolved && banner.resolved()) showError("");
}
$("error-close").addEventListener("click", () => showError(""));

function esc(s) { return String(s ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`); }
function ago(ts) {
  const s = Math.max(0, Date.now() / 1000 - ts);
  return s < 60 ? `${s.toFixed(0)}s ago` : s < 3600 ? `${(s / 60).toFixed(0)}m ago` : `${(s / 3600).toFixed(1)}h ago`;
}
function dur(s) {
  if (s == null) return "";
  return s < 60 ? `${s.toFixed(0)} s` : s < 3600 ? `${(s / 60).toFixed(0)} min` : s < 86400 ? `${(s / 3600).toFixed(1)} h` : `${(s / 86400).toFixed(1)} d`;
}
function bytes(n) {
  if (n == null) return "";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(n >= 10 || i === 0 ? 0 : 1)} ${u[i]}`;
}
function pct(x) { return x == null ? "" : `${(100 * x).toFixed(1)}%`; }
function nodeColor(id) { return COLORS[[...state.nodes.keys()].sort().indexOf(id) % COLORS.length] || "#888"; }

async function api(method, path, body) {
  const r = await fetch(path, {method, credentials: "same-origin",
    headers: body ? {"Content-Type": "application/json"} : {}, body: body ? JSON.stringify(body) : undefined});
  if (r.status === 401) { location.replace("/login"); throw new Error("not signed in"); }
  const data = await r.json().catch(() => ({}));
  if (!r.ok) {
    const e = new Error(`${r.status}: ${data.error || r.statusText}`);
    e.status = r.status;
    throw e;
  }
  return data;
}

// ---- nodes ------------------------------------------------------------------------------
function device(n) {
  // board (target preset) and arch are often the same word: show it once.
  const parts = [n.board, n.arch].filter(Boolean);
  return [...new Set(parts)].join(" · ");
}

function artifact(n) {
  const a = n.artifact;
  if (!a) return esc(n.model);
  const tuned = a.tuned ? `<span class="tag ok">tuned</span>` : `<span class="tag">untuned</span>`;
  return `${esc(a.model || n.model)} <span class="muted">${esc(a.target)}</span> ${tuned}` +
    (a.tvm_version ? ` <span class="muted">TVM ${esc(a.tvm_version)}</span>` : "") + precision(n);
}

// int8 serving (edgenode/requantize.py): which committed version the int8 library was built from;
// while a rebuild runs (or after one failed) it is behind the node's model version.
function precision(n) {
  const i = n.inference;
  if (!i || i.precision !== "int8") return "";
  const ok = i.int8_state === "current";
  const why = i.int8_state === "failed" ? ` title="${esc(i.error || "rebuild failed")}"` : "";
  return ` <span class="tag${ok ? " ok" : ""}"${why}>int8 v${esc(i.built_from_version)}` +
    `${ok ? "" : ` ${esc(i.int8_state)}`}</span>`;
}

// The node table shows one page of NODE_PAGE rows (a fleet may have a thousand nodes), optionally
// filtered; node events re-render it at most every NODE_RENDER_MS, not once per event.
const NODE_PAGE = 50;
const NODE_RENDER_MS = 150;
const nodeView = {page: 0, filter: "", timer: null};
function scheduleNodes() {
  // one redraw of the node table and the anomaly card per NODE_RENDER_MS, however many statuses arrive
  if (nodeView.timer === null) {
    nodeView.timer = setTimeout(() => { nodeView.timer = null; renderNodes(); renderAnomaly(); }, NODE_RENDER_MS);
  }
}
function nodeMatches(n, f) {
  return !f || [n.node_id, n.state, n.site, n.board, n.arch].some((v) => v && String(v).toLowerCase().includes(f));
}
$("node-filter").addEventListener("input", () => {
  nodeView.filter = $("node-filter").value.trim().toLowerCase(); nodeView.page = 0; renderNodes();
});
$("nodes-prev").addEventListener("click", () => { nodeView.page -= 1; renderNodes(); });
$("nodes-next").addEventListener("click", () => { nodeView.page += 1; renderNodes(); });

function renderNodes() {
  if (nodeView.timer !== null) { clearTimeout(nodeView.timer); nodeView.timer = null; }
  const all = [...state.nodes.keys()].sort();
  const online = all.filter((id) => state.nodes.get(id).online).length;
  $("node-count").textContent = `${online} online / ${all.length}`;
  $("no-nodes").hidden = all.length > 0;
  $("node-pager").hidden = all.length <= NODE_PAGE;  // a small fleet fits one page: no pager, no filter
  const ids = all.filter((id) => nodeMatches(state.nodes.get(id), nodeView.filter));
  const pages = Math.max(1, Math.ceil(ids.length / NODE_PAGE));
  nodeView.page = Math.min(Math.max(0, nodeView.page), pages - 1);
  const first = nodeView.page * NODE_PAGE;
  const shown = ids.slice(first, first + NODE_PAGE);
  $("node-range").textContent = (shown.length ? `${first + 1}–${first + shown.length} of ${ids.length}` : "none")
    + (ids.length < all.length ? ` (of ${all.length})` : "");
  $("nodes-prev").disabled = nodeView.page === 0;
  $("nodes-next").disabled = nodeView.page >= pages - 1;
  $("nodes").querySelector("tbody").innerHTML = shown.map((id) => {
    const n = state.nodes.get(id);
    const h = n.health;
    const samples = n.samples_train != null ? `${n.samples_train} / ${n.samples_val ?? 0}` : `${n.samples}`;
    const val = n.validation;
    const url = n.api_url ? `<div class="muted small"><a href="${esc(n.api_url)}/v1/node" target="_blank" rel="noopener">${esc(n.api_url)}</a></div>` : "";
    const im = n.image;
    return `<tr data-node-id="${esc(id)}" data-state="${esc(n.state)}" data-version="${esc(n.model_version)}"
      data-image-version="${esc(im ? im.version : "")}" data-image-slot="${esc(im ? im.slot : "")}" data-image-health="${esc(im ? im.health : "")}">
      <td><b>${esc(id)}</b>${url}</td><td>${esc(device(n))}</td>
      <td><span class="badge ${esc(n.state)}" title="${esc(n.offline_reason || "")}">${esc(n.state)}</span>${halted(n)}${leftOut(n)}</td>
      <td>${artifact(n)}</td>
      <td class="image">${imageCell(im)}</td>
      <td class="version"><b>v${esc(n.model_version)}</b> <span class="hash" title="${esc(n.params_sha256)}">${esc(n.params_short)}</span></td>
      <td class="num">${h ? dur(h.uptime_s) : ""}</td>
      <td class="num">${h ? `${h.cpu_percent.toFixed(0)}% · ${bytes(h.mem_rss_bytes)}` : ""}</td>
      <td class="num">${h ? bytes(h.disk_free_bytes) : ""}</td>
      <td class="num">${esc(samples)}</td>
      <td class="num val-acc" title="${val ? `loss ${val.loss.toFixed(4)} on ${val.samples} samples` : ""}">${val ? (val.accuracy != null ? pct(val.accuracy) : `loss ${val.loss.toFixed(3)}`) : ""}</td>
      <td class="seen" data-ts="${n.last_seen}">${ago(n.last_seen)}</td></tr>`;
  }).join("");
  renderParticipants();
  renderRolloutNodes();
  recheckBanner();
}

// ---- anomaly scores: what anomaly models report of their stream windows, kept for the chart ------
const ANOMALY_KEEP = 900;  // points per node
function absorbAnomaly(n) {
  const a = n.anomaly;
  if (!a) return;
  let h = state.anomaly.get(n.node_id);
  if (!h) { h = {points: new Map(), labelled: new Map(), threshold: null}; state.anomaly.set(n.node_id, h); }
  for (const [t, s] of a.scores) h.points.set(t, s);
  while (h.points.size > ANOMALY_KEEP) h.points.delete(h.points.keys().next().value);
  for (const [t0, t1] of a.labelled) h.labelled.set(`${t0}`, [t0, t1]);
  h.threshold = a.threshold;
}

function renderAnomaly() {
  const card = $("anomaly-card");
  card.hidden = state.anomaly.size === 0;
  if (card.hidden) return;
  const ids = [...state.anomaly.keys()].sort();
  const all = ids.flatMap((id) => [...state.anomaly.get(id).points.keys()]);
  const base = all.length ? Math.min(...all) : 0, end = all.length ? Math.max(...all) : 0;
  const series = [], bands = [];
  for (const id of ids) {
    const h = state.anomaly.get(id);
    const pts = [...h.points].sort((p, q) => p[0] - q[0]).map(([t, s]) => [t - base, s]);
    series.push({label: id, color: nodeColor(id), width: 1.5, points: pts, dots: pts.length < 2});
    if (h.threshold != null && pts.length) {
      series.push({label: `${id} threshold`, color: nodeColor(id), width: 1, dash: [5, 4], alpha: 0.8,
        points: [[pts[0][0], h.threshold], [pts[pts.length - 1][0], h.threshold]]});
    }
    for (const [t0, t1] of h.labelled.values()) if (t1 >= base && t0 <= end) bands.push([t0 - base, t1 - base]);
  }
  const canvas = $("anomaly-plot");
  LossPlot.draw(canvas, series, {xlabel: "time (s)", ylabel: "anomaly score", xInteger: false,
    empty: "waiting for stream windows…", bands});
  canvas.dataset.points = String(series.filter((s) => !s.dash).reduce((k, s) => k + s.points.length, 0));
  $("anomaly-legend").innerHTML = series.filter((s) => !s.dash).map((s) => `<span><i style="background:${s.color}"></i>${esc(s.label)}</span>`).join("") +
    (bands.length ? `<span><i style="background:rgba(208, 79, 122, 0.35)"></i>labelled anomalous</span>` : "");
}

// ---- enrolment: devices that announced themselves with a token wait for the operator --------------
function renderEnrollments() {
  const rows = state.enrollments.filter((e) => e.state === "pending" || Date.now() / 1000 - (e.decided_at || 0) < 86400);
  const pending = rows.filter((e) => e.state === "pending").length;
  $("enrol-count").textContent = pending ? `${pending} pending` : "";
  $("no-enrollments").hidden = rows.length > 0;
  $("enrollments").querySelector("tbody").innerHTML = rows.map((e) => {
    const fp = e.key_fingerprint.replace("SHA256:", "");
    const acts = e.state === "pending"
      ? `<button type="button" class="small" data-enrol="accept" data-device="${esc(e.device_id)}">accept</button>
         <button type="button" class="small secondary" data-enrol="reject" data-device="${esc(e.device_id)}">reject</button>`
      : e.state === "accepted" ? `<button type="button" class="small secondary" data-enrol="revoke" data-device="${esc(e.device_id)}">revoke</button>` : "";
    return `<tr data-device-id="${esc(e.device_id)}" data-state="${esc(e.state)}"><td><b>${esc(e.device_id)}</b></td>
      <td>${esc(e.arch)} <span class="muted">${esc(e.board)}</span></td>
      <td><span class="hash" title="${esc(e.key_fingerprint)}">${esc(fp.slice(0, 16))}…${esc(fp.slice(-8))}</span></td>
      <td>${ago(e.requested_at)}</td><td><span class="badge ${esc(e.state)}">${esc(e.state)}</span></td><td>${acts}</td></tr>`;
  }).join("");
}

$("enrollments").addEventListener("click", async (ev) => {
  const b = ev.target.closest("button[data-enrol]");
  if (!b) return;
  showError("");
  b.disabled = true;
  try {
    await api("POST", `/api/enrollments/${encodeURIComponent(b.dataset.device)}/${b.dataset.enrol}`);
    state.enrollments = (await api("GET", "/api/enrollments")).enrollments;
    renderEnrollments();
  } catch (e) {
    b.disabled = false;
    showError(`Not done (${b.dataset.enrol} ${b.dataset.device}): ${e.message}`, () => false);
  }
});

// A board that found no slot it may boot (`fractal boot` exited 78): why, until it boots again.
function halted(n) {
  if (n.state !== "halted") return "";
  return `<div class="muted small halt-reason">no bootable slot: ${esc(n.halt || "no reason given")}</div>`;
}

// A node the fleet leaves out of rounds (its peers kept naming it as the cause of failed rounds).
function leftOut(n) {
  if (!n.left_out) return "";
  return ` <span class="badge left-out" title="${esc(n.left_out)}">left out</span>` +
    `<div class="muted small left-out-reason">${esc(n.left_out)}</div>` +
    `<button type="button" class="small" data-readmit="${esc(n.node_id)}">readmit</button>`;
}

$("nodes").addEventListener("click", async (ev) => {
  const b = ev.target.closest("button[data-readmit]");
  if (!b) return;
  showError("");
  try {
    const view = await api("POST", `/api/nodes/${encodeURIComponent(b.dataset.readmit)}/readmit`);
    state.nodes.set(view.node_id, view);
    renderNodes();
  } catch (e) {
    showError(`Not readmitted: ${e.message}`, () => false);
  }
});

function imageCell(im) {
  if (!im) return `<span class="muted" title="not booted from a device image">&ndash;</span>`;
  const health = im.health === "passed" ? "good" : im.state === "trial" ? "trial" : (im.health || im.state);
  const upd = im.update;
  const u = upd && !["done"].includes(upd.phase) ? ` <span class="badge ${esc(upd.phase)}" title="${esc(upd.error || "")}">${esc(upd.phase.replace("_", " "))}</span>` : "";
  return `<b>${esc(im.version)}</b> <span class="muted">slot ${esc(im.slot)}</span> ` +
    `<span class="badge ${esc(health)}" title="health check of this boot: ${esc(im.health || "unknown")}">${esc(health)}</span>` +
    (im.previous ? ` <span class="muted small">prev ${esc(im.previous)}</span>` : "") + u;
}

// A node event that changes nothing a checkbox list shows (a heartbeat) leaves the list alone: with
// a thousand nodes, rebuilding it on every event is most of the page's work.
const listShown = {participants: null, rollout: null};
function unchanged(which, ids, facts) {
  const key = ids.map((id) => `${id}\u0000${facts(state.nodes.get(id))}`).join("\u0001");
  if (listShown[which] === key) return true;
  listShown[which] = key;
  return false;
}

const participantChoice = new Map();  // the operator's choices, kept while a node restarts
function renderParticipants() {
  const box = $("participants");
  const was = participantChoice;
  const ids = [...state.nodes.keys()].sort();
  if (unchanged("participants", ids, (n) => `${n.online}${n.left_out || ""}`)) return;
  box.innerHTML = ids.map((id) => {
    const n = state.nodes.get(id);
    const checked = n.online && !n.left_out && (was.has(id) ? was.get(id) : true);
    return `<label title="${esc(n.left_out || "")}"><input type="checkbox" value="${esc(id)}" ${checked ? "checked" : ""} ${n.online ? "" : "disabled"}>
      ${esc(id)}${n.left_out ? ` <span class="muted small">(left out)</span>` : ""}</label>`;
  }).join("") || `<span class="muted">no nodes</span>`;
}
$("participants").addEventListener("change", (ev) => {
  if (ev.target.matches("input[type=checkbox]")) participantChoice.set(ev.target.value, ev.target.checked);
  recheckBanner();
});

function selectedOnline() {
  return [...$("participants").querySelectorAll("input:checked")].map((i) => i.value)
    .filter((id) => state.nodes.get(id)?.online);
}

// ---- rounds -----------------------------------------------------------------------------
function lastLoss(r) {
  const c = r.loss.filter((s) => s.complete);
  const l = c.length ? c : r.loss;
  return l.length ? l[l.length - 1].mean : null;
}

function valText(v) {
  if (!v) return "";
  return v.accuracy != null ? pct(v.accuracy) : `loss ${v.loss.toFixed(3)}`;
}

function validationCell(r) {
  const {before, after} = r.validation || {};
  if (!before && !after) return "";
  let delta = "";
  if (before && after && before.accuracy != null && after.accuracy != null) {
    const d = 100 * (after.accuracy - before.accuracy);
    delta = ` <span class="${d < 0 ? "bad" : "ok"}">(${d >= 0 ? "+" : ""}${d.toFixed(1)})</span>`;
  }
  return `${valText(before)} &rarr; <b>${valText(after)}</b>${delta}`;
}

function outcome(r) {
  let s = `<span class="badge ${esc(r.state)}">${esc(r.state)}</span>`;
  if (r.finished_at) s += ` <span class="muted">${(r.finished_at - r.started_at).toFixed(1)} s</span>`;
  if (r.rollback) s += ` <span class="badge rolled-back" title="${esc(r.rollback.why || "")}">rolled back (${esc(r.rollback.by)})</span>`;
  else if (r.regressed) s += ` <span class="badge regressed" title="${esc(r.regressed)}">worse</span>`;
  return s;
}

function renderRounds() {
  const rounds = [...state.rounds.values()].sort((a, b) => b.started_at - a.started_at);
  $("no-rounds").hidden = rounds.length > 0;
  const busy = rounds.some((r) => r.state === "running") || state.rollback;
  $("rounds").querySelector("tbody").innerHTML = rounds.map((r) => {
    const ll = lastLoss(r);
    const agree = r.params_agree === null ? "" : r.params_agree ? `agree <span class="hash">${esc((r.params_sha256 || "").slice(0, 12))}</span>` : "DIFFER";
    const versions = r.version_after != null ? `v${r.version_before} &rarr; v${r.version_after}` : "";
    const canUndo = r.state === "done" && !r.rollback && r.version_after != null;
    const undo = canUndo ? `<button class="undo secondary small" data-undo="${esc(r.round_id)}" ${busy ? "disabled" : ""}>roll back</button>` : "";
    const trig = r.trigger && r.trigger !== "operator" ? ` <span class="badge auto" title="started by the fleet">${esc(r.trigger)}</span>` : "";
    return `<tr data-round-id="${esc(r.round_id)}" data-state="${esc(r.state)}" data-trigger="${esc(r.trigger || "operator")}" data-rolled-back="${r.rollback ? "1" : ""}" class="${r.round_id === state.selected ? "selected" : ""}">
      <td class="hash">${esc(r.round_id)}${trig}</td><td>${new Date(r.started_at * 1000).toLocaleTimeString()}</td>
      <td>${esc(r.participants.join(", "))}</td><td class="num">${r.loss.length ? r.loss[r.loss.length - 1].step + 1 : 0}/${r.steps}</td>
      <td>${outcome(r)}</td>
      <td class="num">${ll === null ? "" : ll.toFixed(4)}</td><td class="validation">${validationCell(r)}</td>
      <td>${versions}</td><td>${agree}</td>
      <td class="reason">${esc(r.reason || "")}</td><td>${undo}</td></tr>`;
  }).join("");
  renderPlot();
  recheckBanner();
}

function renderPlot() {
  const r = state.rounds.get(state.selected);
  const canvas = $("loss-plot");
  const byTime = $("xaxis").value === "time";
  const smooth = parseFloat($("smooth").value);
  const opts = {xlabel: byTime ? "wall time since the round started (s)" : "step", ylabel: "training loss",
    xInteger: !byTime};
  canvas.dataset.round = r ? r.round_id : "";
  canvas.dataset.state = r ? r.state : "";
  canvas.dataset.xaxis = byTime ? "time" : "step";
  if (!r) {
    LossPlot.draw(canvas, [], {...opts, empty: "start a round to see its loss"});
    $("legend").innerHTML = ""; $("plot-title").textContent = ""; canvas.dataset.smoothed = "0";
    return;
  }
  const last = r.loss.length ? r.loss[r.loss.length - 1].step + 1 : 0;
  $("plot-title").textContent = `round ${r.round_id} · ${r.state}` +
    (r.state === "running" ? ` · step ${last}/${r.steps}` : "") + ` · ${r.sync}`;
  const x = (s) => (byTime ? s.t : s.step);
  // Nodes report at their own pace: the mean is over steps every node covered (reported or interpolated).
  const complete = r.loss.filter((s) => s.complete);
  const meanSrc = complete.length ? complete : r.loss;
  const meanPts = meanSrc.map((s) => [x(s), s.mean]);
  const smoothed = LossPlot.ema(meanSrc.map((s) => s.mean), smooth).map((y, i) => [meanPts[i][0], y]);
  const series = [{label: smooth > 0 ? `mean, EMA ${smooth}` : "mean", color: "#17202b", width: 2.5, points: smoothed,
    dots: smoothed.length < 2}];
  series.push({label: "mean (raw)", color: "#17202b", width: 1, points: meanPts, line: false, dots: true, alpha: 0.35,
    dotRadius: 1.8});
  for (const id of r.participants) {
    series.push({label: id, color: nodeColor(id), width: 1, line: false, dots: true, alpha: 0.55, dotRadius: 1.6,
      points: r.loss.filter((s) => id in s.nodes).map((s) => [x(s), s.nodes[id]])});
  }
  LossPlot.draw(canvas, series, {...opts, empty: r.state === "running" ? "waiting for the first step…" : "no steps reported"});
  canvas.dataset.points = String(meanPts.length);
  canvas.dataset.smoothed = String(smoothed.length);
  $("legend").innerHTML = series.map((s) => `<span><i style="background:${s.color};opacity:${s.alpha ?? 1}"></i>${esc(s.label)}</span>`).join("");
}
$("xaxis").addEventListener("change", renderPlot);
$("smooth").addEventListener("change", renderPlot);

function upsertRound(r) {
  // A round read over HTTP can arrive after the event of a later change (two connections): keep
  // the newer copy by the fleet's event sequence number.
  const cur = state.rounds.get(r.round_id);
  if (cur && cur.seq > r.seq) return;
  const isNew = !cur;
  state.rounds.set(r.round_id, r);
  if (isNew && (state.selected === null || r.state === "running")) state.selected = r.round_id;
  renderRounds();
  if (isNew && r.trigger && r.trigger !== "operator") refreshActions();  // the fleet started it
}

// ---- automatic rounds (GET/PUT /api/auto-rounds) ---------------------------------------------
function autoSummary(p) {
  if (!p.enabled) return "Off: rounds start only when an operator starts one.";
  const parts = [];
  if (p.schedule?.enabled) {
    const w = p.schedule.window;
    parts.push(`every ${p.schedule.every_min} min${w ? ` between ${w.start} and ${w.end} UTC` : ""}`);
  }
  if (p.samples?.enabled) parts.push(`when the participants hold ${p.samples.threshold} new samples`);
  if (!parts.length) return "On, but no trigger is switched on.";
  return `On: ${parts.join(", or ")}; at least ${p.min_spacing_min} min apart, ${p.round?.steps} steps each.`;
}

function renderAuto() {
  const a = state.auto;
  $("auto-card").hidden = !a;
  if (!a) return;
  const p = a.policy, st = a.status;
  $("auto-enabled").checked = p.enabled;
  $("auto-summary").textContent = autoSummary(p);
  $("auto-card").dataset.enabled = p.enabled ? "1" : "";
  const next = st.next_due;
  $("auto-next").textContent = next == null ? "" : `next scheduled round: ${new Date(next * 1000).toLocaleTimeString()}` +
    ` (${next <= st.now ? "due now" : `in ${dur(next - st.now)}`})`;
  $("auto-next").dataset.due = next == null ? "" : String(next);
  const s = st.samples;
  $("auto-samples-row").hidden = !(p.enabled && p.samples.enabled);
  $("auto-progress").max = s.threshold; $("auto-progress").value = Math.min(s.total, s.threshold);
  $("auto-samples").textContent = `${s.total} / ${s.threshold} new samples (each node counts up to ${s.node_cap})`;
  $("auto-samples").dataset.total = String(s.total);
  const waits = Object.entries(st.waiting || {});
  $("auto-waiting").textContent = waits.map(([t, why]) => `${t} round waits: ${why}`).join("; ");
  if (document.activeElement?.closest("#auto-form")) return;  // do not overwrite what the operator types
  $("auto-schedule").checked = p.schedule.enabled; $("auto-every").value = p.schedule.every_min;
  $("auto-from").value = p.schedule.window?.start || ""; $("auto-to").value = p.schedule.window?.end || "";
  $("auto-on-samples").checked = p.samples.enabled; $("auto-threshold").value = p.samples.threshold;
  $("auto-spacing").value = p.min_spacing_min; $("auto-steps").value = p.round.steps;
}

async function putAuto(policy) {
  showError("");
  try {
    state.auto = await api("PUT", "/api/auto-rounds", policy);
    renderAuto();
    refreshActions();
  } catch (e) {
    showError(`Policy not saved: ${e.message}`, () => false);
    renderAuto();
  }
}

$("auto-enabled").addEventListener("change", () => {
  if (state.auto) putAuto({...state.auto.policy, enabled: $("auto-enabled").checked});
});

$("auto-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  if (!state.auto) return;
  const p = state.auto.policy;
  const from = $("auto-from").value, to = $("auto-to").value;
  putAuto({...p,
    schedule: {enabled: $("auto-schedule").checked, every_min: parseFloat($("auto-every").value),
      window: from && to ? {start: from, end: to} : null},
    samples: {enabled: $("auto-on-samples").checked, threshold: parseInt($("auto-threshold").value, 10)},
    min_spacing_min: parseFloat($("auto-spacing").value),
    round: {...p.round, steps: parseInt($("auto-steps").value, 10)}});
});

// ---- device images: catalogue, roll-outs, image rollbacks --------------------------------
// ---- asynchronous rounds (GET /api/async; the "async" event) ----------------------------------
function renderAsync() {
  const a = state.async;
  $("async-card").hidden = !a;
  if (!a) return;
  $("async-card").dataset.version = String(a.version);
  $("async-version").textContent = String(a.version);
  $("async-sha").textContent = a.sha256.slice(0, 12);
  $("async-sha").title = a.sha256;
  const k = a.pending.length;
  $("async-progress").max = a.buffer; $("async-progress").value = k;
  $("async-fill").textContent = `${k} of ${a.buffer} updates` + (k ? ` (from ${a.pending.join(", ")})` : "");
  $("async-fill").dataset.pending = String(k);
  $("async-bounds").textContent = `a version is made from ${a.buffer} updates; an update at most ${a.max_staleness} version${a.max_staleness === 1 ? "" : "s"} behind is taken`;
  const refused = Object.entries(a.refused || {});
  $("async-refused").textContent = refused.length ? `refused updates: ${refused.map(([why, n]) => `${n} ${why}`).join(", ")}` : "no update refused";
  $("async-refused").dataset.total = String(refused.reduce((t, [, n]) => t + n, 0));
  $("async-versions").querySelector("tbody").innerHTML = a.versions.slice(-10).reverse().map((v) => {
    const who = v.contributors.map((c) => `${esc(c.member)} (${c.staleness})`).join(", ") || "<span class=\"muted\">initial</span>";
    const ex = Object.entries(v.excluded || {});
    return `<tr data-version="${v.version}" data-contributors="${v.contributors.length}" data-excluded="${ex.length}">` +
      `<td>${v.version}</td><td class="seen" data-ts="${v.at}">${ago(v.at)}</td><td>${who}</td>` +
      `<td title="${esc(ex.map(([m, why]) => `${m}: ${why}`).join("; "))}">${ex.length || ""}</td></tr>`;
  }).join("");
}

function renderImages() {
  const card = $("images-card");
  card.hidden = state.images === null;  // this fleet has no catalogue
  const imgs = state.images || [];
  $("no-images").hidden = imgs.length > 0;
  $("images").querySelector("tbody").innerHTML = imgs.map((e) =>
    `<tr data-image-id="${esc(e.id)}" data-version="${esc(e.version)}"><td><b>${esc(e.version)}</b></td><td>${esc(e.board)}</td>
      <td>${esc(e.artifact)}</td><td class="num">${bytes(e.size)}</td><td class="hash">${esc(e.signer)}</td>
      <td class="hash" title="${esc(e.id)}">${esc(e.id.slice(0, 12))}</td></tr>`).join("");
  const sel = $("rollout-image");
  const was = sel.value;
  sel.innerHTML = imgs.map((e) => `<option value="${esc(e.id)}">${esc(e.version)} · ${esc(e.board)} · ${esc(e.id.slice(0, 8))}</option>`).join("");
  if (imgs.some((e) => e.id === was)) sel.value = was;
  else if (imgs.length) sel.value = imgs[imgs.length - 1].id;  // the newest upload
}

// The operator's choices, kept while a node is briefly offline (it restarts during an update).
const rolloutChoice = new Map();
function renderRolloutNodes() {
  const box = $("rollout-nodes");
  const ids = [...state.nodes.keys()].sort();
  if (unchanged("rollout", ids, (n) => `${n.online && !!n.image}`)) return;
  box.innerHTML = ids.map((id) => {
    const n = state.nodes.get(id);
    const ok = n.online && n.image;
    const checked = ok && (rolloutChoice.has(id) ? rolloutChoice.get(id) : true);
    return `<label title="${ok ? "" : "offline or not booted from a device image"}"><input type="checkbox" value="${esc(id)}" ${checked ? "checked" : ""} ${ok ? "" : "disabled"}>
      ${esc(id)}</label>`;
  }).join("") || `<span class="muted">no nodes</span>`;
}

$("rollout-nodes").addEventListener("change", (ev) => {
  if (ev.target.matches("input[type=checkbox]")) rolloutChoice.set(ev.target.value, ev.target.checked);
});

function checkedRolloutNodes() {
  return [...$("rollout-nodes").querySelectorAll("input:checked")].map((i) => i.value);
}

function renderRollout() {
  const all = [...state.rollouts.values()].sort((a, b) => b.started_at - a.started_at);
  const r = all[0];
  const box = $("rollout-progress");
  const running = all.some((x) => x.state === "running");
  $("rollout").disabled = running;
  $("image-rollback").disabled = running;
  if (!r) { box.innerHTML = ""; box.dataset.state = ""; box.dataset.id = ""; return; }
  box.dataset.state = r.state; box.dataset.id = r.rollout_id; box.dataset.kind = r.kind;
  const what = r.kind === "rollout" ? `Roll-out of ${esc(r.version)}` : "Image rollback";
  const stages = r.stages.map((stage, i) => `<li>${r.kind === "rollout" ? (i === 0 ? "canary: " : "then: ") : ""}` +
    stage.map((n) => {
      const p = r.nodes[n];
      const phase = p.phase === "done" ? "passed" : p.phase;
      return `<span class="node-phase" data-node="${esc(n)}" data-phase="${esc(phase)}">${esc(n)} <span class="badge ${esc(phase)}" title="${esc(p.error || "")}">${esc(phase.replace("_", " "))}</span></span>`;
    }).join(", ") + `</li>`).join("");
  box.innerHTML = `<div>${what} <span class="hash">${esc(r.rollout_id)}</span>: <span class="badge ${esc(r.state)}">${esc(r.state)}</span>` +
    (r.finished_at ? ` <span class="muted">${(r.finished_at - r.started_at).toFixed(1)} s</span>` : "") + `</div>` +
    `<ol>${stages}</ol>` + (r.reason ? `<div class="bad rollout-reason">${esc(r.reason)}</div>` : "");
}

function onRollout(r) {
  const before = state.rollouts.get(r.rollout_id);
  state.rollouts.set(r.rollout_id, r);
  renderRollout();
  if (r.state === "failed" && (!before || before.state !== "failed")) {
    showError(`${r.kind === "rollout" ? "Roll-out" : "Image rollback"} stopped: ${r.reason}`, () => false);
  }
  if (r.state !== "running") refreshActions();
}

$("upload-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const file = $("image-file").files[0];
  if (!file) return;
  showError("");
  $("upload").disabled = true;
  try {
    const r = await fetch("/api/images", {method: "POST", credentials: "same-origin",
      headers: {"Content-Type": "application/octet-stream"}, body: file});
    if (r.status === 401) { location.replace("/login"); return; }
    const data = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(`${r.status}: ${data.error || data.detail || r.statusText}`);
    state.images = (state.images || []).filter((e) => e.id !== data.id).concat([data]);
    renderImages();
    $("rollout-image").value = data.id;
    $("image-file").value = "";
  } catch (e) {
    showError(`Image not uploaded: ${e.message}`, () => false);
  } finally {
    $("upload").disabled = false;
  }
});

$("rollout-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  showError("");
  try {
    onRollout(await api("POST", "/api/rollouts", {image: $("rollout-image").value, nodes: checkedRolloutNodes()}));
  } catch (e) {
    showError(`Not rolled out: ${e.message}`, () => false);
  }
});

$("image-rollback").addEventListener("click", async () => {
  showError("");
  try {
    onRollout(await api("POST", "/api/image-rollback", {nodes: checkedRolloutNodes()}));
  } catch (e) {
    showError(`Not rolled back: ${e.message}`, () => false);
  }
});

// ---- operator actions -------------------------------------------------------------------
function actionText(a) {
  const d = a.detail || {};
  if (a.action === "start_round") {
    const q = d.request || {};
    return `round <span class="hash">${esc(d.round_id)}</span>: ${esc(q.steps)} steps${q.lr ? `, lr ${esc(q.lr)}` : ""}` +
      ` <span class="badge ${d.trigger && d.trigger !== "operator" ? "auto" : "operator"} trigger">${esc(d.trigger || "operator")}</span>`;
  }
  if (a.action === "auto_round.deferred") return `${esc(d.trigger)} round waits: ${esc(d.reason)}`;
  if (a.action === "auto_rounds.policy") return esc(autoSummary(d.policy || {}));
  if (a.action.startsWith("image.")) {
    const what = d.kind === "rollout" ? `${esc(d.version)}, canary ${esc(d.canary)}` : "previous slot";
    return `${esc((d.stages || []).flat().join(", "))}: ${what}${d.reason ? ` <span class="bad">${esc(d.reason)}</span>` : ""}`;
  }
  if (a.action.startsWith("rollback")) {
    return `${esc((d.nodes || []).join(", "))} to v${esc(d.to_version)} (${esc(d.by || "")}` +
      `${d.round_id ? `, round ${esc(d.round_id)}` : ""})${d.why ? `: ${esc(d.why)}` : ""}${d.reason ? ` <span class="bad">${esc(d.reason)}</span>` : ""}`;
  }
  return esc(JSON.stringify(d));
}

function renderActions() {
  $("no-actions").hidden = state.actions.length > 0;
  $("actions").querySelector("tbody").innerHTML = state.actions.map((a) =>
    `<tr data-action="${esc(a.action)}"><td>${new Date(a.ts * 1000).toLocaleString()}</td><td>${esc(a.action)}</td>
      <td>${actionText(a)}</td></tr>`).join("");
}

// Refreshes overlap (every round, rollback and policy change asks): only the newest request's
// answer is drawn, so an older, slower answer cannot overwrite a newer list.
let actionsAsked = 0;
async function refreshActions() {
  const ask = ++actionsAsked;
  try {
    const got = (await api("GET", "/api/actions?limit=20")).actions;
    if (ask === actionsAsked) { state.actions = got; renderActions(); }
  } catch (e) { /* next event retries */ }
}

function onRollback(rb) {
  state.rollback = rb.state === "pending" ? rb : null;
  $("rollback-note").textContent = rb.state === "pending" ? `rollback ${rb.rollback_id} to v${rb.to_version}: waiting for ${rb.nodes.join(", ")}…`
    : rb.state === "failed" ? `rollback ${rb.rollback_id} failed: ${rb.reason}` : `rollback ${rb.rollback_id}: every node is at v${rb.to_version}`;
  if (rb.state === "failed") showError(`Rollback failed: ${rb.reason}`, () => state.rollback !== null);
  renderRounds();
  refreshActions();
}

async function rollback(body) {
  showError("");
  try {
    onRollback(await api("POST", "/api/rollback", body));
  } catch (e) {
    showError(`Not rolled back: ${e.message}`, () => false);
  }
}

// ---- event stream -----------------------------------------------------------------------
function connect() {
  const es = new EventSource("/api/events");  // the HttpOnly cookie authenticates it
  state.es = es;
  es.addEventListener("open", () => {
    state.connected = true; $("live").textContent = "live"; $("live").className = "pill on"; recheckBanner();
  });
  es.addEventListener("error", () => {
    state.connected = false;
    $("live").textContent = "reconnecting…"; $("live").className = "pill off";
    showError("Lost the connection to the fleet service; reconnecting…", () => state.connected);
    // A 401 closes the stream for good: find out and go to the login page.
    if (es.readyState === EventSource.CLOSED) api("GET", "/api/nodes").then(() => setTimeout(connect, 2000), () => {});
  });
  es.addEventListener("snapshot", (ev) => {
    const s = JSON.parse(ev.data);
    state.swarm = s.swarm; $("swarm").textContent = `swarm ${s.swarm}`;
    showRole(s);
    state.nodes = new Map(s.nodes.map((n) => [n.node_id, n]));
    s.nodes.forEach(absorbAnomaly);
    state.rounds = new Map(s.rounds.map((r) => [r.round_id, r]));
    state.actions = s.actions || [];
    state.margin = s.margin;
    if (s.margin != null) $("rollback-note").textContent = s.auto_rollback ? `A round whose validation gets worse by more than ${s.margin} is rolled back automatically.` : "Automatic rollback is off.";
    if (!state.rounds.has(state.selected)) state.selected = s.rounds.length ? s.rounds[0].round_id : null;
    state.images = s.images ?? null;
    state.rollouts = new Map((s.rollouts || []).map((r) => [r.rollout_id, r]));
    state.enrollments = s.enrollments || [];
    state.auto = s.auto_rounds || null;
    state.async = s.async || null;
    renderAsync();
    renderNodes(); renderRounds(); renderActions(); renderImages(); renderRollout(); renderEnrollments(); renderAuto();
    renderAnomaly();
  });
  es.addEventListener("leader", (ev) => showRole(JSON.parse(ev.data)));
  es.addEventListener("enrollment", (ev) => { state.enrollments = JSON.parse(ev.data).enrollments; renderEnrollments(); });
  es.addEventListener("node", (ev) => {
    const n = JSON.parse(ev.data);
    if (n.removed) state.nodes.delete(n.node_id); else { state.nodes.set(n.node_id, n); absorbAnomaly(n); }
    scheduleNodes();
  });
  es.addEventListener("round", (ev) => upsertRound(JSON.parse(ev.data)));
  es.addEventListener("rollback", (ev) => onRollback(JSON.parse(ev.data)));
  es.addEventListener("rollout", (ev) => onRollout(JSON.parse(ev.data)));
  es.addEventListener("images", (ev) => { state.images = JSON.parse(ev.data).images; renderImages(); });
  es.addEventListener("async", (ev) => { state.async = JSON.parse(ev.data); renderAsync(); });
  es.addEventListener("auto_rounds", (ev) => { state.auto = JSON.parse(ev.data); renderAuto(); refreshActions(); });
}

// ---- actions ----------------------------------------------------------------------------
$("round-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  showError("");
  const nodes = [...$("participants").querySelectorAll("input:checked")].map((i) => i.value);
  const lr = $("lr").value.trim();
  const body = {steps: parseInt($("steps").value, 10), lr: lr ? parseFloat(lr) : null,
    sync: $("sync").value, nodes};
  $("start").disabled = true;
  try {
    const r = await api("POST", "/api/rounds", body);
    state.selected = r.round_id;
    upsertRound(await api("GET", `/api/rounds/${encodeURIComponent(r.round_id)}`));
    refreshActions();
  } catch (e) {
    // The banner goes away by itself once what blocked the round is gone.
    const m = e.message;
    const resolved = /fewer than 2 nodes/.test(m) ? () => selectedOnline().length >= 2
      : /is still running/.test(m) ? () => ![...state.rounds.values()].some((r) => r.state === "running")
      : /rollback .* pending/.test(m) ? () => state.rollback === null
      : /unknown node/.test(m) ? () => nodes.every((id) => state.nodes.has(id)) : null;
    showError(`Round not started: ${m}`, resolved);
  } finally {
    $("start").disabled = false;
  }
});

$("rollback-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const v = $("to-version").value.trim();
  rollback({nodes: null, to_version: v === "" ? null : parseInt(v, 10)});
});

$("rounds").addEventListener("click", (ev) => {
  const undo = ev.target.closest("button[data-undo]");
  if (undo) {
    const r = state.rounds.get(undo.dataset.undo);
    if (r) rollback({nodes: r.participants, to_version: r.version_before});
    return;
  }
  const tr = ev.target.closest("tr[data-round-id]");
  if (tr) { state.selected = tr.dataset.roundId; renderRounds(); }
});

$("logout").addEventListener("click", async () => { await fetch("/api/logout", {method: "POST"}); location.replace("/login"); });

setInterval(() => document.querySelectorAll("td.seen").forEach((td) => { td.textContent = ago(+td.dataset.ts); }), 1000);
window.addEventListener("resize", renderPlot);
renderPlot();
connect();
