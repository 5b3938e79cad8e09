// The playground: a chat over the server's public API that marks each streamed token by where it came from
// (the request extension return_token_sources), compares plain and speculative decoding of one prompt
// (speculation: false decodes plainly), and shows the server's Prometheus figures. No library, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "specdec-api-key"; // session storage only: gone with the tab
const METRICS_EVERY_MS = 3000;

const page = {
  model: null, // the served model's id, from /v1/models
  drafter: null, // its drafter ("none": the server decodes plainly)
  messages: [], // the conversation, as the API takes it
  running: null, // the AbortController of the request in flight
  keyPrompt: null, // the key dialog's pending answer, so that concurrent 401s ask once
};

// -- the API -----------------------------------------------------------------------------------------------

class ApiError extends Error {}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON: say the status */ }
  return `the server answered ${response.status} ${response.statusText}`;
}

function askForKey(reason) {
  if (!page.keyPrompt) {
    page.keyPrompt = new Promise((resolve, reject) => {
      const dialog = $("key-dialog");
      $("key-reason").textContent = reason;
      $("key").value = "";
      const done = (event) => {
        event.preventDefault();
        sessionStorage.setItem(KEY, $("key").value.trim());
        dialog.removeEventListener("cancel", cancelled);
        dialog.close();
        resolve();
      };
      const cancelled = () => {
        $("key-form").removeEventListener("submit", done);
        reject(new ApiError("this server needs an API key; reload the page to enter one"));
      };
      $("key-form").addEventListener("submit", done, { once: true });
      dialog.addEventListener("cancel", cancelled, { once: true });
      dialog.showModal();
      $("key").focus();
    }).finally(() => { page.keyPrompt = null; });
  }
  return page.keyPrompt;
}

// fetch with the key (asked for on a 401 and kept for the session); a non-2xx answer throws its message.
async function api(path, options = {}) {
  for (;;) {
    const headers = { ...(options.headers || {}) };
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(path, { ...options, headers });
    if (response.status === 401) {
      await askForKey(await errorMessage(response));
      continue;
    }
    if (!response.ok) throw new ApiError(await errorMessage(response));
    return response;
  }
}

// The SSE stream's JSON payloads, until [DONE]; an error event throws its message.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      if (data === "[DONE]") return;
      if (!data) continue; // a comment (keep-alive ping)
      const payload = JSON.parse(data);
      if (payload.error) throw new ApiError(payload.error.message);
      yield payload;
    }
  }
}

function settings() {
  const number = (id) => ($(id).value === "" ? null : Number($(id).value));
  const stop = $("stop-strings").value.split("\n").filter((line) => line !== "");
  return {
    temperature: number("temperature") ?? 1,
    top_p: number("top-p") ?? 1,
    max_tokens: number("max-tokens") ?? 256,
    seed: number("seed"),
    stop: stop.length ? stop : null,
  };
}

// Stream one chat completion; onToken(text, sources) per chunk, onUsage(usage) with the figures so far.
async function chat(messages, { speculation, seed, cacheSalt, signal, onToken, onUsage }) {
  const body = {
    model: page.model, messages, stream: true, ...settings(),
    stream_options: { include_usage: true, continuous_usage_stats: true },
    return_token_sources: true, speculation,
  };
  if (seed !== undefined) body.seed = seed;
  if (cacheSalt) body.cache_salt = cacheSalt;
  const response = await api("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
  });
  let finish = null;
  for await (const chunk of events(response)) {
    if (chunk.usage) onUsage(chunk.usage);
    for (const choice of chunk.choices) {
      const sources = choice.token_sources || [];
      if (sources.length || choice.delta.content) onToken(choice.delta.content || "", sources);
      finish = choice.finish_reason || finish;
    }
  }
  return finish;
}

// -- what the page shows -----------------------------------------------------------------------------------

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

function addMessage(role, text) {
  const item = document.createElement("li");
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  item.append(who, body);
  $("conversation").append(item);
  return body;
}

// One token's text in a span marked by its source; a chunk of several tokens (held back) takes its last's.
function appendToken(container, text, sources) {
  const span = document.createElement("span");
  const source = sources.length ? sources[sources.length - 1] : "target";
  span.className = `tok ${source}`;
  span.dataset.tokens = String(Math.max(sources.length, 1));
  span.textContent = text;
  container.append(span);
}

// Timing of one streamed request: tokens/s over the decode (from the first token), as the server paced them.
class Timing {
  constructor() { this.start = performance.now(); this.first = null; this.last = null; this.tokens = 0; }
  token(count) {
    const now = performance.now();
    if (this.first === null) this.first = now;
    this.last = now;
    this.tokens += count;
  }
  get rate() {
    if (this.first === null || this.last === this.first) return null;
    return (this.tokens - 1) / ((this.last - this.first) / 1000);
  }
  get ttft() { return this.first === null ? null : (this.first - this.start) / 1000; }
}

const fixed = (value, digits) => (value === null || value === undefined ? "–" : value.toFixed(digits));
const percent = (value) => (value === null || value === undefined ? "–" : `${(100 * value).toFixed(0)}%`);

function showLive(timing, usage) {
  $("live-rate").textContent = fixed(timing.rate, 1);
  if (!usage) return;
  const speculative = usage.speculative || {};
  $("live-tokens").textContent = String(usage.completion_tokens);
  const kept = (speculative.accepted_tokens || 0) + (speculative.grammar_accepted_tokens || 0);
  $("live-kept").textContent = String(kept);
  const drafted = speculative.draft_tokens > 0;
  $("live-acceptance").textContent = drafted ? percent(speculative.acceptance_rate) : "–";
  $("live-length").textContent = drafted ? fixed(speculative.mean_accepted_length, 2) : "–";
  $("live-gamma").textContent = drafted ? fixed(speculative.mean_gamma, 2) : "–";
}

function busy(running) {
  if (!running && page.model) refreshMetrics(); // what the request just did, without waiting for the next poll
  $("send").disabled = running;
  $("compare").disabled = running || page.drafter === "none";
  $("clear").disabled = running;
  $("stop").disabled = !running;
}

function conversation(userText) {
  const system = $("system").value.trim();
  return [...(system ? [{ role: "system", content: system }] : []), ...page.messages,
    { role: "user", content: userText }];
}

// -- actions -------------------------------------------------------------------------------------------------

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || page.running) return;
  showError("");
  const messages = conversation(text);
  addMessage("user", text);
  $("prompt").value = "";
  const reply = addMessage("assistant", "");
  reply.setAttribute("aria-busy", "true");
  const timing = new Timing();
  let usage = null;
  page.running = new AbortController();
  busy(true);
  try {
    await chat(messages, {
      speculation: $("decoding").value === "speculative",
      signal: page.running.signal,
      onToken: (piece, sources) => { appendToken(reply, piece, sources); timing.token(Math.max(sources.length, 1)); showLive(timing, usage); },
      onUsage: (figures) => { usage = figures; showLive(timing, usage); },
    });
    page.messages.push({ role: "user", content: text }, { role: "assistant", content: reply.textContent });
  } catch (error) {
    if (error.name === "AbortError") {
      reply.parentElement.querySelector(".who").textContent = "assistant (stopped)";
      page.messages.push({ role: "user", content: text }, { role: "assistant", content: reply.textContent });
    } else {
      showError(error.message);
      reply.parentElement.remove();
      $("conversation").lastElementChild?.remove(); // the user's message: it was not answered
      $("prompt").value = text;
    }
  } finally {
    reply.removeAttribute("aria-busy");
    page.running = null;
    busy(false);
    $("prompt").focus();
  }
}

// The composer's text (or the last question) decoded speculatively, then plainly, with one seed: the texts
// must be equal, and the figures say how much faster the drafts made it. Speculative first: a drafter that
// remembers answers (suffix) must not draft from the plain run's. Each run has a cache salt of its own, so
// that neither reads the other's prompt from the prefix cache.
async function compare() {
  const text = $("prompt").value.trim() ? $("prompt").value : lastQuestion();
  if (!text || page.running) return;
  showError("");
  const seed = settings().seed ?? Math.floor(Math.random() * 2 ** 31);
  const messages = conversation(text);
  if (!$("prompt").value.trim()) messages.splice(-3, 2); // the last question is the one asked again
  $("comparison").hidden = false;
  $("comparison-verdict").textContent = `Decoding with seed ${seed}…`;
  const runs = {};
  page.running = new AbortController();
  busy(true);
  try {
    for (const kind of ["speculative", "plain"]) {
      const target = $(`${kind}-text`);
      target.textContent = "";
      $(`${kind}-figures`).textContent = "decoding…";
      const timing = new Timing();
      await chat(messages, {
        speculation: kind === "speculative", seed, cacheSalt: `compare-${kind}-${Math.random()}`,
        signal: page.running.signal,
        onToken: (piece, sources) => { appendToken(target, piece, sources); timing.token(Math.max(sources.length, 1)); },
        onUsage: () => {},
      });
      runs[kind] = { text: target.textContent, timing };
      $(`${kind}-figures`).textContent =
        `${fixed(timing.rate, 1)} tokens/s over ${timing.tokens} tokens; first token after ${fixed(timing.ttft, 2)} s`;
    }
    const same = runs.plain.text === runs.speculative.text;
    const speedup = runs.plain.timing.rate && runs.speculative.timing.rate
      ? runs.speculative.timing.rate / runs.plain.timing.rate : null;
    $("comparison-verdict").textContent = `${same ? "The same text" : "The texts differ (please report this)"}`
      + ` with seed ${seed}; speculative decoding ran ${fixed(speedup, 2)}x as fast.`;
  } catch (error) {
    $("comparison-verdict").textContent = error.name === "AbortError" ? "Stopped." : "";
    if (error.name !== "AbortError") showError(error.message);
  } finally {
    page.running = null;
    busy(false);
  }
}

function lastQuestion() {
  const last = [...page.messages].reverse().find((message) => message.role === "user");
  return last ? last.content : "";
}

// -- the server's figures --------------------------------------------------------------------------------------

// Prometheus' text format: [{name, labels, value}], comments skipped.
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    const match = line.match(/^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/);
    if (!match || line.startsWith("#")) continue;
    const labels = {};
    for (const [, name, value] of (match[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[name] = value;
    samples.push({ name: match[1], labels, value: Number(match[3]) });
  }
  return samples;
}

function showMetrics(samples) {
  const one = (name) => samples.find((sample) => sample.name === name)?.value ?? null;
  const method = page.drafter;
  $("m-running").textContent = fixed(one("specdec_running_requests"), 0);
  $("m-queue").textContent = fixed(one("specdec_queue_depth"), 0);
  const batches = one("specdec_batch_size_count");
  $("m-batch").textContent = batches ? fixed(one("specdec_batch_size_sum") / batches, 2) : "–";
  const rate = samples.find((sample) => sample.name === "specdec_acceptance_rate" && sample.labels.method === method);
  $("m-acceptance").textContent = rate ? percent(rate.value) : "–";
  const byPosition = (name) => Object.fromEntries(samples
    .filter((sample) => sample.name === name && sample.labels.method === method)
    .map((sample) => [Number(sample.labels.position), sample.value]));
  const drafted = byPosition("specdec_draft_tokens_per_position_total");
  const accepted = byPosition("specdec_accepted_tokens_per_position_total");
  const rows = Object.keys(drafted).map(Number).sort((a, b) => a - b).map((position) => {
    const row = document.createElement("tr");
    const cells = [String(position), fixed(accepted[position] ?? 0, 0), fixed(drafted[position], 0),
      drafted[position] ? percent((accepted[position] ?? 0) / drafted[position]) : "–"];
    for (const text of cells) {
      const cell = document.createElement("td");
      cell.textContent = text;
      row.append(cell);
    }
    return row;
  });
  $("m-positions").tBodies[0].replaceChildren(...rows);
  $("m-positions").hidden = rows.length === 0;
}

// Read /metrics now; false where they cannot be read here (then the panel says why, and polling stops).
async function refreshMetrics() {
  try {
    const response = await api("/metrics");
    showMetrics(parseMetrics(await response.text()));
    $("metrics-note").textContent = "From /metrics, every few seconds.";
    return true;
  } catch (error) {
    // Where metrics are served on their own port the server says so, and the panel passes that on.
    $("metrics-note").textContent = `The server's metrics are not readable here: ${error.message}.`;
    $("metrics-figures").hidden = true;
    $("m-positions").hidden = true;
    return false;
  }
}

async function pollMetrics() {
  if (document.visibilityState === "visible" && !page.keyPrompt && !(await refreshMetrics())) return;
  setTimeout(pollMetrics, METRICS_EVERY_MS);
}

// -- start -----------------------------------------------------------------------------------------------------

async function start() {
  $("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => page.running?.abort());
  $("compare").addEventListener("click", compare);
  $("clear").addEventListener("click", () => { page.messages = []; $("conversation").replaceChildren(); });
  busy(true);
  try {
    const health = await fetch("/health").then((response) => response.json()).catch(() => ({}));
    if (health.status && health.status !== "ready") {
      $("server-line").textContent = `The server is ${health.status}; reload when it is ready.`;
      if (health.error) showError(health.error);
      return;
    }
    const models = await (await api("/v1/models")).json();
    const model = models.data[0];
    page.model = model.id;
    page.drafter = model.drafter || "none";
    $("server-line").textContent = `Model ${page.model}, drafter ${page.drafter}`;
    $("decoding").options[0].textContent = page.drafter === "none" ? "speculative (this server has no drafter)"
      : `speculative (${page.drafter})`;
    busy(false); // reads the metrics once
    setTimeout(pollMetrics, METRICS_EVERY_MS);
  } catch (error) {
    $("server-line").textContent = "Not connected.";
    showError(error.message);
  }
}

start();
