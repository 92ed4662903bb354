// The chat page: streams answers from this server's /v1/chat/completions with the `eagle` extension
// (docs/serve.md) and shows where each token came from, the speed, tau and the tree in use.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], model: null, controller: null, last: null };

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !state.messages.some((m) => m.role === "assistant");
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

function bubble(role, label) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = label;
  div.append(who);
  $("chat").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// One streamed answer: tokens, cycles and the times of the first and the latest token.
class Answer {
  constructor(div) {
    Object.assign(this, { div, text: "", tokens: 0, cycles: 0, tree: "", first: null, latest: null });
  }
  add(delta, eagle) {
    const now = performance.now();
    if (eagle) {
      for (const c of eagle.cycles) this.tokens += c.source.length;
      this.cycles += eagle.cycles.length;
      this.tree = eagle.tree || this.tree;
      if (eagle.cycles.length) {
        this.first = this.first ?? now;
        this.latest = now;
      }
    }
    if (!delta) return;
    this.text += delta;
    const spans = eagle ? eagle.spans : [{ text: delta, source: "target", cycle: 0 }];
    for (const s of spans) {
      const span = document.createElement("span");
      span.className = `tok src-${s.source} c${s.cycle % 2}`;
      span.dataset.source = s.source;
      span.dataset.cycle = s.cycle;
      span.textContent = s.text;
      this.div.append(span);
    }
  }
  // decode speed: the tokens after the first over the time since it came (null until there are two)
  get speed() {
    const seconds = (this.latest - this.first) / 1000;
    return this.tokens > 1 && seconds > 0 ? (this.tokens - 1) / seconds : null;
  }
  get tau() { return this.cycles ? this.tokens / this.cycles : null; }
}

const fixed = (x, digits) => (x === null ? "–" : x.toFixed(digits));

function showStats(answer) {
  $("tps").textContent = fixed(answer.speed, 1);
  $("tau").textContent = fixed(answer.tau, 2);
  $("tree").textContent = answer.tree || "–";
}

function settings() {
  const body = { temperature: Number($("temperature").value), top_p: Number($("top-p").value) };
  const max = $("max-tokens").value.trim();
  if (max !== "") body.max_tokens = Number(max);
  return body;
}

// POST a streamed chat completion and feed each chunk to `answer`; throws an Error with the server's message.
async function stream(messages, speculate, answer, signal) {
  const body = { model: state.model, messages, stream: true, eagle: { trace: true, speculate }, ...settings() };
  const response = await fetch("v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
  });
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).error.message; } catch (e) { /* not JSON: keep the status text */ }
    throw new Error(`${response.status}: ${message}`);
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(`${chunk.error.type}: ${chunk.error.message}`);
      const delta = chunk.choices.length ? chunk.choices[0].delta.content || "" : "";
      answer.add(delta, chunk.eagle);
      showStats(answer);
    }
  }
}

async function answer(messages) {
  showError("");
  $("versus").hidden = true;
  state.controller = new AbortController();
  setBusy(true);
  const spec = new Answer(bubble("assistant", "speculative"));
  spec.div.dataset.state = "streaming";
  try {
    await stream(messages, true, spec, state.controller.signal);
    spec.div.dataset.state = "done";
    state.messages.push({ role: "assistant", content: spec.text });
    if ($("compare").checked) await compare(messages, spec);
  } catch (e) {
    const stopped = e.name === "AbortError";
    spec.div.dataset.state = stopped ? "stopped" : "error";
    if (!stopped) showError(e instanceof TypeError ? `the server cannot be reached (${e.message})` : e.message);
    if (spec.text) state.messages.push({ role: "assistant", content: spec.text });
  } finally {
    state.controller = null;
    setBusy(false);
    $("prompt").focus();
  }
}

// The same messages answered plainly, the two speeds side by side (greedy: the same text).
async function compare(messages, spec) {
  const plain = new Answer(bubble("assistant plain", "without speculation"));
  plain.div.dataset.state = "streaming";
  await stream(messages, false, plain, state.controller.signal);
  plain.div.dataset.state = "done";
  showStats(spec);
  $("plain-tps").textContent = fixed(plain.speed, 1);
  $("speedup").textContent = spec.speed && plain.speed ? `${(spec.speed / plain.speed).toFixed(2)}x` : "–";
  const greedy = Number($("temperature").value) === 0;
  $("identical").textContent = spec.text === plain.text ? "identical text" : greedy ? "texts differ" : "texts differ (sampled)";
  $("versus").hidden = false;
}

function send() {
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  state.messages.push({ role: "user", content: text });
  bubble("user", "you").append(text);
  answer(state.messages.slice());
}

function regenerate() {
  if (state.controller) return;
  while (state.messages.length && state.messages.at(-1).role === "assistant") state.messages.pop();
  const chat = $("chat");
  while (chat.lastElementChild && chat.lastElementChild.classList.contains("assistant")) chat.lastElementChild.remove();
  if (state.messages.length) answer(state.messages.slice());
}

function stop() {
  if (state.controller) state.controller.abort();
}

function clear() {
  stop();
  state.messages = [];
  $("chat").replaceChildren();
  showError("");
  for (const id of ["tps", "tau", "tree"]) $(id).textContent = "–";
  $("versus").hidden = true;
  setBusy(false);
}

async function health() {
  try {
    const models = await (await fetch("v1/models")).json();
    state.model = models.data[0].id;
    $("model").textContent = state.model;
    const r = await fetch("health");
    const h = await r.json();
    $("health").textContent = r.ok ? `${h.running_rows} rows running, ${h.queued_rows} waiting` : `${r.status}: ${h.error.message}`;
  } catch (e) {
    $("health").textContent = "the server cannot be reached";
  }
}

$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
document.addEventListener("keydown", (e) => { if (e.key === "Escape") stop(); });
$("stop").addEventListener("click", stop);
$("regenerate").addEventListener("click", regenerate);
$("clear").addEventListener("click", clear);
health();
setInterval(health, 5000);
$("prompt").focus();
