// The playground: a chat over the server's public API that marks each streamed token by where it came from
// (the request extension return_token_sources), compares plain and speculative decoding of one prompt
// (speculation: false decodes plainly), and shows the server's Prometheus figures. Answers show as markdown,
// through two vendored libraries (vendor/VENDOR.md: marked renders, DOMPurify sanitizes); no build step.
// URLs are relative to the page, so that it works behind a path prefix too.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "specdec-api-key"; // session storage only: gone with the tab
const CONVERSATION = "specdec-conversation"; // the chat, kept in the tab across reloads
const METRICS_EVERY_MS = 3000;
const METRICS_BACKOFF_MS = 30000; // after a failed read: the server may be draining or limiting this client
const SOURCES = { drafter: "drafted and kept", grammar: "forced by the grammar", target: "the target's own" };

const page = {
  model: null, // the served model's id, from /v1/models
  drafter: null, // its drafter ("none": the server decodes plainly)
  messages: [], // the conversation: {role, content} as the API takes them, assistant ones with their pieces
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
      const form = $("key-form");
      $("key-reason").textContent = reason;
      $("key").value = "";
      const submitted = (event) => {
        event.preventDefault();
        const key = $("key").value.trim();
        if (!/^[\x21-\x7e]+$/.test(key)) { // a header carries printable ASCII only
          $("key-reason").textContent = "An API key is printable ASCII without spaces; check what you pasted.";
          return;
        }
        sessionStorage.setItem(KEY, key);
        finish();
        resolve();
      };
      const closed = () => { // Escape, Cancel, or any other way out
        finish();
        reject(new ApiError("this server needs an API key; choose Connect to enter one"));
      };
      const finish = () => {
        form.removeEventListener("submit", submitted);
        dialog.removeEventListener("close", closed);
        if (dialog.open) dialog.close();
      };
      form.addEventListener("submit", submitted);
      dialog.addEventListener("close", closed);
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

// The SSE stream's JSON payloads, until [DONE]; an error event throws its message, and so does a stream
// that ends without [DONE] (the connection was cut).
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new ApiError("the stream ended before the answer did (the connection was cut)");
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

// The sampling settings as the form has them now; a request reads them once, when it starts.
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
async function chat(messages, sampling, { speculation, cacheSalt, signal, onToken, onUsage }) {
  const body = {
    model: page.model, messages: messages.map(({ role, content }) => ({ role, content })), stream: true, ...sampling,
    stream_options: { include_usage: true, continuous_usage_stats: true },
    return_token_sources: true, speculation,
  };
  if (cacheSalt) body.cache_salt = cacheSalt;
  const response = await api("v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
  });
  for await (const chunk of events(response)) {
    if (chunk.usage) onUsage(chunk.usage);
    for (const choice of chunk.choices) {
      const sources = choice.token_sources || [];
      if (sources.length || choice.delta.content) onToken(choice.delta.content || "", sources);
    }
  }
}

// -- what the page shows -----------------------------------------------------------------------------------

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

function announce(message) {
  $("status").textContent = message;
}

// A message in the conversation: the user's as typed, the assistant's rendered (its body filled by render).
function addMessage(role, text) {
  const item = document.createElement("li");
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = role === "assistant" ? "markdown" : "text";
  body.textContent = text;
  item.append(who, body);
  $("conversation").append(item);
  return body;
}

// -- answers as markdown ---------------------------------------------------------------------------------------
// An answer is kept as its pieces, [text, source, tokens] a streamed chunk; their joined raw text is the record
// (the next turn's history, Compare's check, the tab's storage). The page shows it rendered: marked makes HTML
// of it, DOMPurify keeps only the tags below (the model's own HTML shows as text, never as elements), and each
// rendered character is then matched to the raw character it came from, to be marked by its token's source.

const escapeHtml = (text) => text.replace(/[&<>"']/g, (char) => `&#${char.charCodeAt(0)};`);
const markdown = new marked.Marked({
  renderer: {
    html: ({ text, block }) => (block ? `<p>${escapeHtml(text)}</p>` : escapeHtml(text)),
    // The page fetches no images for an answer (nor lets one track its reader): an image shows as a link to it.
    image(token) { return this.link({ ...token, text: token.text || token.href, autolink: true }); },
  },
});
const RENDERED = {
  ALLOWED_TAGS: ["p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol", "li", "blockquote", "pre", "code",
    "em", "strong", "del", "a", "table", "thead", "tbody", "tr", "th", "td"],
  ALLOWED_ATTR: ["href", "start", "align"],
  RETURN_DOM_FRAGMENT: true,
};
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName !== "A") return;
  if (/^(https?|mailto):/i.test(node.getAttribute("href") || "")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  } else {
    node.removeAttribute("href"); // relative, javascript: and any other scheme: the words stay, not the link
  }
});

// One chunk as a piece: a chunk of several tokens, held back, takes its last's source.
function piece(text, sources) {
  return [text, sources.length ? sources[sources.length - 1] : "target", Math.max(sources.length, 1)];
}

// Which piece each rendered character came from (-1: none found). Rendered text is the raw text less
// markdown's syntax, in order, so a character is matched to the next equal raw one. A code block's text is
// the raw text verbatim, so it is matched whole (its fence's info string cannot take its first letters).
// Whitespace crosses only syntax characters: the newlines between rendered blocks (a list's, a table's) must
// not skip the text they stand before.
function origins(text, inCode, raw, owners, cursor) {
  const from = new Array(text.length).fill(-1);
  let i = 0;
  const code = inCode ? text.replace(/\n$/, "") : "";
  const found = code ? raw.indexOf(code, cursor.at) : -1;
  if (found >= 0) {
    for (; i < code.length; i++) from[i] = owners[found + i];
    cursor.at = found + code.length;
  }
  for (; i < text.length; i++) {
    const char = text[i];
    let at = cursor.at;
    if (/\s/.test(char)) while (at < raw.length && raw[at] !== char && !/[\s\p{L}\p{N}]/u.test(raw[at])) at++;
    else at = raw.indexOf(char, at);
    if (at >= 0 && raw[at] === char) {
      from[i] = owners[at];
      cursor.at = at + 1;
    }
  }
  return from;
}

// Fills the container with the pieces' text as markdown, each run of a piece's characters in a span marked
// by its source, as each token's text was marked before the page rendered markdown.
function render(container, pieces) {
  const raw = pieces.map(([text]) => text).join("");
  const owners = pieces.flatMap(([text], index) => Array(text.length).fill(index));
  const shown = DOMPurify.sanitize(markdown.parse(raw), RENDERED);
  const texts = [];
  const walker = document.createTreeWalker(shown, NodeFilter.SHOW_TEXT);
  while (walker.nextNode()) texts.push(walker.currentNode);
  const cursor = { at: 0 };
  for (const node of texts) {
    const text = node.data;
    const from = origins(text, node.parentElement?.closest("pre") != null, raw, owners, cursor);
    if (!text.trim()) continue; // between blocks (a table's rows, a list's items) a span would make a box of its own
    const runs = [];
    for (let start = 0, end; start < text.length; start = end) {
      for (end = start + 1; end < text.length && from[end] === from[start];) end++;
      if (from[start] < 0) {
        runs.push(text.slice(start, end));
        continue;
      }
      const span = document.createElement("span");
      span.className = `tok ${pieces[from[start]][1]}`;
      span.textContent = text.slice(start, end);
      runs.push(span);
    }
    node.replaceWith(...runs);
  }
  container.replaceChildren(shown);
}

// An answer as it streams: rendered again at most once a frame, and at once by show() when it ends (so that
// no frame still pending replaces what the page shows after the request).
class Answer {
  constructor(container) { this.container = container; this.pieces = []; this.frame = null; }
  add(text, sources) {
    this.pieces.push(piece(text, sources));
    this.frame ??= requestAnimationFrame(() => this.show());
  }
  show() {
    cancelAnimationFrame(this.frame);
    this.frame = null;
    render(this.container, this.pieces);
  }
  get text() { return this.pieces.map(([text]) => text).join(""); }
}

// "N tokens: D drafted and kept, G forced by the grammar", in words: what the marks say, for every reader.
function summary(pieces) {
  const counts = { drafter: 0, grammar: 0, target: 0 };
  for (const [, source, tokens] of pieces) counts[source] += tokens;
  const total = counts.drafter + counts.grammar + counts.target;
  const parts = ["drafter", "grammar"].filter((source) => counts[source]).map((source) => `${counts[source]} ${SOURCES[source]}`);
  return { counts, text: `${total} tokens${parts.length ? `: ${parts.join(", ")}` : ", all the target's own"}` };
}

function addSummary(container, pieces) {
  const note = document.createElement("p");
  note.className = "summary";
  note.textContent = summary(pieces).text;
  container.after(note);
}

// Timing of one streamed request, as the server paced it.
class Timing {
  constructor() { this.start = performance.now(); this.first = null; this.last = null; this.tokens = 0; }
  token(count) {
    const now = performance.now();
    if (this.first === null) this.first = now;
    this.last = now;
    this.tokens += count;
  }
  get rate() { // over the decode: from the first token to the last
    if (this.first === null || this.last === this.first) return null;
    return (this.tokens - 1) / ((this.last - this.first) / 1000);
  }
  get seconds() { return this.last === null ? null : (this.last - this.start) / 1000; }
  get ttft() { return this.first === null ? null : (this.first - this.start) / 1000; }
}

const fixed = (value, digits) => (value === null || value === undefined ? "–" : value.toFixed(digits));
const percent = (value) => (value === null || value === undefined ? "–" : `${(100 * value).toFixed(0)}%`);

function showLive(timing, usage, pieces) {
  $("live-rate").textContent = fixed(timing.rate, 1);
  const { counts } = summary(pieces);
  $("live-tokens").textContent = String(counts.drafter + counts.grammar + counts.target);
  $("live-kept").textContent = String(counts.drafter + counts.grammar);
  const speculative = usage?.speculative;
  const drafted = speculative && speculative.draft_tokens > 0;
  $("live-acceptance").textContent = drafted ? percent(speculative.acceptance_rate) : "–";
  $("live-length").textContent = drafted ? fixed(speculative.mean_accepted_length, 2) : "–";
  $("live-gamma").textContent = drafted ? fixed(speculative.mean_gamma, 2) : "–";
}

// While a request runs only Stop works; focus follows, so that a keyboard user is never left on nothing.
function busy(running) {
  const focused = document.activeElement;
  const connected = page.model !== null;
  for (const id of ["send", "clear", "settings-fields"]) $(id).disabled = running || !connected;
  $("compare").disabled = running || !connected || page.drafter === "none";
  $("stop").disabled = !running;
  $("connect").hidden = connected;
  if (focused && focused.disabled) $(running ? "stop" : "prompt").focus();
  if (!running && connected) refreshMetrics(); // what the request just did, without waiting for the next poll
}

function conversation(userText) {
  const system = $("system").value.trim();
  return [...(system ? [{ role: "system", content: system }] : []), ...page.messages,
    { role: "user", content: userText }];
}

function saveConversation() {
  sessionStorage.setItem(CONVERSATION, JSON.stringify(page.messages));
}

function restoreConversation() {
  try {
    page.messages = JSON.parse(sessionStorage.getItem(CONVERSATION) || "[]");
  } catch (_) {
    page.messages = [];
  }
  for (const message of page.messages) {
    const body = addMessage(message.role, message.pieces ? "" : message.content);
    if (!message.pieces) continue;
    render(body, message.pieces);
    addSummary(body, message.pieces);
  }
}

// -- actions -------------------------------------------------------------------------------------------------

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || page.running || !page.model) return;
  showError("");
  const messages = conversation(text);
  const sampling = settings();
  addMessage("user", text);
  $("prompt").value = "";
  const reply = addMessage("assistant", "");
  reply.setAttribute("aria-busy", "true");
  const timing = new Timing();
  const answer = new Answer(reply);
  let usage = null;
  page.running = new AbortController();
  busy(true);
  announce("Answering…");
  try {
    await chat(messages, sampling, {
      speculation: $("decoding").value === "speculative",
      signal: page.running.signal,
      onToken: (text, sources) => {
        answer.add(text, sources);
        timing.token(Math.max(sources.length, 1));
        showLive(timing, usage, answer.pieces);
      },
      onUsage: (figures) => { usage = figures; showLive(timing, usage, answer.pieces); },
    });
    announce(`Answered: ${summary(answer.pieces).text}.`);
  } catch (error) {
    if (error.name !== "AbortError") {
      showError(error.message);
      announce(`Failed: ${error.message}`);
      reply.parentElement.remove();
      $("conversation").lastElementChild?.remove(); // the user's message: it was not answered
      $("prompt").value = text;
      return;
    }
    reply.parentElement.querySelector(".who").textContent = "assistant (stopped)";
    announce("Stopped.");
  } finally {
    reply.removeAttribute("aria-busy");
    page.running = null;
    busy(false);
  }
  answer.show();
  addSummary(reply, answer.pieces);
  page.messages.push({ role: "user", content: text },
    { role: "assistant", content: answer.text, pieces: answer.pieces });
  saveConversation();
  $("prompt").focus();
}

// The composer's text (or the last question) decoded speculatively, then plainly, with one seed and the same
// settings: the texts must be equal, and the times say how much faster the drafts made it. Speculative first:
// a drafter that remembers answers (suffix) must not draft from the plain run's. Each run has a cache salt of
// its own, so that neither reads the other's prompt from the prefix cache and both prefill the same.
async function compare() {
  const text = $("prompt").value.trim() ? $("prompt").value : lastQuestion();
  if (!text || page.running) return;
  showError("");
  const sampling = settings();
  sampling.seed = sampling.seed ?? Math.floor(Math.random() * 2 ** 31);
  const messages = conversation(text);
  if (!$("prompt").value.trim()) messages.splice(-3, 2); // the last question is the one asked again
  for (const kind of ["speculative", "plain"]) {
    $(`${kind}-text`).textContent = "";
    $(`${kind}-figures`).textContent = "waiting…";
  }
  $("comparison").hidden = false;
  $("comparison-verdict").textContent = `Decoding with seed ${sampling.seed}…`;
  announce("Comparing…");
  const runs = {};
  page.running = new AbortController();
  busy(true);
  try {
    for (const kind of ["speculative", "plain"]) {
      $(`${kind}-figures`).textContent = "decoding…";
      const timing = new Timing();
      const answer = new Answer($(`${kind}-text`));
      await chat(messages, sampling, {
        speculation: kind === "speculative", cacheSalt: `compare-${kind}-${Math.random()}`,
        signal: page.running.signal,
        onToken: (text, sources) => { answer.add(text, sources); timing.token(Math.max(sources.length, 1)); },
        onUsage: () => {},
      });
      answer.show();
      runs[kind] = { text: answer.text, timing };
      $(`${kind}-figures`).textContent = `${summary(answer.pieces).text} in ${fixed(timing.seconds, 2)} s `
        + `(first after ${fixed(timing.ttft, 2)} s; ${fixed(timing.rate, 1)} tokens/s after it)`;
    }
    const same = runs.plain.text === runs.speculative.text;
    const speedup = runs.speculative.timing.seconds ? runs.plain.timing.seconds / runs.speculative.timing.seconds : null;
    const verdict = (same ? "The same text" : "The texts differ: expected only where the target's verify passes are"
      + " not row-invariant (unquantized bf16 weights, see docs/API.md); anywhere else, please report it")
      + ` with seed ${sampling.seed}; speculative decoding was ${fixed(speedup, 2)}x as fast, end to end.`;
    $("comparison-verdict").textContent = verdict;
    announce(verdict);
  } catch (error) {
    const stopped = error.name === "AbortError";
    $("comparison-verdict").textContent = stopped ? "Stopped." : "Failed.";
    for (const kind of ["speculative", "plain"]) {
      if (!runs[kind]) $(`${kind}-figures`).textContent = stopped ? "stopped" : "not decoded";
    }
    announce(stopped ? "Stopped." : `Failed: ${error.message}`);
    if (!stopped) showError(error.message);
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
    if (!match) continue;
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

// Read /metrics now. Where metrics live on their own port the server says so (404), the panel passes that
// on and polling ends; any other failure shows its reason, and the next poll comes later.
const metrics = { elsewhere: false, failed: false };

async function refreshMetrics() {
  if (metrics.elsewhere) return;
  try {
    const response = await api("metrics");
    showMetrics(parseMetrics(await response.text()));
    $("metrics-note").textContent = "From /metrics, every few seconds.";
    $("metrics-figures").hidden = false;
    metrics.failed = false;
  } catch (error) {
    metrics.elsewhere = /own port/.test(error.message);
    metrics.failed = true;
    $("metrics-note").textContent = `The server's metrics are not readable here: ${error.message}.`;
    $("metrics-figures").hidden = true;
    $("m-positions").hidden = true;
  }
}

async function pollMetrics() {
  if (document.visibilityState === "visible" && !page.keyPrompt) await refreshMetrics();
  if (!metrics.elsewhere) setTimeout(pollMetrics, metrics.failed ? METRICS_BACKOFF_MS : METRICS_EVERY_MS);
}

// -- start -----------------------------------------------------------------------------------------------------

async function connect() {
  busy(false);
  showError("");
  try {
    const health = await fetch("health").then((response) => response.json()).catch(() => ({}));
    if (health.status && health.status !== "ready") {
      $("server-line").textContent = `The server is ${health.status}; choose Connect when it is ready.`;
      if (health.error) showError(health.error);
      return;
    }
    const models = await (await api("v1/models")).json();
    const model = models.data[0];
    page.drafter = model.drafter || "none";
    page.model = model.id;
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

function start() {
  $("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => page.running?.abort());
  $("compare").addEventListener("click", compare);
  $("clear").addEventListener("click", () => {
    page.messages = [];
    saveConversation();
    $("conversation").replaceChildren();
    announce("Conversation cleared.");
  });
  $("connect").addEventListener("click", connect);
  $("key-cancel").addEventListener("click", () => $("key-dialog").close());
  restoreConversation();
  connect();
}

start();
