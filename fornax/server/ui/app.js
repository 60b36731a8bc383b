// The visualizer page: plain JS, no build step. Everything shown comes from the live server:
// /v1/fornax/tokens (tokenize), /v1/fornax/events (the engine's lifecycle events for our
// request), /v1/chat/completions with stream:true (the text), /v1/fornax/live (the server).
// Streams are read with fetch(), not EventSource, because EventSource cannot send the
// Authorization header and an API key does not belong in a URL.
//
// With a router given (?router=URL, or the settings field), the chat request goes through that
// `fornax router` instead, and the live panel shows its decision. Everything else still comes
// from this page's own replica: the router relays only the OpenAI routes, and the engine events
// exist only on the replica that runs the request. So the stages are filled when the router
// picked this replica, and when it picked another one the page says so and links to that
// replica's own page. The router answers this page cross-origin (fornax/router/cors.py), for
// the origins of its replicas only: open the page at the URL the router knows the replica by.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "fornax.apiKey";
const ROUTER_STORE = "fornax.routerUrl";
const ROUTER_POLL_MS = 2000;
let apiKey = localStorage.getItem(KEY_STORE) || "";
let routerUrl = "";  // "" when the page talks to its own server only
let routerPoll = 0;  // bumped to stop the poller of a router no longer shown
let servedBy = null;  // the replica the router chose for the last request
let model = null;
let deterministic = {};  // model id -> whether its engine runs in deterministic mode
let liveAbort = null;
let charts = null;

// ---- HTTP helpers ------------------------------------------------------------------------------

function headers(json = false) {
  const h = {};
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function failure(resp) {
  let message = resp.status + " " + resp.statusText;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON */ }
  return new HttpError(resp.status, message);
}

async function postJSON(path, body, signal) {
  const resp = await fetch(path, { method: "POST", headers: headers(true), body: JSON.stringify(body), signal });
  if (!resp.ok) throw await failure(resp);
  return resp.json();
}

// Yields each `data:` payload of a server-sent event stream. `onOpen` runs at the first block,
// comments included: the event streams send ": subscribed" once their subscription exists
// (the headers alone may come before it). `onHeaders` gets the response, errors included.
async function* sse(path, init, onOpen, onHeaders) {
  const resp = await fetch(path, init);
  if (onHeaders) onHeaders(resp);
  if (!resp.ok) throw await failure(resp);
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      if (onOpen) { onOpen(); onOpen = null; }
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data;
    }
  }
}

// ---- status and errors -------------------------------------------------------------------------

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

function setConn(state, text) {
  const el = $("conn");
  el.dataset.state = state;
  el.textContent = text;
}

function handleError(err) {
  if (err && err.name === "AbortError") return;
  if (err instanceof HttpError && err.status === 401) {
    $("auth").hidden = false;
    setConn("error", "unauthorized");
    showError("The API key was rejected: " + err.message);
    $("play").disabled = true;
  } else {
    showError(String(err && err.message ? err.message : err));
  }
}

// ---- connecting --------------------------------------------------------------------------------

// What the batch and the cache may do to this request's tokens (docs/deterministic.md).
function showNumerics() {
  const on = deterministic[model] === true;
  const cell = $("numerics");
  cell.textContent = on
    ? "deterministic: the batch, chunking and cache hits do not change its tokens or logprobs"
    : "batch-dependent: other requests in the step and cache hits can change low bits of its logits (serve with --deterministic to fix them)";
  cell.dataset.deterministic = String(on);
}

async function connect() {
  showError("");
  setConn("connecting", "connecting…");
  try {
    const resp = await fetch("/v1/models", { headers: headers() });
    if (!resp.ok) throw await failure(resp);
    const body = await resp.json();
    // a server with several models: the picker chooses which one the page talks to
    const picker = $("model");
    const ids = body.data.map((m) => m.id);
    deterministic = Object.fromEntries(body.data.map((m) => [m.id, m.deterministic === true]));
    picker.replaceChildren(...ids.map((id) => new Option(id, id)));
    model = ids.includes(model) ? model : ids[0];
    picker.value = model;
    showNumerics();
    picker.onchange = () => {
      model = picker.value;
      showNumerics();
      setConn("ok", "connected · " + model);
      startLive();
    };
    $("auth").hidden = true;
    setConn("ok", "connected · " + model);
    $("play").disabled = false;
    startLive();
  } catch (err) {
    if (err instanceof HttpError && err.status === 401 && !apiKey) {
      $("auth").hidden = false;  // first visit to a server with keys: ask, no scary error yet
      setConn("error", "API key needed");
      return;
    }
    if (err instanceof HttpError && err.status === 503) {
      setConn("connecting", "model loading…");
      setTimeout(connect, 1000);
      return;
    }
    handleError(err);
  }
}

// ---- the pipeline ------------------------------------------------------------------------------

function stage(name) {
  const order = ["tokenize", "schedule", "prefill", "output"];
  const at = order.indexOf(name);
  document.querySelectorAll("#stepper li").forEach((li, i) => {
    li.classList.toggle("active", i === at);
    li.classList.toggle("done", i < at);
  });
  order.forEach((s, i) => $("stage-" + s).classList.toggle("active", i === at));
}

function finishStages() {
  document.querySelectorAll("#stepper li").forEach((li) => { li.classList.remove("active"); li.classList.add("done"); });
  document.querySelectorAll(".stage").forEach((el) => el.classList.remove("active"));
}

function chip(label, sub, cls, title) {
  const el = document.createElement("span");
  el.className = "chip " + (cls || "");
  const tok = document.createElement("span");
  tok.className = "tok";
  tok.textContent = label;
  el.appendChild(tok);
  if (sub !== null && sub !== undefined) {
    const small = document.createElement("small");
    small.textContent = sub;
    el.appendChild(small);
  }
  if (title) el.title = title;
  return el;
}

// A token's visible form: its text, with whitespace shown, or its bytes when it is part of a character.
function visible(text, hex) {
  if (text && !text.includes("\ufffd")) return text.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "⇥");
  return "‹" + (hex.match(/../g) || []).join(" ") + "›";
}

const fmtMs = (s) => (s === null || s === undefined ? "–" : (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms");

function resetView() {
  for (const id of ["token-chips", "batch", "blocks", "prefill-bar", "chunks", "output-text", "output-tokens"]) $(id).textContent = "";
  for (const id of ["token-count", "queue-pos", "sched-step", "batch-size", "cached-tokens", "ttft", "out-count", "tps", "itl-mean", "finish"]) $(id).textContent = "–";
  showError("");
}

async function play(ev) {
  ev.preventDefault();
  const button = $("play");
  button.disabled = true;
  resetView();
  const content = $("prompt").value;
  const messages = [{ role: "user", content }];
  const run = new Run();
  try {
    stage("tokenize");
    const tok = await postJSON("/v1/fornax/tokens", { model, messages, add_generation_prompt: true });
    renderTokens(tok);
    stage("schedule");
    await run.go(messages);
    finishStages();
  } catch (err) {
    handleError(err);
  } finally {
    run.close();
    button.disabled = !model;
  }
}

function renderTokens(tok) {
  const box = $("token-chips");
  for (const t of tok.tokens) {
    const cls = (t.template ? "template " : "") + (t.special ? "special" : "");
    const title = "id " + t.id + " · bytes " + ((t.bytes.match(/../g) || []).join(" ") || "(none)") + (t.template ? " · chat template" : "");
    const el = chip(visible(t.text, t.bytes), t.id, cls, title);
    el.dataset.id = t.id;
    box.appendChild(el);
  }
  $("token-count").textContent = tok.count;
}

// One Play. The page subscribes to every request's events before it sends its own request, so
// nothing of its request can be missed; the request id comes with the first streamed chunk. Then
// it follows just that request (`?request_id=`: its history first, then live, ending at
// `finished`) and drops the firehose, which on a busy server would be mostly other requests'
// events. `seq` numbers make the overlap between the two streams harmless.
class Run {
  constructor() {
    this.abort = new AbortController();  // everything of this run
    this.firehose = new AbortController();  // the all-requests stream, until we know our id
    this.id = null;
    this.pending = [];  // events that came before we knew our id
    this.lastSeq = 0;
    this.promptLen = 0;
    this.tokens = 0;
    this.itls = [];
    this.firstTokenAt = null;
    this.elsewhere = false;  // a router sent the request to another replica: no events here
    this.finished = new Promise((resolve) => { this.markFinished = resolve; });
  }

  close() { this.abort.abort(); this.firehose.abort(); }

  async go(messages) {
    let ready;
    const subscribed = new Promise((resolve) => { ready = resolve; });
    const all = this.readAll(ready);
    await Promise.race([subscribed, all]);
    const body = {
      model, messages, stream: true, logprobs: true,
      temperature: Number($("temperature").value), top_p: Number($("top-p").value),
      max_tokens: Number($("max-tokens").value),
    };
    if ($("seed").value !== "") body.seed = Number($("seed").value);
    const init = { method: "POST", headers: headers(true), body: JSON.stringify(body), signal: this.abort.signal };
    const out = $("output-text");
    const onHeaders = (resp) => { if (routerUrl) this.elsewhere = !showRoute(resp); };
    for await (const data of sse(routerUrl + "/v1/chat/completions", init, null, onHeaders)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (this.id === null) this.adopt(chunk.id);
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) out.textContent += choice.delta.content;
        if (choice.finish_reason) $("finish").textContent = choice.finish_reason;
      }
    }
    // The `finished` event may trail the text by a moment: give it a short grace.
    await Promise.race([this.finished, new Promise((r) => setTimeout(r, 3000))]);
  }

  adopt(id) {
    this.id = id;
    document.body.dataset.requestId = id;
    if (this.elsewhere) {  // its events are on the replica that ran it, not on this one
      this.firehose.abort();
      this.pending = [];
      this.markFinished();
      return;
    }
    const early = this.pending;
    this.pending = [];
    for (const e of early) if (e.request_id === id) this.onEvent(e);
    this.follow(id);
  }

  async readAll(ready) {
    const init = { headers: headers(), signal: this.firehose.signal };
    try {
      for await (const data of sse("/v1/fornax/events?" + modelQuery(), init, ready)) {
        const e = JSON.parse(data);
        if (this.id === null) this.pending.push(e);
        else if (e.request_id === this.id) this.onEvent(e);
      }
    } catch (err) {
      ready();
      if (err.name !== "AbortError") handleError(err);
    }
  }

  async follow(id) {
    const init = { headers: headers(), signal: this.abort.signal };
    // Drop the firehose only once this stream has subscribed: until then it keeps the bus
    // recording the history this stream starts with.
    const onOpen = () => this.firehose.abort();
    try {
      const url = "/v1/fornax/events?request_id=" + encodeURIComponent(id) + "&" + modelQuery();
      for await (const data of sse(url, init, onOpen)) {
        this.onEvent(JSON.parse(data));
      }
    } catch (err) {
      if (err.name !== "AbortError") handleError(err);
    }
  }

  onEvent(e) {
    if (e.seq !== undefined) {
      if (e.seq <= this.lastSeq) return;  // seen on the other stream already
      this.lastSeq = e.seq;
    }
    const handler = this["on_" + e.type];
    if (handler) handler.call(this, e);
  }

  on_queued(e) {
    this.promptLen = e.num_prompt_tokens;
    $("queue-pos").textContent = "#" + (e.position + 1) + " of " + e.num_waiting + " waiting (" + e.num_running + " running)"
      + (e.adapter ? " · LoRA adapter " + e.adapter : "");
  }

  on_scheduled(e) {
    $("sched-step").textContent = e.step;
    $("batch-size").textContent = e.batch_size;
    $("cached-tokens").textContent = e.num_cached_tokens + " of " + this.promptLen + " prompt tokens";
    const batch = $("batch");
    batch.textContent = "";
    batch.appendChild(chip("this request", null, "me"));
    for (const other of e.batch) batch.appendChild(chip(other.slice(0, 16) + "…", null, "", other));
    if (e.num_cached_tokens > 0) this.segment(0, e.num_cached_tokens, "cached", "cache");
    stage("prefill");
  }

  on_blocks(e) {
    const box = $("blocks");
    const tiers = e.tiers || {};
    for (const id of e.cached) box.appendChild(block(id, true, tiers[id]));
    for (const id of e.new) box.appendChild(block(id, false));
    box.dataset.cached = box.querySelectorAll(".block.cached").length;
  }

  on_prefill_chunk(e) {
    this.segment(e.start, e.end, "chunk", e.end - e.start);
    const li = document.createElement("li");
    li.textContent = "step " + e.step + ": tokens " + e.start + "–" + e.end + " of " + e.num_prompt_tokens + " in " + fmtMs(e.duration_s);
    $("chunks").appendChild(li);
  }

  segment(start, end, cls, label) {
    const seg = document.createElement("div");
    seg.className = "seg " + cls;
    seg.style.width = (100 * (end - start) / Math.max(this.promptLen, 1)) + "%";
    seg.textContent = label;
    seg.title = cls === "cached" ? "tokens 0–" + end + " from the prefix cache" : "tokens " + start + "–" + end + " computed";
    $("prefill-bar").appendChild(seg);
  }

  on_token(e) {
    if (this.tokens === 0) stage("output");
    if (e.ttft_s !== undefined && e.ttft_s !== null) $("ttft").textContent = fmtMs(e.ttft_s);
    this.tokens += 1;
    const now = performance.now();
    if (this.firstTokenAt === null) this.firstTokenAt = now;
    if (e.itl_s !== null) this.itls.push(e.itl_s);
    const sub = e.itl_s === null ? "TTFT" : fmtMs(e.itl_s);
    const title = "id " + e.token_id + " · bytes " + (e.bytes.match(/../g) || []).join(" ") +
      (e.logprob === null ? "" : " · logprob " + e.logprob.toFixed(4) + " (p=" + Math.exp(e.logprob).toFixed(3) + ")") +
      " · step " + e.step + ", batch of " + e.batch_size;
    const el = chip(visible(e.text, e.bytes), sub, "new", title);
    el.dataset.id = e.token_id;
    if (e.itl_s !== null) el.dataset.itl = e.itl_s;
    if (e.logprob !== null) el.dataset.logprob = e.logprob;
    $("output-tokens").appendChild(el);
    $("out-count").textContent = this.tokens;
    const secs = (now - this.firstTokenAt) / 1000;
    if (this.itls.length) {
      const sum = this.itls.reduce((a, b) => a + b, 0);
      $("itl-mean").textContent = fmtMs(sum / this.itls.length);
      $("tps").textContent = (this.itls.length / Math.max(sum, 1e-9)).toFixed(1) + " (wall " + (secs > 0 ? (this.itls.length / secs).toFixed(1) : "–") + ")";
    }
  }

  on_preempted() {
    $("chunks").appendChild(Object.assign(document.createElement("li"), { textContent: "preempted: blocks freed, back to the queue" }));
    $("blocks").textContent = "";
  }

  on_finished(e) {
    $("finish").textContent = e.finish_reason;
    if (e.timings && e.timings.ttft_s !== undefined) $("ttft").textContent = fmtMs(e.timings.ttft_s);
    this.markFinished();
  }
}

// Where a cached block's K/V came from: the primary prefix cache, or a KV tier below it.
const TIER_TITLES = {host: "loaded from host memory (KV tier 1)", disk: "loaded from disk (KV tier 2)",
                     swap: "swapped back in from host memory after a preemption"};

function block(id, cached, tier) {
  const el = document.createElement("span");
  el.className = "block" + (cached ? " cached" : "") + (tier ? " tier-" + tier : "");
  el.textContent = id;
  el.title = "block " + id + (tier ? " · " + TIER_TITLES[tier] : cached ? " · prefix-cache hit" : " · newly allocated");
  return el;
}

// ---- the live panel ----------------------------------------------------------------------------

function modelQuery() {
  return "model=" + encodeURIComponent(model || "");
}

async function startLive() {
  if (liveAbort) liveAbort.abort();
  liveAbort = new AbortController();
  try {
    const url = "/v1/fornax/live?interval=1&" + modelQuery();
    for await (const data of sse(url, { headers: headers(), signal: liveAbort.signal })) {
      renderLive(JSON.parse(data));
    }
  } catch (err) {
    if (err.name === "AbortError") return;
    handleError(err);
    return;
  }
  setTimeout(startLive, 2000);  // the server closed it (restart?): reconnect
}

function renderLive(s) {
  const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
  const ms = (x) => (x === null || x === undefined ? "–" : x.toFixed(1) + " ms");
  $("live-running").textContent = s.num_running ?? "–";
  $("live-waiting").textContent = s.num_waiting ?? "–";
  $("live-kv").textContent = pct(s.kv_cache_usage) + (s.num_blocks ? " of " + s.num_blocks + " blocks" : "");
  $("live-kv-meter").value = s.kv_cache_usage || 0;
  $("live-tps").textContent = s.tokens_per_s_10s.toFixed(1) + " tok/s";
  $("live-ttft").textContent = ms(s.ttft_ms_p50);
  $("live-itl").textContent = ms(s.itl_ms_p50);
  $("live-hit").textContent = pct(s.prefix_cache_hit_rate);
  const list = (id, items, fmt) => {
    const box = $(id);
    box.textContent = "";
    if (!items || !items.length) box.appendChild(chip("(empty)", null, "idle"));
    for (const r of items || []) box.appendChild(chip(r.request_id.slice(0, 14) + "…", fmt(r), r.request_id === document.body.dataset.requestId ? "me" : "", r.request_id));
  };
  list("live-run-list", s.running, (r) => r.num_computed_tokens + "/" + r.num_tokens + " tok");
  list("live-wait-list", s.waiting, (r) => r.num_prompt_tokens + " tok");
  renderCharts(s.series || []);
}

function renderCharts(series) {
  if (typeof window.uPlot === "undefined") {
    $("charts-missing").hidden = false;
    return;
  }
  const t = series.map((p) => p.t);
  const tps = [t, series.map((p) => p.tokens_per_s)];
  const lat = [t, series.map((p) => p.ttft_ms), series.map((p) => p.itl_ms)];
  const width = () => Math.max(240, $("chart-tps").clientWidth || 300);
  if (!charts) {
    // Always show the whole window (5 minutes), not just the span that has data so far.
    const x = { time: true, range: (u, min, max) => [Math.min(min, Date.now() / 1000 - 300), Math.max(max, Date.now() / 1000)] };
    const y = { range: (u, min, max) => [0, Math.max(max || 0, 1) * 1.1] };  // rates and latencies start at 0
    const base = (title) => ({ title, width: width(), height: 160, scales: { x, y }, legend: { show: true } });
    charts = {
      tps: new uPlot({ ...base("output tokens/s"), series: [{}, { label: "tok/s", stroke: "#3b5bdb", fill: "#3b5bdb22" }] }, tps, $("chart-tps")),
      lat: new uPlot({ ...base("latency (ms, p50)"), series: [{}, { label: "TTFT", stroke: "#f08c00", spanGaps: true }, { label: "ITL", stroke: "#2f9e44", spanGaps: true }] }, lat, $("chart-lat")),
    };
    window.addEventListener("resize", () => { for (const c of Object.values(charts)) c.setSize({ width: width(), height: 160 }); });
  } else {
    charts.tps.setData(tps);
    charts.lat.setData(lat);
  }
}

// ---- the router --------------------------------------------------------------------------------

// What each route reason means (fornax/router/policies.py and proxy.py name them).
const REASONS = {
  cache_hit: "it already holds the longest prefix of this prompt (cache-aware)",
  cache_miss: "no replica held enough of this prompt: the least loaded (cache-aware)",
  balance_fallback: "the replicas were out of balance: the least loaded (cache-aware)",
  least_load: "the least loaded",
  round_robin: "its turn (round-robin)",
  long_pool: "a long prompt: the long-prompt pool",
  short_pool: "a short prompt: the untagged pool",
  pool_fallback: "its pool had no replica available: any replica",
  retries_exhausted: "every attempt failed: this was the last one",
};

// "" (no router) or the URL without trailing slashes; anything but http(s) is refused.
function routerBase(value) {
  const text = (value || "").trim().replace(/\/+$/, "");
  if (!text) return "";
  try {
    const url = new URL(text);
    if (url.protocol === "http:" || url.protocol === "https:") return text;
  } catch (_) { /* not a URL */ }
  return null;
}

function useRouter(value) {
  const base = routerBase(value);
  routerUrl = base || "";
  routerPoll += 1;  // the poller of the previous router stops at its next turn
  servedBy = null;
  $("router").hidden = $("live-self").hidden = !routerUrl;
  $("router-name").textContent = routerUrl;
  for (const id of ["route-replica", "route-reason", "route-attempts"]) $(id).textContent = "–";
  $("route-elsewhere").hidden = true;
  $("router-replicas").textContent = "";
  routerNote(base === null ? "Not a router URL (http://host:port): the page uses its own server." : "");
  if (base === null) $("router").hidden = false;
  if (routerUrl) pollReplicas(routerPoll);
}

function routerNote(text) {
  $("router-note").textContent = text;
  $("router-note").hidden = !text;
}

const sameOrigin = (url) => { try { return new URL(url).origin === location.origin; } catch (_) { return false; } };

// Shows the router's decision from its answer's headers; true when the replica is this page's.
function showRoute(resp) {
  const replica = resp.headers.get("x-fornax-replica");
  const reason = resp.headers.get("x-fornax-route-reason");
  const mine = !!replica && sameOrigin(replica);
  servedBy = replica;
  $("route-replica").textContent = replica ? replica + (mine ? " (this page's replica)" : "") :
    "not named (is " + routerUrl + " a fornax router?)";
  const code = document.createElement("code");
  code.textContent = reason || "–";
  $("route-reason").replaceChildren(code, REASONS[reason] ? " · " + REASONS[reason] : "");
  $("route-attempts").textContent = resp.headers.get("x-fornax-attempts") || "–";
  $("route-elsewhere").hidden = mine || !replica;
  if (replica && !mine) {
    const link = document.createElement("a");
    link.href = replica + "/ui/?router=" + encodeURIComponent(routerUrl);
    link.textContent = "its own page";
    $("route-elsewhere").replaceChildren("Another replica ran it, so its engine events (stages 2–4) are on ", link, ".");
  }
  document.querySelectorAll("#router-replicas tr").forEach((tr) => tr.classList.toggle("me", tr.dataset.url === servedBy));
  return mine;
}

// GET /router/replicas every ROUTER_POLL_MS while this router is shown and the tab is visible.
async function pollReplicas(generation) {
  while (generation === routerPoll) {
    if (!document.hidden) await fetchReplicas();
    await new Promise((r) => setTimeout(r, ROUTER_POLL_MS));
  }
}

async function fetchReplicas() {
  try {
    const resp = await fetch(routerUrl + "/router/replicas", { headers: headers() });
    if (resp.status === 401 || resp.status === 403) {
      routerNote("The replica list needs a router admin key (--admin-key): " + (await failure(resp)).message);
      return;
    }
    if (!resp.ok) throw await failure(resp);
    const body = await resp.json();
    renderReplicas([...body.data, ...(body.draining || [])], body.policy);
  } catch (err) {
    // fetch() says only "Failed to fetch" for both an unreachable router and a refused origin.
    routerNote("Cannot read " + routerUrl + "/router/replicas (" + err.message + "). Is the router up, and " +
      "was this page opened at the URL the router knows this replica by?");
  }
}

function replicaState(r) {
  if (r.draining) return ["draining", "removed: finishing its requests"];
  if (!r.healthy) return ["out", r.last_error || "failed its health checks"];
  if (!r.ready) return ["not ready", r.last_error || "loading or draining"];
  return ["in rotation", ""];
}

function renderReplicas(replicas, policy) {
  const rows = replicas.map((r) => {
    const [state, why] = replicaState(r);
    const tr = document.createElement("tr");
    tr.dataset.url = r.url;
    tr.dataset.state = state;
    tr.classList.toggle("me", r.url === servedBy);
    const cells = [r.url + (sameOrigin(r.url) ? " (this page)" : ""), state, r.inflight, +r.load.toFixed(1),
      (100 * r.polled.kv_cache_usage).toFixed(1) + "%"];
    for (const text of cells) tr.appendChild(Object.assign(document.createElement("td"), { textContent: text }));
    tr.children[1].title = why;
    return tr;
  });
  $("router-replicas").replaceChildren(...rows);
  routerNote(replicas.length ? "policy: " + policy : "The router has no replicas.");
}

// ---- start -------------------------------------------------------------------------------------

window.addEventListener("DOMContentLoaded", () => {
  $("play-form").addEventListener("submit", play);
  const given = new URLSearchParams(location.search).get("router");
  $("router-url").value = given ?? localStorage.getItem(ROUTER_STORE) ?? "";
  $("router-url").addEventListener("change", () => {
    localStorage.setItem(ROUTER_STORE, $("router-url").value.trim());
    useRouter($("router-url").value);
  });
  useRouter($("router-url").value);
  $("auth-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    apiKey = $("api-key").value.trim();
    localStorage.setItem(KEY_STORE, apiKey);
    connect();
  });
  connect();
});
