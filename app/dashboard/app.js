// The meshwatch dashboard: polls the REST API with the operator's token and
// renders the open incidents and the node table. Rows are updated in place,
// keyed by id, so that focus, expanded evidence and scroll survive a refresh.
"use strict";

const TOKEN_KEY = "meshwatch.token";
const REFRESH_MS = 2000;
const STALE_S = 5;
const TOP_SUSPECTS = 3;
const SEVERITIES = new Set(["critical", "error", "warning", "info"]);

const $ = (id) => document.getElementById(id);

let canIsolate = false; // the token's role may isolate and release
let polling = false;
let inFlight = false;
let timer = null;
let errorSource = ""; // "load" errors clear on the next good refresh; "action" ones stay

class ApiError extends Error {
  constructor(status, detail) {
    super(`${status}: ${detail}`);
    this.status = status;
    this.detail = detail;
  }
}

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key in node) node[key] = value;
    else node.setAttribute(key, value);
  }
  node.append(...children);
  return node;
}

async function api(path, { method = "GET", body } = {}) {
  const headers = { Authorization: `Bearer ${localStorage.getItem(TOKEN_KEY)}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!resp.ok) {
    let detail = resp.statusText;
    try {
      const payload = await resp.json();
      detail = typeof payload.detail === "string" ? payload.detail : JSON.stringify(payload.detail);
    } catch {
      // a body that is not JSON: the status text says enough
    }
    throw new ApiError(resp.status, detail);
  }
  return resp.json();
}

function isAuthError(err) {
  return err instanceof ApiError && (err.status === 401 || err.status === 403);
}

function showError(message, source = "load") {
  $("error").textContent = message;
  errorSource = message ? source : "";
}

function describe(err, what) {
  if (err instanceof ApiError && err.status === 401) {
    return `The server refused the token (${err.message}). Enter another token.`;
  }
  if (err instanceof ApiError && err.status === 403) {
    return `This token may not ${what} (${err.message}).`;
  }
  if (err instanceof ApiError) return `Could not ${what} (${err.message}).`;
  return `Cannot reach the server to ${what}: ${err.message}`;
}

function showTokenForm() {
  $("token-form").hidden = false;
  $("change-token").hidden = true;
  $("token-input").focus();
}

function stopPolling() {
  polling = false;
  clearTimeout(timer);
}

async function start() {
  stopPolling();
  $("token-form").hidden = true;
  $("change-token").hidden = false;
  try {
    const me = await api("/api/v1/whoami");
    canIsolate = me.grants.includes("isolate");
    $("whoami").textContent = `Token: ${me.name} (${me.role})`;
  } catch (err) {
    showError(describe(err, "read the cluster state"));
    if (isAuthError(err)) showTokenForm();
    return;
  }
  $("actions-heading").hidden = !canIsolate;
  $("content").hidden = false;
  polling = true;
  await refresh();
}

async function refresh() {
  if (inFlight) return;
  inFlight = true;
  clearTimeout(timer);
  try {
    const [nodes, incidents] = await Promise.all([
      api("/api/v1/nodes"),
      api("/api/v1/incidents?state=open&limit=1000"),
    ]);
    renderCounts(nodes, incidents);
    renderIncidents(incidents);
    renderNodes(nodes);
    const now = new Date();
    $("updated").textContent = now.toLocaleTimeString();
    $("updated").dateTime = now.toISOString();
    if (errorSource === "load") showError("");
  } catch (err) {
    showError(describe(err, "read the cluster state"));
    if (isAuthError(err)) {
      stopPolling();
      showTokenForm();
    }
  } finally {
    inFlight = false;
    if (polling) timer = setTimeout(refresh, REFRESH_MS);
  }
}

function renderCounts(nodes, incidents) {
  $("count-nodes").textContent = nodes.length;
  $("count-schedulable").textContent = nodes.filter((n) => n.schedulable).length;
  $("count-isolated").textContent = nodes.filter((n) => n.state === "isolated").length;
  $("count-incidents").textContent = incidents.length >= 1000 ? "1000+" : incidents.length;
}

// Reorders and prunes a keyed list of children without moving the ones
// already in place (moving an element takes the keyboard focus from it).
function placeInOrder(parent, wanted) {
  const keep = new Set(wanted);
  for (const child of [...parent.children]) if (!keep.has(child)) child.remove();
  wanted.forEach((child, i) => {
    if (parent.children[i] !== child) parent.insertBefore(child, parent.children[i] || null);
  });
}

function renderIncidents(incidents) {
  const list = $("incidents");
  const byId = new Map([...list.children].map((li) => [li.dataset.id, li]));
  const items = incidents.map((inc) => {
    const id = String(inc.id);
    let li = byId.get(id);
    if (!li) li = el("li", { dataset: { id } });
    if (li.dataset.updated !== inc.updated_at) {
      li.dataset.updated = inc.updated_at;
      const wasOpen = li.querySelector("details")?.open ?? false;
      li.replaceChildren(...incidentParts(inc, wasOpen));
    }
    return li;
  });
  placeInOrder(list, items);
  $("no-incidents").hidden = incidents.length > 0;
}

function incidentParts(inc, evidenceOpen) {
  const severity = SEVERITIES.has(inc.severity) ? inc.severity : "error";
  const heading = el(
    "h3",
    {},
    el("span", { className: `severity sev-${severity}` }, inc.severity),
    " ",
    el("span", { className: "kind" }, inc.kind),
  );
  const suspects = el("ol", { className: "suspects" });
  for (const s of inc.suspects.slice(0, TOP_SUSPECTS)) {
    const score = typeof s.score === "number" ? s.score.toFixed(2) : "?";
    suspects.append(
      el(
        "li",
        {},
        el("span", { className: "suspect-type" }, s.type),
        " ",
        el("span", { className: "suspect-id" }, s.id),
        " ",
        el("span", { className: "score", title: "score" }, score),
      ),
    );
  }
  const opened = new Date(inc.opened_at);
  const details = el(
    "details",
    { open: evidenceOpen },
    el("summary", {}, "Evidence"),
    el("pre", { className: "evidence" }, JSON.stringify(inc.evidence, null, 2)),
  );
  return [
    heading,
    el("p", { className: "summary" }, inc.summary || "(no summary)"),
    el(
      "p",
      { className: "meta" },
      "Opened ",
      el("time", { dateTime: inc.opened_at }, opened.toLocaleString()),
      ` · incident #${inc.id} · ${inc.detector}`,
    ),
    inc.suspects.length ? el("p", { className: "label" }, "Top suspects") : "",
    suspects,
    details,
  ];
}

function renderNodes(nodes) {
  const tbody = $("nodes").tBodies[0];
  const byId = new Map([...tbody.rows].map((tr) => [tr.dataset.node, tr]));
  const rows = nodes.map((n) => {
    let tr = byId.get(n.id);
    if (!tr) {
      tr = el("tr", { dataset: { node: n.id } });
      tr.append(el("th", { scope: "row" }, n.id));
      for (let i = 0; i < 5; i++) tr.append(el("td"));
      tr.cells[4].className = "num";
    }
    updateNodeRow(tr, n);
    return tr;
  });
  placeInOrder(tbody, rows);
}

function updateNodeRow(tr, n) {
  const [, rack, state, schedulable, age, actions] = tr.cells;
  const isolated = n.state === "isolated";
  tr.classList.toggle("isolated", isolated);
  setText(rack, n.rack || "—");
  if (state.dataset.state !== n.state) {
    state.dataset.state = n.state;
    state.replaceChildren(isolated ? el("strong", { className: "tag isolated-tag" }, "isolated") : n.state);
  }
  setText(schedulable, n.schedulable ? "yes" : "no");
  const stale = n.telemetry_age_s === null || n.telemetry_age_s > STALE_S;
  age.classList.toggle("stale", stale);
  age.title = stale ? `no telemetry for more than ${STALE_S} s` : "";
  setText(age, n.telemetry_age_s === null ? "never" : n.telemetry_age_s.toFixed(1));
  actions.hidden = !canIsolate;
  const action = isolated ? "release" : "isolate";
  if (canIsolate && actions.dataset.action !== action) {
    actions.dataset.action = action;
    const label = isolated ? "Release" : "Isolate";
    actions.replaceChildren(
      el("button", { type: "button", dataset: { action, node: n.id }, ariaLabel: `${label} ${n.id}` }, label),
    );
  }
}

function setText(cell, text) {
  if (cell.textContent !== text) cell.textContent = text;
}

// One listener for every row's button: rows are updated while a click is on its way.
async function onNodeAction(event) {
  const button = event.target.closest("button[data-action]");
  if (!button) return;
  const { action, node } = button.dataset;
  const reason = window.prompt(
    action === "isolate" ? `Reason for isolating ${node}:` : `Reason for releasing ${node}:`,
    action === "release" ? "released from the dashboard" : "",
  );
  if (reason === null || !reason.trim()) return;
  button.disabled = true;
  try {
    await api(`/api/v1/nodes/${encodeURIComponent(node)}/${action}`, {
      method: "POST",
      body: { reason: reason.trim() },
    });
    if (errorSource === "action") showError("");
  } catch (err) {
    if (err instanceof ApiError && err.status === 404 && err.detail === "Not Found") {
      canIsolate = false; // a server without the isolation routes
      $("actions-heading").hidden = true;
    }
    showError(describe(err, `${action} ${node}`), "action");
  } finally {
    button.disabled = false;
    await refresh();
  }
}

function init() {
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const token = $("token-input").value.trim();
    if (!token) return;
    localStorage.setItem(TOKEN_KEY, token);
    $("token-input").value = "";
    showError("");
    start();
  });
  $("change-token").addEventListener("click", () => {
    stopPolling();
    showTokenForm();
  });
  $("nodes").tBodies[0].addEventListener("click", onNodeAction);
  if (localStorage.getItem(TOKEN_KEY)) start();
  else showTokenForm();
}

init();
