// The fleet dashboard: state comes from GET /api/events (SSE; the login cookie authenticates it),
// actions go to the JSON API. No framework, no build step, no network beyond this origin.
"use strict";
const $ = (id) => document.getElementById(id);
const COLORS = ["#e07b39", "#3aa17e", "#8e5bd0", "#d04f7a", "#3f8fd2", "#9a8a2e", "#5e6d7e", "#c2462d"];
const state = {swarm: "", nodes: new Map(), rounds: new Map(), selected: null, es: null};

function showError(msg) { const e = $("error"); e.textContent = msg; e.hidden = !msg; }
function esc(s) { return String(s ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`); }
function ago(ts) {
  const s = Math.max(0, Date.now() / 1000 - ts);
  return s < 60 ? `${s.toFixed(0)}s ago` : s < 3600 ? `${(s / 60).toFixed(0)}m ago` : `${(s / 3600).toFixed(1)}h ago`;
}
function nodeColor(id) { return COLORS[[...state.nodes.keys()].sort().indexOf(id) % COLORS.length] || "#888"; }

async function api(method, path, body) {
  const r = await fetch(path, {method, credentials: "same-origin",
    headers: body ? {"Content-Type": "application/json"} : {}, body: body ? JSON.stringify(body) : undefined});
  if (r.status === 401) { location.replace("/login"); throw new Error("not signed in"); }
  const data = await r.json().catch(() => ({}));
  if (!r.ok) {
    throw new Error(`${r.status}: ${data.error || r.statusText}`);
  }
  return data;
}

// ---- nodes ------------------------------------------------------------------------------
function renderNodes() {
  const ids = [...state.nodes.keys()].sort();
  const online = ids.filter((id) => state.nodes.get(id).online).length;
  $("node-count").textContent = `${online} online / ${ids.length}`;
  $("no-nodes").hidden = ids.length > 0;
  $("nodes").querySelector("tbody").innerHTML = ids.map((id) => {
    const n = state.nodes.get(id);
    const board = [n.board, n.arch].filter(Boolean).join(" / ");
    return `<tr data-node-id="${esc(id)}" data-state="${esc(n.state)}">
      <td><b>${esc(id)}</b></td><td>${esc(board)}</td>
      <td><span class="badge ${esc(n.state)}" title="${esc(n.offline_reason || "")}">${esc(n.state)}</span></td>
      <td>${esc(n.model)} <span class="muted">v${esc(n.model_version)}</span></td>
      <td class="hash" title="${esc(n.params_sha256)}">${esc(n.params_short)}</td>
      <td class="num">${esc(n.samples)}</td><td class="seen" data-ts="${n.last_seen}">${ago(n.last_seen)}</td></tr>`;
  }).join("");
  renderParticipants();
}

function renderParticipants() {
  const box = $("participants");
  const was = new Map([...box.querySelectorAll("input")].map((i) => [i.value, i.checked]));
  box.innerHTML = [...state.nodes.keys()].sort().map((id) => {
    const n = state.nodes.get(id);
    const checked = n.online && (was.has(id) ? was.get(id) : true);
    return `<label><input type="checkbox" value="${esc(id)}" ${checked ? "checked" : ""} ${n.online ? "" : "disabled"}>
      ${esc(id)}</label>`;
  }).join("") || `<span class="muted">no nodes</span>`;
}

// ---- rounds -----------------------------------------------------------------------------
function lastLoss(r) {
  const c = r.loss.filter((s) => s.complete);
  const l = c.length ? c : r.loss;
  return l.length ? l[l.length - 1].mean : null;
}

function renderRounds() {
  const rounds = [...state.rounds.values()].sort((a, b) => b.started_at - a.started_at);
  $("no-rounds").hidden = rounds.length > 0;
  $("rounds").querySelector("tbody").innerHTML = rounds.map((r) => {
    const ll = lastLoss(r);
    const agree = r.params_agree === null ? "" : r.params_agree ? `agree <span class="hash">${esc((r.params_sha256 || "").slice(0, 12))}</span>` : "DIFFER";
    return `<tr data-round-id="${esc(r.round_id)}" data-state="${esc(r.state)}" class="${r.round_id === state.selected ? "selected" : ""}">
      <td class="hash">${esc(r.round_id)}</td><td>${new Date(r.started_at * 1000).toLocaleTimeString()}</td>
      <td>${esc(r.participants.join(", "))}</td><td class="num">${r.loss.length ? r.loss[r.loss.length - 1].step + 1 : 0}/${r.steps}</td>
      <td><span class="badge ${esc(r.state)}">${esc(r.state)}</span>${r.finished_at ? ` <span class="muted">${(r.finished_at - r.started_at).toFixed(1)} s</span>` : ""}</td>
      <td class="num">${ll === null ? "" : ll.toFixed(4)}</td><td>${agree}</td>
      <td class="reason">${esc(r.reason || "")}</td></tr>`;
  }).join("");
  renderPlot();
}

function renderPlot() {
  const r = state.rounds.get(state.selected);
  const canvas = $("loss-plot");
  canvas.dataset.round = r ? r.round_id : "";
  canvas.dataset.state = r ? r.state : "";
  if (!r) { LossPlot.draw(canvas, [], {empty: "start a round to see its loss"}); $("legend").innerHTML = ""; $("plot-title").textContent = ""; return; }
  const last = r.loss.length ? r.loss[r.loss.length - 1].step + 1 : 0;
  $("plot-title").textContent = `round ${r.round_id} · ${r.state}` +
    (r.state === "running" ? ` · step ${last}/${r.steps}` : "") + ` · ${r.sync}`;
  // Nodes throttle their STEP events independently: the mean is drawn over steps every node reported.
  const complete = r.loss.filter((s) => s.complete);
  const meanPts = (complete.length ? complete : r.loss).map((s) => [s.step, s.mean]);
  const series = [{label: "mean", color: "#17202b", width: 2.5, points: meanPts, dots: meanPts.length < 30}];
  for (const id of r.participants) {
    series.push({label: id, color: nodeColor(id), width: 1.2,
      points: r.loss.filter((s) => id in s.nodes).map((s) => [s.step, s.nodes[id]])});
  }
  LossPlot.draw(canvas, series, {empty: r.state === "running" ? "waiting for the first step…" : "no steps reported"});
  $("legend").innerHTML = series.map((s) => `<span><i style="background:${s.color}"></i>${esc(s.label)}</span>`).join("");
}

function upsertRound(r) {
  const isNew = !state.rounds.has(r.round_id);
  state.rounds.set(r.round_id, r);
  if (isNew && (state.selected === null || r.state === "running")) state.selected = r.round_id;
  renderRounds();
}

// ---- event stream -----------------------------------------------------------------------
function connect() {
  const es = new EventSource("/api/events");  // the HttpOnly cookie authenticates it
  state.es = es;
  es.addEventListener("open", () => { $("live").textContent = "live"; $("live").className = "pill on"; });
  es.addEventListener("error", () => {
    $("live").textContent = "reconnecting…"; $("live").className = "pill off";
    // A 401 closes the stream for good: find out and go to the login page.
    if (es.readyState === EventSource.CLOSED) api("GET", "/api/nodes").then(() => setTimeout(connect, 2000), () => {});
  });
  es.addEventListener("snapshot", (ev) => {
    const s = JSON.parse(ev.data);
    state.swarm = s.swarm; $("swarm").textContent = `swarm ${s.swarm}`;
    state.nodes = new Map(s.nodes.map((n) => [n.node_id, n]));
    state.rounds = new Map(s.rounds.map((r) => [r.round_id, r]));
    if (!state.rounds.has(state.selected)) state.selected = s.rounds.length ? s.rounds[0].round_id : null;
    renderNodes(); renderRounds();
  });
  es.addEventListener("node", (ev) => {
    const n = JSON.parse(ev.data);
    if (n.removed) state.nodes.delete(n.node_id); else state.nodes.set(n.node_id, n);
    renderNodes();
  });
  es.addEventListener("round", (ev) => upsertRound(JSON.parse(ev.data)));
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
  } catch (e) {
    showError(`Round not started: ${e.message}`);
  } finally {
    $("start").disabled = false;
  }
});

$("rounds").addEventListener("click", (ev) => {
  const tr = ev.target.closest("tr[data-round-id]");
  if (tr) { state.selected = tr.dataset.roundId; renderRounds(); }
});

$("logout").addEventListener("click", async () => { await fetch("/api/logout", {method: "POST"}); location.replace("/login"); });

setInterval(() => document.querySelectorAll("td.seen").forEach((td) => { td.textContent = ago(+td.dataset.ts); }), 1000);
window.addEventListener("resize", renderPlot);
renderPlot();
connect();
