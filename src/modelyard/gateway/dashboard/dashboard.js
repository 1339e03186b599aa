// The modelyard dashboard: plain JavaScript, no framework, no build step.
// Everything shown that comes from the gateway is inserted as text (textContent, append(string)),
// never parsed as HTML. The admin token stays in this tab's sessionStorage and goes only to this
// gateway, as `Authorization: Bearer`, on the calls that need it.
"use strict";

const TOKEN_KEY = "modelyard.adminToken";
const REFRESH_MS = 2000;
const LOG_ROWS = 200;
const RECONNECT_MS = 2000;
const NEEDS_TOKEN = "This gateway needs the admin token: enter it above.";
const TOKEN_REFUSED = "The admin token was refused: enter the right one above.";

const $ = (id) => document.getElementById(id);

class AuthNeeded extends Error {
  constructor() {
    super(NEEDS_TOKEN);
  }
}

// --- small helpers ---------------------------------------------------------------------------

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function say(id, text, kind) {
  const node = $(id);
  node.textContent = text;
  node.classList.toggle("ok", kind === "ok");
  node.classList.toggle("bad", kind === "bad");
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const clock = (seconds) => {
  const d = new Date(seconds * 1000);
  return d.toLocaleTimeString([], { hour12: false }) + "." + String(d.getMilliseconds()).padStart(3, "0");
};
const fixed = (value, digits = 1) => (value === null || value === undefined ? "–" : Number(value).toFixed(digits));
const percent = (value) => (value === null || value === undefined ? "–" : (value * 100).toFixed(1) + "%");

async function errorText(response) {
  try {
    const body = await response.json();
    const error = body.error;
    if (typeof error === "string") return error;
    if (error && error.message) return error.message;
  } catch (_) {
    // not JSON: the status says enough
  }
  return `${response.status} ${response.statusText}`;
}

// Server-sent events from a fetch body (fetch, not EventSource, so that the token can be sent).
async function readEvents(body, onEvent) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    const blocks = (buffer + value).split(/\r?\n\r?\n/);
    buffer = blocks.pop(); // the start of an event still coming
    for (const block of blocks) {
      let type = "message";
      let id = null;
      const data = [];
      for (const line of block.split(/\r?\n/)) {
        if (!line || line.startsWith(":")) continue; // a comment: the heartbeat
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let text = colon < 0 ? "" : line.slice(colon + 1);
        if (text.startsWith(" ")) text = text.slice(1);
        if (field === "data") data.push(text);
        else if (field === "event") type = text;
        else if (field === "id") id = text;
      }
      if (data.length) onEvent(type, data.join("\n"), id);
    }
  }
}

// --- the admin token -------------------------------------------------------------------------

const token = () => sessionStorage.getItem(TOKEN_KEY) || "";

function withToken(headers) {
  const all = { ...(headers || {}) };
  if (token()) all.Authorization = "Bearer " + token();
  return all;
}

function showAuth(needed) {
  const banner = $("auth-message");
  banner.textContent = token() ? TOKEN_REFUSED : NEEDS_TOKEN;
  banner.hidden = !needed;
}

// A call that may need the admin token: a 401 shows the banner and throws AuthNeeded.
async function adminFetch(path, options = {}) {
  const response = await fetch(path, { ...options, headers: withToken(options.headers) });
  if (response.status === 401) {
    showAuth(true);
    throw new AuthNeeded();
  }
  if (response.ok && path.startsWith("/admin/")) showAuth(false);
  return response;
}

function showTokenState() {
  $("token-state").textContent = token() ? "a token is set for this tab" : "";
}

function useToken(event) {
  event.preventDefault();
  const value = $("token").value.trim();
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  $("token").value = "";
  showTokenState();
  restart();
}

function forgetToken() {
  sessionStorage.removeItem(TOKEN_KEY);
  showTokenState();
  restart();
}

// --- models and endpoints ----------------------------------------------------------------------

let overviewTimer = null;
let knownModels = [];

async function refreshOverview() {
  clearTimeout(overviewTimer);
  try {
    const sent = Date.now();
    const response = await adminFetch("/admin/overview");
    const received = Date.now();
    if (!response.ok) throw new Error(await errorText(response));
    const data = await response.json();
    traffic.setClock(data.now, sent, received); // the charts' "now" is the gateway's
    renderModels(data.models);
    renderStrategies(data);
    renderPlacement(data.placement);
    apiKeys = Boolean(data.api_keys);
    setModelNames([...data.models.map((model) => model.name), ...(data.placement ? data.placement.models.map((m) => m.name) : [])]);
    say("models-status", "updated " + new Date().toLocaleTimeString([], { hour12: false }));
  } catch (error) {
    if (error instanceof AuthNeeded) {
      $("models").replaceChildren(el("p", { class: "muted" }, "Enter the admin token to see the endpoints."));
      say("models-status", "needs the admin token", "bad");
      $("strategy-current").textContent = "Switching needs the admin token.";
    } else {
      say("models-status", "could not load: " + error.message, "bad");
    }
  }
  await Promise.all([refreshCanary(), loadGraphs(), refreshTenants()]);
  clearTimeout(overviewTimer); // a switch may have refreshed meanwhile: one timer at a time
  overviewTimer = setTimeout(refreshOverview, REFRESH_MS);
}

function renderModels(models) {
  if (!models.length) {
    $("models").replaceChildren(el("p", { class: "muted" }, "This gateway serves no model."));
    return;
  }
  $("models").replaceChildren(...models.map(renderModel));
}

function renderModel(model) {
  const ready = model.ready ? el("span", { class: "badge ok" }, "ready") : el("span", { class: "badge bad" }, "not ready");
  const panic = model.panic_subsets.length
    ? el("span", { class: "badge warn" }, "panic: " + model.panic_subsets.join(", "))
    : null;
  const queue = model.max_pending_requests ? `${model.queued}/${model.max_pending_requests}` : String(model.queued);
  const facts = [
    `${model.active_requests} active`,
    `${queue} queued`,
    `${model.retries_in_flight} retrying`,
    model.routes.length ? "routes: " + model.routes.join(", ") : "no routes (every endpoint)",
  ].join(" · ");
  // A server may serve several models: "in flight" is this model's requests on the endpoint, the
  // server's total (what least_pending and the circuit breaker weigh) is beside it, named as such.
  const columns = [
    ["endpoint"], ["subset"], ["url"], ["health"],
    ["in flight", "this model's requests on this endpoint", "num"],
    ["server total", "requests this gateway has on the server, for every model it serves there", "num"],
    ["ejection"], ["circuit"],
  ];
  const head = el("tr", {}, ...columns.map(([name, title, kind]) => el("th", { class: kind || "", title: title || "" }, name)));
  const rows = model.endpoints.map((endpoint) => renderEndpoint(endpoint));
  return el(
    "article",
    { class: "model", "data-model": model.name },
    el("h3", {}, model.name, el("span", { class: "badge", "data-strategy": model.strategy }, model.strategy), ready, panic),
    el("p", { class: "muted" }, facts),
    el("div", { class: "scroll" }, el("table", { class: "endpoints" }, el("thead", {}, head), el("tbody", {}, ...rows))),
  );
}

function renderEndpoint(endpoint) {
  const health = endpoint.health;
  const healthText = health.status === "healthy" ? "healthy" : "unhealthy" + (health.last_error ? ": " + health.last_error : "");
  const ejection = endpoint.ejection;
  let ejectionText = "in";
  if (ejection.ejected) ejectionText = `ejected, back in ${fixed(ejection.seconds_left)} s`;
  if (ejection.ejections) ejectionText += ` (ejected ${ejection.ejections}×)`;
  const circuit = endpoint.circuit;
  const circuitText = circuit.state + (circuit.max_requests ? ` · max ${circuit.max_requests}` : " · no limit");
  return el(
    "tr",
    { "data-endpoint": endpoint.name },
    el("td", {}, endpoint.name),
    el("td", {}, endpoint.subset),
    el("td", { class: "muted" }, endpoint.url),
    el("td", { class: health.status === "healthy" ? "ok" : "bad", title: health.checked ? "" : "not probed yet" }, healthText),
    el("td", { class: "num", "data-field": "in-flight" }, endpoint.model_in_flight),
    el("td", { class: "num muted", "data-field": "server-in-flight" }, endpoint.in_flight),
    el("td", { class: ejection.ejected ? "bad" : "" }, ejectionText),
    el("td", { class: circuit.state === "open" ? "bad" : "" }, circuitText),
  );
}

// --- models the scheduler places -------------------------------------------------------------------

// Every model the scheduler places, as its feed last said: one that cannot be placed has no
// endpoint, so the panel above never shows it; here it is, with why.
const STATE_CLASS = { ModelAvailable: "ok", ModelFailed: "bad", ScheduleFailed: "bad", ModelTerminateFailed: "bad" };

function renderPlacement(placement) {
  $("placement-section").hidden = !placement;
  if (!placement) return;
  let status = `following ${placement.scheduler}`;
  if (!placement.connected) {
    const why = placement.last_error ? ` (${placement.last_error})` : "";
    status = placement.synced
      ? `the feed from ${placement.scheduler} is lost${why}: what it last said, the endpoints kept`
      : `waiting for ${placement.scheduler}${why}`;
  }
  say("placement-status", status, placement.connected ? "" : "bad");
  const replicas = (model) =>
    model.ready_replicas === null || model.desired_replicas === null ? "?" : `${model.ready_replicas}/${model.desired_replicas}`;
  const rows = placement.models.map((model) =>
    el(
      "tr",
      { "data-model": model.name },
      el("td", {}, model.name),
      el("td", { class: "num" }, model.version),
      el("td", { "data-field": "state", class: STATE_CLASS[model.state] || "warn" }, model.state),
      el("td", { "data-field": "replicas", class: "num", title: "ready/desired replicas" }, replicas(model)),
      el("td", { "data-field": "requests", class: model.routable ? "ok" : "bad" }, model.routable ? "routed" : "503, not available"),
      el("td", { "data-field": "reason", class: "reason" }, model.reason || "–"),
    ),
  );
  $("placement").tBodies[0].replaceChildren(...rows);
  $("placement-empty").hidden = rows.length > 0;
}

// --- strategy ----------------------------------------------------------------------------------

function fillSelect(select, values, keep) {
  const chosen = select.value;
  const first = keep ? [...select.options].slice(0, keep) : [];
  select.replaceChildren(...first, ...values.map((value) => el("option", { value }, value)));
  if ([...select.options].some((option) => option.value === chosen)) select.value = chosen;
}

function renderStrategies(data) {
  const names = data.models.map((model) => model.name);
  if ($("strategy-name").options.length !== data.strategies.length) fillSelect($("strategy-name"), data.strategies, 0);
  if (names.join() !== knownModels.join()) {
    knownModels = names;
    fillSelect($("strategy-model"), names, 1);
    fillSelect($("canary-model"), names, 0);
  }
  $("strategy-current").textContent =
    "Now: " + data.models.map((model) => `${model.name} ${model.strategy}`).join(", ");
  currentStrategies = new Map(data.models.map((model) => [model.name, model.strategy]));
  if (!strategyPicked) showCurrentStrategy();
}

// The strategy picker shows the chosen model's strategy (the first model's for "every model")
// until the user picks one; choosing another model shows that model's again.
let currentStrategies = new Map();
let strategyPicked = false;

function showCurrentStrategy() {
  const model = $("strategy-model").value || knownModels[0];
  const current = currentStrategies.get(model);
  if (current !== undefined) $("strategy-name").value = current;
}

async function switchStrategy(event) {
  event.preventDefault();
  const strategy = $("strategy-name").value;
  const model = $("strategy-model").value;
  const body = model ? { strategy, model } : { strategy };
  $("strategy-switch").disabled = true;
  say("strategy-result", "switching…");
  try {
    const response = await adminFetch("/admin/strategy", {
      method: "PUT",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    if (!response.ok) {
      say("strategy-result", "Not switched: " + (await errorText(response)), "bad");
      return;
    }
    say("strategy-result", `Switched ${model || "every model"} to ${strategy}.`, "ok");
    await refreshOverview();
  } catch (error) {
    say("strategy-result", "Not switched. " + error.message, "bad");
  } finally {
    $("strategy-switch").disabled = false;
  }
}

// --- the live routing log ------------------------------------------------------------------------

let logController = null;
let lastSeq = 0; // the stream replays what the gateway kept after it (0: everything kept)
let dropped = 0;
let pendingRecords = [];
let drawScheduled = false;
// The records received, newest last, kept so that a new filter applies to them: bounded, as the
// gateway's own ring is (a busy gateway sends thousands a second).
const LOG_KEEP = 1000;
let logRecords = [];
let logFilter = { model: "", statusClass: "", text: "" };

async function followLog() {
  if (logController) logController.abort();
  const controller = (logController = new AbortController());
  while (!controller.signal.aborted) {
    let wait = RECONNECT_MS;
    try {
      const response = await adminFetch("/admin/log/stream", {
        headers: { "Last-Event-ID": String(lastSeq) },
        signal: controller.signal,
      });
      if (!response.ok) {
        // 503: as many streams are open as the gateway allows; it says when to try again.
        const retryAfter = Number(response.headers.get("Retry-After"));
        if (retryAfter > 0) wait = Math.max(wait, retryAfter * 1000);
        throw new Error(await errorText(response));
      }
      say("log-status", "live", "ok");
      await readEvents(response.body, onLogEvent);
      say("log-status", "the gateway ended the stream; reconnecting…", "bad");
    } catch (error) {
      if (controller.signal.aborted) return;
      if (error instanceof AuthNeeded) {
        say("log-status", "needs the admin token", "bad");
        return; // entering the token starts it again
      }
      say("log-status", "disconnected (" + error.message + "); reconnecting…", "bad");
    }
    await sleep(wait);
  }
}

function onLogEvent(type, data) {
  if (type === "dropped") {
    dropped += JSON.parse(data).dropped;
    say("log-status", `live; ${dropped} records skipped because this page fell behind`, "bad");
    say("traffic-status", `${dropped} records skipped: the charts count fewer requests than there were`, "bad");
    return;
  }
  if (type !== "message") return;
  const record = JSON.parse(data);
  lastSeq = record.seq;
  traffic.add(record); // every record, even those the table has no room for
  // Drawn once per frame: a busy gateway sends thousands a second.
  pendingRecords.push(record);
  if (pendingRecords.length > LOG_KEEP) pendingRecords.splice(0, pendingRecords.length - LOG_KEEP);
  if (!drawScheduled) {
    drawScheduled = true;
    requestAnimationFrame(drawLog);
  }
}

function drawLog() {
  drawScheduled = false;
  const fresh = pendingRecords;
  pendingRecords = [];
  logRecords.push(...fresh);
  if (logRecords.length > LOG_KEEP) logRecords.splice(0, logRecords.length - LOG_KEEP);
  const rows = fresh.filter(shown).slice(-LOG_ROWS).map(logRow).reverse(); // newest first
  const body = $("log").tBodies[0];
  body.prepend(...rows);
  while (body.rows.length > LOG_ROWS) body.deleteRow(-1);
  showLogCount();
}

// The table again, from the records kept, for a filter just changed: the newest LOG_ROWS that match.
function redrawLog() {
  const rows = [];
  for (let i = logRecords.length - 1; i >= 0 && rows.length < LOG_ROWS; i--) {
    if (shown(logRecords[i])) rows.push(logRow(logRecords[i], false));
  }
  $("log").tBodies[0].replaceChildren(...rows);
  showLogCount();
}

function showLogCount() {
  const drawn = $("log").tBodies[0].rows.length;
  const filtering = logFilter.model || logFilter.statusClass || logFilter.text;
  $("log-empty").textContent = logRecords.length ? "No record kept matches the filter." : "No request routed yet.";
  $("log-empty").hidden = drawn > 0;
  $("log-shown").textContent = filtering ? `${drawn} of the last ${logRecords.length} records match` : "";
}

function readFilter() {
  logFilter = {
    model: $("log-model").value,
    statusClass: $("log-class").value,
    text: $("log-text").value.trim().toLowerCase(),
  };
  redrawLog();
}

function shown(record) {
  const { model, statusClass, text } = logFilter;
  if (model && record.model !== model) return false;
  if (statusClass === "refused") {
    if (!record.refused) return false;
  } else if (statusClass && String(record.status)[0] !== statusClass) {
    return false;
  }
  if (!text) return true;
  const fields = [record.model, record.route, record.subset, record.backend, record.strategy, record.status, record.request_id];
  if (record.refused) fields.push("refused");
  if (record.fallback_for) fields.push(record.fallback_for);
  return fields.some((field) => String(field).toLowerCase().includes(text));
}

function logRow(record, fresh = true) {
  const cache = record.cache_hit === null ? "–" : record.cache_hit ? "hit" : "miss";
  // A request refused before routing (an unknown model, one not placed, a bad body) went nowhere.
  const backend = record.refused ? "refused (no backend)" : record.backend || "(none)";
  const dash = (text) => (record.refused ? "–" : text);
  return el(
    "tr",
    {
      class: (fresh ? "fresh" : "") + (record.refused ? " refused" : ""),
      "data-request-id": record.request_id,
      "data-seq": String(record.seq),
      "data-refused": String(Boolean(record.refused)),
    },
    el("td", {}, clock(record.time)),
    // a fallback model's answer: the model asked for too (its own record, the same request id, says how it failed)
    el("td", { "data-field": "model" }, record.fallback_for ? `${record.model} (for ${record.fallback_for})` : record.model || "–"),
    el("td", { "data-field": "route" }, dash(record.route)),
    el("td", { "data-field": "subset" }, dash(record.subset)),
    el("td", { "data-field": "backend", class: record.refused ? "bad" : "" }, backend),
    el("td", { "data-field": "strategy" }, dash(record.strategy)),
    el("td", { "data-field": "status", class: record.status < 400 ? "ok" : "bad" }, record.status),
    el("td", { "data-field": "latency", class: "num" }, fixed(record.latency_ms)),
    el("td", { "data-field": "cache" }, cache),
    el("td", { class: "id" }, record.request_id || "–"), // graph steps the gateway calls itself have none
  );
}

// The model names the overview knows (served and placed), for the log's filter and the charts;
// as a Set too, looked up per record (a gateway may place thousands of models).
let modelNames = [];
let modelNameSet = new Set();
let modelNamesKnown = false; // the log's first records may come before the first overview

function setModelNames(names) {
  const unique = [...new Set(names)];
  if (modelNamesKnown && unique.join() === modelNames.join()) return;
  modelNames = unique;
  modelNameSet = new Set(unique);
  modelNamesKnown = true;
  traffic.rowsStale = true;
  fillSelect($("log-model"), unique, 1);
  if ($("log-model").value !== logFilter.model) readFilter(); // the model filtered on is gone
  traffic.draw();
}

// --- chat ----------------------------------------------------------------------------------------

async function loadModels() {
  try {
    const response = await fetch("/v1/models");
    if (!response.ok) throw new Error(await errorText(response));
    const names = (await response.json()).data.map((model) => model.id);
    fillSelect($("chat-model"), names, 0);
  } catch (error) {
    say("chat-meta", "could not list the models: " + error.message, "bad");
  }
}

async function sendChat(event) {
  event.preventDefault();
  const model = $("chat-model").value;
  const prompt = $("chat-input").value.trim();
  if (!model || !prompt) return;
  const answer = $("chat-answer");
  answer.textContent = "";
  answer.dataset.state = "waiting";
  $("chat-send").disabled = true;
  say("chat-meta", "waiting for the first token…");
  const started = performance.now();
  let chunks = 0;
  let first = null;
  let failure = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model,
        stream: true,
        max_tokens: Number($("chat-max-tokens").value) || 64,
        messages: [{ role: "user", content: prompt }],
      }),
    });
    if (!response.ok) {
      failure = `${response.status}: ${await errorText(response)}`;
      return;
    }
    const backend = response.headers.get("X-Modelyard-Backend") || "?";
    const strategy = response.headers.get("X-Modelyard-Strategy") || "?";
    answer.dataset.state = "streaming";
    await readEvents(response.body, (_type, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        failure = chunk.error.message || String(chunk.error);
        return;
      }
      const choice = (chunk.choices || [])[0] || {};
      const text = (choice.delta && choice.delta.content) || choice.text || "";
      if (!text) return;
      if (first === null) first = performance.now() - started;
      chunks += 1;
      answer.append(text);
      say("chat-meta", `streaming from ${backend} (${strategy}): ${chunks} chunks`);
    });
    if (!failure) {
      const total = performance.now() - started;
      answer.dataset.chunks = String(chunks);
      say(
        "chat-meta",
        `${chunks} chunks streamed from ${backend} (${strategy}); first token ${fixed(first, 0)} ms, all ${fixed(total, 0)} ms`,
        "ok",
      );
    }
  } catch (error) {
    failure = error.message;
  } finally {
    answer.dataset.state = failure ? "error" : "done";
    if (failure) say("chat-meta", "Failed: " + failure, "bad");
    $("chat-send").disabled = false;
  }
}

// --- graphs --------------------------------------------------------------------------------------

let knownGraphs = null;

// Graphs come and go at runtime (PUT /admin/graphs): listed again with every refresh.
async function loadGraphs() {
  try {
    const response = await adminFetch("/v1/graphs"); // needs the token when admin.protect_graph_views
    if (!response.ok) throw new Error(await errorText(response));
    const names = (await response.json()).data.map((graph) => graph.name);
    if (knownGraphs !== null && names.join() === knownGraphs.join()) return; // keep the last run shown
    knownGraphs = names;
    fillSelect($("graph-name"), names, 0);
    $("graph-run").disabled = !names.length;
    say("graph-status", names.length ? "" : "This gateway serves no graph.");
  } catch (error) {
    knownGraphs = null;
    $("graph-run").disabled = true;
    say("graph-status", error instanceof AuthNeeded ? "Listing graphs needs the admin token." : "could not list the graphs: " + error.message, "bad");
  }
}

async function runGraph(event) {
  event.preventDefault();
  const name = $("graph-name").value;
  const text = $("graph-body").value;
  try {
    JSON.parse(text);
  } catch (error) {
    say("graph-status", "The body is not JSON: " + error.message, "bad");
    return;
  }
  $("graph-run").disabled = true;
  say("graph-status", "running…");
  const started = performance.now();
  try {
    const response = await fetch("/v1/graphs/" + encodeURIComponent(name), {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-Modelyard-Trace": "1" },
      body: text,
    });
    const answer = await response.text();
    const ms = performance.now() - started;
    say("graph-status", `${name}: ${response.status} in ${fixed(ms, 0)} ms`, response.ok ? "ok" : "bad");
    let shown = answer;
    try {
      shown = JSON.stringify(JSON.parse(answer), null, 2);
    } catch (_) {
      // not JSON: shown as it came
    }
    $("graph-answer").textContent = shown;
    $("graph-answer").hidden = false;
    renderTrace(response.headers.get("X-Modelyard-Graph-Trace"));
  } catch (error) {
    say("graph-status", "Failed: " + error.message, "bad");
  } finally {
    $("graph-run").disabled = false;
  }
}

function renderTrace(header) {
  const table = $("graph-trace");
  if (!header) {
    table.hidden = true;
    return;
  }
  const trace = JSON.parse(header);
  const rows = trace.steps.map((step) =>
    el(
      "tr",
      { "data-step": step.step },
      el("td", {}, step.node),
      el("td", {}, step.step),
      el("td", { class: "muted" }, step.target),
      el("td", { class: step.status < 400 ? "ok" : "bad" }, step.status),
      el("td", { class: "num" }, fixed(step.ms)),
    ),
  );
  rows.push(el("tr", {}, el("td", { colSpan: 4 }, "whole graph"), el("td", { class: "num" }, fixed(trace.ms))));
  table.tBodies[0].replaceChildren(...rows);
  table.hidden = false;
}

// --- canary comparison -----------------------------------------------------------------------------

async function refreshCanary() {
  const model = $("canary-model").value;
  if (!model) return;
  try {
    const response = await adminFetch(`/admin/models/${encodeURIComponent(model)}/canary`);
    if (!response.ok) throw new Error(await errorText(response));
    renderCanary(await response.json());
  } catch (error) {
    const text = error instanceof AuthNeeded ? "Needs the admin token." : "could not load: " + error.message;
    $("canary").replaceChildren(el("p", { class: "bad" }, text));
  }
}

function renderCanary(data) {
  const routes = [...new Set([...Object.keys(data.mirrors), ...Object.keys(data.routes)])];
  if (!routes.length) {
    $("canary").replaceChildren(
      el("p", { class: "muted" }, `No route of ${data.model} mirrors traffic: give a route a mirror to compare a canary with it.`),
    );
    return;
  }
  const parts = [];
  for (const route of routes) {
    const mirror = data.mirrors[route];
    const summary = data.routes[route];
    const target = mirror ? ` → mirrors ${mirror.percent}% to ${mirror.subset}` : "";
    parts.push(el("h4", { "data-route": route }, `route ${route}${target}`));
    if (!summary) {
      parts.push(el("p", { class: "muted" }, "Nothing mirrored yet."));
      continue;
    }
    parts.push(
      el(
        "p",
        {},
        `${summary.compared} answers compared · mean ROUGE-L ${fixed(summary.mean_rouge_l, 3)} · exact match ${percent(summary.exact_match_rate)}`,
      ),
    );
    const head = el("tr", {}, ...["subset", "requests", "errors", "error rate", "p50 ms", "p95 ms"].map((name, i) => el("th", { class: i ? "num" : "" }, name)));
    const rows = Object.entries(summary.subsets).map(([subset, stats]) =>
      el(
        "tr",
        { "data-subset": subset },
        el("td", {}, subset),
        el("td", { class: "num" }, stats.requests),
        el("td", { class: "num" }, stats.errors),
        el("td", { class: "num" }, percent(stats.error_rate)),
        el("td", { class: "num" }, fixed(stats.p50_ms)),
        el("td", { class: "num" }, fixed(stats.p95_ms)),
      ),
    );
    parts.push(el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)));
  }
  $("canary").replaceChildren(...parts);
}

// --- tenants (auth.enabled) ------------------------------------------------------------------------

// Per tenant, and per key within it: today's usage (GET /admin/usage) against the limits (GET
// /admin/keys: the tenants' own and each key's own), why requests were refused and how many were
// shed (/metrics, since the gateway started). The gateway counts per day; the last minute's figures
// are the growth of those counts while this page watches (samples of the last 60 s, and the one
// before them as the base).
const MINUTE_MS = 60000;
let apiKeys = false; // the overview says whether auth.enabled: the panel shows only then
let usageSamples = []; // oldest first: { at, day, counts: Map(id -> [requests, tokens]) }

async function refreshTenants() {
  if (!apiKeys) {
    $("tenants-section").hidden = true;
    usageSamples = [];
    return;
  }
  try {
    const response = await adminFetch("/admin/usage");
    if (response.status === 409) {
      // API keys are off after all (the overview was older than this answer)
      $("tenants-section").hidden = true;
      return;
    }
    if (!response.ok) throw new Error(await errorText(response));
    const usage = await response.json();
    const [keysResponse, metricsResponse] = await Promise.all([adminFetch("/admin/keys"), fetch("/metrics")]);
    if (!keysResponse.ok) throw new Error(await errorText(keysResponse));
    const listed = await keysResponse.json();
    const metrics = metricsResponse.ok ? tenantMetrics(await metricsResponse.text()) : null;
    const span = rememberUsage(usage);
    renderTenants(usage, listed, metrics);
    $("tenants-section").hidden = false;
    const watched = span >= MINUTE_MS - 1000 ? "the last 60 s" : `the ${Math.round(span / 1000)} s since this page opened`;
    say(
      "tenants-status",
      `${usage.day} (UTC), ${usage.scope}; last minute: ${watched}` + (metrics ? "" : "; /metrics did not answer"),
    );
  } catch (error) {
    if (error instanceof AuthNeeded) {
      $("tenants-section").hidden = true; // the banner says what to do
      return;
    }
    $("tenants-section").hidden = false;
    say("tenants-status", "could not load: " + error.message, "bad");
  }
}

const usageId = (tenant, key) => (key === undefined ? "tenant/" + tenant : `key/${tenant}/${key}`);

// Keep this answer's counts; the milliseconds between it and the base the last minute is counted from.
function rememberUsage(usage) {
  const counts = new Map();
  for (const tenant of usage.tenants) {
    counts.set(usageId(tenant.tenant), [tenant.requests, tenant.tokens]);
    for (const key of tenant.keys) counts.set(usageId(tenant.tenant, key.key), [key.requests, key.tokens]);
  }
  const now = Date.now();
  usageSamples.push({ at: now, day: usage.day, counts });
  while (usageSamples.length > 2 && usageSamples[1].at <= now - MINUTE_MS) usageSamples.shift();
  return now - usageSamples[0].at;
}

// [requests, tokens] counted since the base sample (a new UTC day starts the counts again).
function lastMinute(id) {
  const newest = usageSamples[usageSamples.length - 1];
  const base = usageSamples[0];
  const now = newest.counts.get(id) || [0, 0];
  const then = base.day === newest.day ? base.counts.get(id) || [0, 0] : [0, 0];
  return [Math.max(0, now[0] - then[0]), Math.max(0, now[1] - then[1])];
}

// The tenant series of /metrics (Prometheus' text format): requests shed (let in, then refused for
// room: 429 overloaded) and refusals by reason, per tenant.
function tenantMetrics(text) {
  const shed = new Map();
  const refused = new Map();
  for (const line of text.split("\n")) {
    const requests = line.startsWith("modelyard_tenant_shed_total{");
    if (!requests && !line.startsWith("modelyard_tenant_refused_total{")) continue;
    const close = line.lastIndexOf("}");
    const labels = {};
    for (const match of line.slice(line.indexOf("{") + 1, close).matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
      labels[match[1]] = match[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    const value = Number(line.slice(close + 1).trim().split(/\s+/)[0]);
    if (!Number.isFinite(value) || labels.tenant === undefined) continue;
    if (requests) {
      shed.set(labels.tenant, (shed.get(labels.tenant) || 0) + value);
    } else {
      const reasons = refused.get(labels.tenant) || {};
      reasons[labels.reason] = (reasons[labels.reason] || 0) + value;
      refused.set(labels.tenant, reasons);
    }
  }
  return { shed, refused };
}

const money = (usd) => {
  const value = Number(usd) || 0;
  return "$" + (value === 0 ? "0" : value.toFixed(value < 0.01 ? 6 : value < 1 ? 4 : 2));
};

function limitsText(limits) {
  const parts = [];
  if (!limits) return "–";
  if (limits.requests_per_minute) parts.push(`${limits.requests_per_minute} req/min`);
  if (limits.tokens_per_minute) parts.push(`${limits.tokens_per_minute} tok/min`);
  if (limits.max_concurrent_requests) parts.push(`${limits.max_concurrent_requests} concurrent`);
  if (limits.budget) parts.push(`${money(limits.budget)}/${limits.budget_period || "day"}`);
  return parts.join(", ") || "–";
}

// "12 / 600" with a bar filled to the share used (amber from 80%, red at the limit); "12" without one.
function meter(field, used, limit, text = String(used), limitText = String(limit)) {
  const cell = el("td", { "data-field": field });
  if (!limit) {
    cell.append(text);
    return cell;
  }
  const share = used / limit;
  const bar = el("span", { class: "fill" });
  bar.style.width = Math.min(100, share * 100).toFixed(1) + "%";
  const kind = share >= 1 ? "bad" : share >= 0.8 ? "warn" : "ok";
  cell.append(el("span", { class: "meter " + kind, title: percent(share) + " of the limit" }, bar), `${text} / ${limitText}`);
  cell.dataset.share = share.toFixed(4);
  return cell;
}

function refusedText(count, reasons) {
  const why = Object.entries(reasons || {})
    .filter(([, n]) => n > 0)
    .sort(([a], [b]) => a.localeCompare(b))
    .map(([reason, n]) => `${reason} ${n}`);
  return why.length ? `${count} (${why.join(", ")})` : String(count);
}

function renderTenants(usage, listed, metrics) {
  const used = new Map(usage.tenants.map((tenant) => [tenant.tenant, tenant]));
  const tenants = new Map((listed.tenants || []).map((tenant) => [tenant.name, tenant]));
  for (const name of used.keys()) if (!tenants.has(name)) tenants.set(name, { name, models: null, priority: null, limits: {} });
  const rows = [];
  for (const name of [...tenants.keys()].sort()) {
    const tenant = tenants.get(name);
    const today = used.get(name) || { requests: 0, tokens: 0, errors: 0, refused: 0, cost: 0, keys: [] };
    const limits = tenant.limits || {};
    const [minuteRequests, minuteTokens] = lastMinute(usageId(name));
    const models = tenant.models === null ? "every model" : "models: " + tenant.models.join(", ");
    rows.push(
      tenantRow(
        { "data-tenant": name, "data-row": "tenant", class: "tenant" },
        el("td", { "data-field": "name", title: models }, el("strong", {}, name)),
        tenant.priority ?? "–",
        limits,
        [minuteRequests, minuteTokens],
        today,
        refusedText(today.refused, metrics && metrics.refused.get(name)),
        metrics ? metrics.shed.get(name) || 0 : "–",
      ),
    );
    const keyUsage = new Map(today.keys.map((key) => [key.key, key]));
    const keys = (listed.keys || []).filter((key) => key.tenant === name);
    const names = [...new Set([...keys.map((key) => key.name), ...keyUsage.keys()])].sort();
    const byName = new Map(keys.map((key) => [key.name, key]));
    for (const keyName of names) {
      const key = byName.get(keyName);
      const keyToday = keyUsage.get(keyName) || { requests: 0, tokens: 0, errors: 0, refused: 0, cost: 0 };
      const source = key ? key.source : "no longer listed";
      rows.push(
        tenantRow(
          { "data-tenant": name, "data-key": keyName, "data-row": "key", class: "key" },
          el("td", { "data-field": "name" }, "↳ " + keyName + " ", el("span", { class: "muted" }, source)),
          key && key.priority !== null && key.priority !== undefined ? key.priority : el("span", { class: "muted" }, tenant.priority ?? "–"),
          key ? key.limits || {} : {},
          lastMinute(usageId(name, keyName)),
          keyToday,
          String(keyToday.refused),
          "–",
        ),
      );
    }
  }
  if (!rows.length) rows.push(el("tr", {}, el("td", { colSpan: 11, class: "muted" }, "The keys file names no tenant.")));
  $("tenants").tBodies[0].replaceChildren(...rows);
}

function tenantRow(attributes, nameCell, priority, limits, minute, today, refused, shed) {
  const budget = limits.budget && (limits.budget_period || "day") === "day" ? limits.budget : null;
  const cost = meter("cost", today.cost, budget, money(today.cost), money(budget));
  if (limits.budget && !budget) cost.append(el("span", { class: "muted" }, ` (budget ${money(limits.budget)}/${limits.budget_period})`));
  return el(
    "tr",
    attributes,
    nameCell,
    el("td", { class: "num", "data-field": "priority" }, priority),
    el("td", { "data-field": "limits" }, limitsText(limits)),
    meter("minute-requests", minute[0], limits.requests_per_minute),
    meter("minute-tokens", minute[1], limits.tokens_per_minute),
    el("td", { class: "num", "data-field": "requests" }, today.requests),
    el("td", { class: "num", "data-field": "tokens" }, today.tokens),
    cost,
    el("td", { class: "num", "data-field": "errors" }, today.errors),
    el("td", { "data-field": "refused", class: today.refused ? "bad" : "" }, refused),
    el("td", { class: "num", "data-field": "shed" }, shed),
  );
}

// --- start ---------------------------------------------------------------------------------------

function restart() {
  showAuth(false);
  knownGraphs = null;
  refreshOverview();
  followLog();
}

document.addEventListener("DOMContentLoaded", () => {
  $("token-form").addEventListener("submit", useToken);
  $("token-forget").addEventListener("click", forgetToken);
  $("strategy-form").addEventListener("submit", switchStrategy);
  $("strategy-name").addEventListener("change", () => {
    strategyPicked = true;
  });
  $("strategy-model").addEventListener("change", () => {
    strategyPicked = false;
    showCurrentStrategy();
  });
  $("chat-form").addEventListener("submit", sendChat);
  $("graph-form").addEventListener("submit", runGraph);
  $("canary-model").addEventListener("change", refreshCanary);
  $("log-filter").addEventListener("submit", (event) => event.preventDefault());
  for (const id of ["log-model", "log-class"]) $(id).addEventListener("change", readFilter);
  $("log-text").addEventListener("input", readFilter);
  setInterval(() => traffic.draw(), 1000);
  showTokenState();
  loadModels();
  restart();
});
