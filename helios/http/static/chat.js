// Helios chat page (GET /ui): conversations kept in this browser's localStorage, answers streamed
// from POST /v1/chat/completions (SSE, stream_options.include_usage), tokens/s and cached prompt
// tokens shown under each answer. Hand-written, no build step, no external assets.
"use strict";
(function () {
  const STORE = "helios.ui.conversations";
  const ACTIVE = "helios.ui.active";
  const SETTINGS = "helios.ui.settings";
  const KEY = "helios.ui.apiKey"; // sessionStorage: the key lives as long as the tab

  const $ = (id) => document.getElementById(id);
  const els = {
    list: $("conversations"), messages: $("messages"), prompt: $("prompt"), composer: $("composer"),
    send: $("send"), stop: $("stop"), status: $("status"), model: $("model"), apiKey: $("api-key"),
    maxTokens: $("max-tokens"), temperature: $("temperature"), newChat: $("new-chat"),
  };

  let conversations = load(localStorage, STORE, []);
  let activeId = localStorage.getItem(ACTIVE);
  let controller = null; // the AbortController of the stream in flight
  let serverModel = "";

  function load(storage, key, fallback) {
    try {
      const v = JSON.parse(storage.getItem(key));
      return v === null ? fallback : v;
    } catch (e) {
      return fallback;
    }
  }

  function save() {
    localStorage.setItem(STORE, JSON.stringify(conversations));
    if (activeId) localStorage.setItem(ACTIVE, activeId);
  }

  function saveSettings() {
    localStorage.setItem(SETTINGS, JSON.stringify({ model: els.model.value, maxTokens: els.maxTokens.value,
                                                   temperature: els.temperature.value }));
    sessionStorage.setItem(KEY, els.apiKey.value);
  }

  function active() {
    return conversations.find((c) => c.id === activeId) || null;
  }

  function newConversation() {
    const c = { id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 8), title: "New conversation",
                messages: [], created: Date.now() };
    conversations.unshift(c);
    activeId = c.id;
    save();
    render();
    els.prompt.focus();
    return c;
  }

  function select(id) {
    if (controller) return; // finish or stop the answer in flight first
    activeId = id;
    save();
    render();
  }

  function remove(id) {
    if (controller && id === activeId) return;
    conversations = conversations.filter((c) => c.id !== id);
    if (activeId === id) activeId = conversations.length ? conversations[0].id : null;
    if (!activeId) localStorage.removeItem(ACTIVE);
    save();
    render();
  }

  // -- rendering ------------------------------------------------------------------------------
  function renderList() {
    els.list.replaceChildren();
    for (const c of conversations) {
      const li = document.createElement("li");
      li.dataset.id = c.id;
      if (c.id === activeId) li.classList.add("active");
      const pick = document.createElement("button");
      pick.type = "button";
      pick.className = "pick";
      pick.textContent = c.title;
      pick.title = c.title;
      pick.addEventListener("click", () => select(c.id));
      const del = document.createElement("button");
      del.type = "button";
      del.className = "delete";
      del.textContent = "×";
      del.title = "Delete";
      del.addEventListener("click", () => remove(c.id));
      li.append(pick, del);
      els.list.append(li);
    }
  }

  function messageElement(m) {
    const div = document.createElement("div");
    div.className = "message " + m.role + (m.state === "error" ? " error" : "");
    div.dataset.role = m.role;
    div.dataset.state = m.state || "done";
    const role = document.createElement("div");
    role.className = "role";
    role.textContent = m.role;
    const reasoning = document.createElement("div");
    reasoning.className = "reasoning";
    reasoning.textContent = m.reasoning || "";
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = m.content;
    const stats = document.createElement("div");
    stats.className = "stats";
    div.append(role, reasoning, content, stats);
    showStats(stats, m.stats);
    return div;
  }

  function showStats(el, s) {
    if (!s) {
      el.textContent = "";
      return;
    }
    for (const [k, v] of Object.entries(s)) el.dataset[k] = String(v);
    const parts = [];
    if (s.completionTokens !== undefined) parts.push(s.completionTokens + " tokens");
    if (s.tokensPerSecond !== undefined) parts.push(s.tokensPerSecond.toFixed(1) + " tok/s");
    if (s.ttftSeconds !== undefined) parts.push("first token " + s.ttftSeconds.toFixed(2) + " s");
    if (s.promptTokens !== undefined) parts.push("prompt " + s.promptTokens + " tokens, " + s.cachedTokens + " cached");
    if (s.finishReason) parts.push("finish: " + s.finishReason);
    el.textContent = parts.join(" · ");
  }

  function render() {
    renderList();
    els.messages.replaceChildren();
    const c = active();
    if (c) for (const m of c.messages) els.messages.append(messageElement(m));
    els.messages.scrollTop = els.messages.scrollHeight;
    const busy = controller !== null;
    els.send.disabled = busy;
    els.stop.disabled = !busy;
  }

  // -- streaming ------------------------------------------------------------------------------
  function headers() {
    const h = { "content-type": "application/json" };
    if (els.apiKey.value) h.authorization = "Bearer " + els.apiKey.value;
    return h;
  }

  async function errorText(res) {
    const text = await res.text();
    try {
      const body = JSON.parse(text);
      if (body && body.error && body.error.message) return "HTTP " + res.status + ": " + body.error.message;
    } catch (e) { /* not JSON */ }
    return "HTTP " + res.status + (text ? ": " + text.slice(0, 300) : "");
  }

  // Reads an SSE body, calling onData with each event's data (its data lines joined by "\n").
  async function readEvents(body, onData) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
      const events = buffer.split(/\r\n\r\n|\n\n|\r\r/);
      buffer = done ? "" : events.pop();
      for (const event of events) {
        const data = [];
        for (const line of event.split(/\r\n|\n|\r/)) {
          if (line.startsWith("data:")) data.push(line.slice(line[5] === " " ? 6 : 5));
        }
        if (data.length && onData(data.join("\n")) === false) return;
      }
      if (done) return;
    }
  }

  async function send(text) {
    if (controller || !text.trim()) return;
    const c = active() || newConversation();
    if (!c.messages.length) c.title = text.trim().split("\n")[0].slice(0, 60);
    c.messages.push({ role: "user", content: text });
    const history = c.messages.map((m) => ({ role: m.role, content: m.content }));
    const answer = { role: "assistant", content: "", reasoning: "", state: "streaming" };
    c.messages.push(answer);
    save();
    controller = new AbortController();
    render();
    const el = els.messages.lastElementChild;
    const contentEl = el.querySelector(".content");
    const reasoningEl = el.querySelector(".reasoning");
    const statsEl = el.querySelector(".stats");
    const body = { model: els.model.value || serverModel || "default", messages: history, stream: true,
                   stream_options: { include_usage: true } };
    const maxTokens = parseInt(els.maxTokens.value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const temperature = parseFloat(els.temperature.value);
    if (els.temperature.value !== "" && temperature >= 0) body.temperature = temperature;
    const started = performance.now();
    let first = null;
    let last = null;
    let usage = null;
    let finish = null;
    let chunks = 0;
    els.status.textContent = "waiting for the first token…";
    try {
      const res = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                       signal: controller.signal });
      if (!res.ok) throw new Error(await errorText(res));
      await readEvents(res.body, (data) => {
        if (data === "[DONE]") return false;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "stream error");
        chunks += 1;
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          const piece = (delta.content || "") + (delta.reasoning_content || "");
          if (piece) {
            const now = performance.now();
            if (first === null) first = now;
            last = now;
          }
          if (delta.reasoning_content) answer.reasoning += delta.reasoning_content;
          if (delta.content) answer.content += delta.content;
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        contentEl.textContent = answer.content;
        reasoningEl.textContent = answer.reasoning;
        els.messages.scrollTop = els.messages.scrollHeight;
        if (first !== null) els.status.textContent = "streaming… " + chunks + " chunks";
        return true;
      });
      answer.state = "done";
    } catch (e) {
      if (e.name === "AbortError") {
        answer.state = "stopped";
      } else {
        answer.state = "error";
        answer.content += (answer.content ? "\n" : "") + String(e.message || e);
      }
    }
    const ended = performance.now();
    answer.stats = statsOf(usage, started, first, last, ended, finish, chunks);
    if (answer.state === "error" && !answer.stats.completionTokens) delete answer.stats;
    controller = null;
    els.status.textContent = answer.state === "done" ? "" : answer.state;
    save();
    render();
  }

  // tokens/s: completion tokens per second from the first streamed token to the end of the stream
  // (decode speed); when everything came at once, over the whole request.
  function statsOf(usage, started, first, last, ended, finish, chunks) {
    const s = { chunks: chunks, elapsedSeconds: (ended - started) / 1000 };
    if (first !== null) s.ttftSeconds = (first - started) / 1000;
    if (finish) s.finishReason = finish;
    if (usage) {
      s.completionTokens = usage.completion_tokens;
      s.promptTokens = usage.prompt_tokens;
      s.cachedTokens = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
      const decode = first !== null && usage.completion_tokens > 1 ? (ended - first) / 1000 : 0;
      const seconds = decode > 0.001 ? decode : (ended - started) / 1000;
      const tokens = decode > 0.001 ? usage.completion_tokens - 1 : usage.completion_tokens;
      s.tokensPerSecond = seconds > 0 ? tokens / seconds : 0;
    }
    return s;
  }

  async function discoverModel() {
    try {
      const res = await fetch("/v1/models", { headers: headers() });
      if (!res.ok) return;
      const body = await res.json();
      if (body.data && body.data.length) {
        serverModel = body.data[0].id;
        els.model.placeholder = serverModel;
      }
    } catch (e) { /* the server will say so on send */ }
  }

  // -- wiring ---------------------------------------------------------------------------------
  const settings = load(localStorage, SETTINGS, {});
  if (settings.model) els.model.value = settings.model;
  if (settings.maxTokens) els.maxTokens.value = settings.maxTokens;
  if (settings.temperature) els.temperature.value = settings.temperature;
  els.apiKey.value = sessionStorage.getItem(KEY) || "";
  for (const input of [els.model, els.apiKey, els.maxTokens, els.temperature]) input.addEventListener("change", saveSettings);
  els.apiKey.addEventListener("change", discoverModel);
  els.newChat.addEventListener("click", () => { if (!controller) newConversation(); });
  els.stop.addEventListener("click", () => { if (controller) controller.abort(); });
  els.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    const text = els.prompt.value;
    els.prompt.value = "";
    send(text);
  });
  els.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      els.composer.requestSubmit();
    }
  });
  if (!active()) activeId = conversations.length ? conversations[0].id : null;
  render();
  discoverModel();
  document.body.dataset.ready = "1";
})();
