// The chat page: conversations kept in localStorage, answers streamed from
// /v1/chat/completions (SSE read through fetch), a stop button that aborts the request (the
// server sees the disconnect and frees the request), reasoning shown apart, tokens/s per answer.
"use strict";

(() => {
  const STORE = "kiln.conversations";
  const CURRENT = "kiln.current";
  const SETTINGS = "kiln.settings";
  const DEFAULTS = { system: "You are a helpful assistant.", temperature: 0.7, top_p: 1,
                     max_tokens: 512, model: "" };
  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------ state in localStorage

  function load(item, fallback) {
    try {
      const v = JSON.parse(localStorage.getItem(item));
      return v === null ? fallback : v;
    } catch (_) {
      return fallback;
    }
  }

  let conversations = load(STORE, []);
  let currentId = localStorage.getItem(CURRENT);
  let settings = Object.assign({}, DEFAULTS, load(SETTINGS, {}));
  let streaming = null; // {conv, reply, controller} while an answer streams

  function save() {
    try {
      localStorage.setItem(STORE, JSON.stringify(conversations));
      if (currentId) localStorage.setItem(CURRENT, currentId);
      else localStorage.removeItem(CURRENT);
    } catch (e) {
      status("Could not save the conversations in this browser: " + e.message);
    }
  }

  function saveSettings() {
    localStorage.setItem(SETTINGS, JSON.stringify(settings));
  }

  function current() {
    return conversations.find((c) => c.id === currentId) || null;
  }

  function newConversation() {
    const conv = { id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6),
                   title: "New chat", updated: Date.now(), messages: [] };
    conversations.unshift(conv);
    currentId = conv.id;
    save();
    return conv;
  }

  function status(text) {
    $("status").textContent = text || "";
  }

  // ------------------------------------------------------------------ rendering

  function renderList() {
    const ul = $("conversations");
    ul.textContent = "";
    conversations.sort((a, b) => b.updated - a.updated);
    for (const c of conversations) {
      const li = document.createElement("li");
      li.dataset.id = c.id;
      if (c.id === currentId) li.className = "active";
      const title = document.createElement("span");
      title.className = "title";
      title.textContent = c.title;
      const del = document.createElement("button");
      del.type = "button";
      del.className = "delete";
      del.title = "Delete this conversation";
      del.textContent = "\u00d7";
      li.append(title, del);
      ul.appendChild(li);
    }
  }

  function messageElement(m) {
    const div = document.createElement("div");
    div.className = "msg " + m.role;
    const head = document.createElement("div");
    head.className = "msg-head";
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = m.role === "assistant" ? "assistant" + (m.model ? " \u00b7 " + m.model : "")
      : m.role;
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy-msg";
    copy.textContent = "Copy";
    head.append(who, copy);
    div.appendChild(head);
    if (m.role === "assistant") {
      const details = document.createElement("details");
      details.className = "reasoning";
      details.innerHTML = '<summary>Reasoning</summary><div class="reasoning-body md"></div>';
      div.appendChild(details);
    }
    const content = document.createElement("div");
    content.className = m.role === "assistant" ? "content md" : "content plain";
    div.appendChild(content);
    const stats = document.createElement("div");
    stats.className = "stats";
    div.appendChild(stats);
    fillMessage(div, m);
    return div;
  }

  // (Re)draws one message's parts from its record.
  function fillMessage(div, m) {
    div.dataset.state = m.state || "done";
    const content = div.querySelector(".content");
    if (m.role === "assistant") {
      content.innerHTML = Markdown.render(m.content);
      const details = div.querySelector(".reasoning");
      details.hidden = !m.reasoning;
      if (m.reasoning) {
        details.querySelector(".reasoning-body").innerHTML = Markdown.render(m.reasoning);
        details.querySelector("summary").textContent =
          m.state === "streaming" && !m.content ? "Reasoning\u2026" : "Reasoning";
      }
    } else {
      content.textContent = m.content;
    }
    let line = "";
    if (m.stats) line = statsLine(m.stats, m.state);
    else if (m.state === "streaming") line = "\u2026";
    if (m.error) line = (line ? line + " \u00b7 " : "") + "error: " + m.error;
    div.querySelector(".stats").textContent = line;
    div.classList.toggle("failed", m.state === "error");
  }

  function statsLine(s, state) {
    const parts = [(s.counted ? "\u2248" : "") + s.tokens + " tokens"];
    if (s.tps !== null) parts.push(s.tps.toFixed(1) + " tok/s");
    if (s.ttft !== null) parts.push("first token " + s.ttft.toFixed(2) + " s");
    if (state === "stopped") parts.push("stopped");
    else if (s.finish) parts.push(s.finish === "length" ? "cut at max_tokens" : s.finish);
    return parts.join(" \u00b7 ");
  }

  function renderConversation() {
    const box = $("messages");
    box.textContent = "";
    const conv = current();
    const msgs = conv ? conv.messages : [];
    for (const m of msgs) box.appendChild(messageElement(m));
    $("empty").hidden = msgs.length > 0;
    box.scrollTop = box.scrollHeight;
    renderList();
  }

  // Redraw the streaming answer at most every 50 ms (a long answer re-renders its markdown).
  let redrawTimer = null;
  function scheduleRedraw() {
    if (redrawTimer !== null) return;
    redrawTimer = setTimeout(() => {
      redrawTimer = null;
      redrawStreaming();
    }, 50);
  }

  function redrawStreaming() {
    if (!streaming || streaming.conv.id !== currentId) return;
    const box = $("messages");
    const last = box.lastElementChild;
    if (!last) return;
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    fillMessage(last, streaming.reply);
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  // ------------------------------------------------------------------ the API

  // The data of each server-sent event, as the body arrives.
  async function* sseData(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, end);
        buf = buf.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  }

  async function loadModels() {
    const select = $("model");
    try {
      const list = await KilnAPI.getJSON("/v1/models");
      select.textContent = "";
      for (const m of list.data || []) {
        const opt = document.createElement("option");
        opt.value = m.id;
        opt.textContent = m.id;
        select.appendChild(opt);
      }
      const ids = (list.data || []).map((m) => m.id);
      if (!ids.includes(settings.model)) settings.model = ids[0] || "";
      select.value = settings.model;
      status("");
    } catch (e) {
      status("Could not list the models: " + e.message);
    }
  }

  function requestBody(conv) {
    const history = conv.messages.slice(0, -1)
      .filter((m) => m.role === "user" || (m.role === "assistant" && m.content))
      .map((m) => ({ role: m.role, content: m.content }));
    const messages = settings.system.trim()
      ? [{ role: "system", content: settings.system }, ...history] : history;
    const body = { model: settings.model || undefined, messages, stream: true,
                   stream_options: { include_usage: true } };
    for (const k of ["temperature", "top_p", "max_tokens"]) {
      const v = Number(settings[k]);
      if (settings[k] !== "" && Number.isFinite(v)) body[k] = v;
    }
    return body;
  }

  async function send(text) {
    if (streaming) return;
    const conv = current() || newConversation();
    conv.messages.push({ role: "user", content: text });
    if (conv.title === "New chat") conv.title = text.replace(/\s+/g, " ").slice(0, 48);
    const reply = { role: "assistant", content: "", reasoning: "", model: settings.model,
                    state: "streaming" };
    conv.messages.push(reply);
    conv.updated = Date.now();
    save();
    renderConversation();

    const controller = new AbortController();
    streaming = { conv, reply, controller };
    setBusy(true);
    const body = JSON.stringify(requestBody(conv));
    const t0 = performance.now();
    let tFirst = null;
    let chunks = 0;
    let usage = null;
    let finish = null;
    try {
      const post = () => fetch("/v1/chat/completions", {
        method: "POST", body, signal: controller.signal,
        headers: KilnAPI.headers({ "Content-Type": "application/json" }) });
      let r = await post();
      if (r.status === 401 && (await KilnAPI.askKey(true))) r = await post();
      if (!r.ok) throw await KilnAPI.errorOf(r);
      for await (const data of sseData(r)) {
        if (data === "[DONE]") break;
        const ev = JSON.parse(data);
        if (ev.error) throw new Error(ev.error.message || "error from the server");
        if (ev.usage) usage = ev.usage;
        for (const c of ev.choices || []) {
          const d = c.delta || {};
          if (d.reasoning_content) reply.reasoning += d.reasoning_content;
          if (d.content) reply.content += d.content;
          if (d.content || d.reasoning_content) {
            chunks++;
            if (tFirst === null) tFirst = performance.now();
          }
          if (c.finish_reason) finish = c.finish_reason;
        }
        scheduleRedraw();
      }
      reply.state = "done";
    } catch (e) {
      if (e.name === "AbortError") reply.state = "stopped";
      else {
        reply.state = "error";
        reply.error = e.message;
      }
    } finally {
      const tEnd = performance.now();
      // The stream's usage counts tokens; without it (stopped) each content chunk is about one.
      const tokens = usage ? usage.completion_tokens : chunks;
      const decode = tFirst === null ? 0 : (tEnd - tFirst) / 1000;
      reply.stats = {
        tokens, counted: !usage, finish,
        // after the first token: the decoding rate (the first one waits for the prefill)
        tps: tokens > 1 && decode > 0 ? (tokens - 1) / decode : null,
        ttft: tFirst === null ? null : (tFirst - t0) / 1000,
      };
      conv.updated = Date.now();
      streaming = null;
      setBusy(false);
      save();
      if (conv.id === currentId) {
        const last = $("messages").lastElementChild;
        if (last) fillMessage(last, reply);
      }
    }
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    document.body.classList.toggle("busy", busy);
  }

  // ------------------------------------------------------------------ wiring

  function bindSettings() {
    const fields = ["system", "temperature", "top_p", "max_tokens"];
    for (const k of fields) {
      const el = $(k);
      el.value = settings[k];
      el.addEventListener("input", () => {
        settings[k] = el.value;
        saveSettings();
      });
    }
    $("reset-settings").addEventListener("click", () => {
      settings = Object.assign({}, DEFAULTS, { model: settings.model });
      for (const k of fields) $(k).value = settings[k];
      saveSettings();
    });
    $("toggle-settings").addEventListener("click", (e) => {
      const panel = $("settings");
      panel.hidden = !panel.hidden;
      e.target.setAttribute("aria-expanded", String(!panel.hidden));
    });
    $("model").addEventListener("change", (e) => {
      settings.model = e.target.value;
      saveSettings();
    });
    $("set-key").addEventListener("click", async () => {
      if (await KilnAPI.askKey(false)) loadModels();
    });
  }

  function bindChat() {
    const prompt = $("prompt");
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = prompt.value.trim();
      if (!text || streaming) return;
      prompt.value = "";
      send(text);
    });
    prompt.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => {
      if (streaming) streaming.controller.abort();
    });
    $("new-chat").addEventListener("click", () => {
      const conv = current();
      if (!conv || conv.messages.length) newConversation();
      renderConversation();
      prompt.focus();
    });
    $("conversations").addEventListener("click", (e) => {
      const li = e.target.closest("li");
      if (!li) return;
      if (e.target.classList.contains("delete")) {
        if (streaming && streaming.conv.id === li.dataset.id) streaming.controller.abort();
        conversations = conversations.filter((c) => c.id !== li.dataset.id);
        if (currentId === li.dataset.id) {
          currentId = conversations.length ? conversations[0].id : null;
        }
      } else {
        currentId = li.dataset.id;
      }
      save();
      renderConversation();
    });
    $("messages").addEventListener("click", (e) => {
      const button = e.target.closest("button");
      if (!button) return;
      if (button.classList.contains("copy-code")) {
        KilnAPI.copyFrom(button, button.closest(".code-block").querySelector("code").textContent);
      } else if (button.classList.contains("copy-msg")) {
        const conv = current();
        const index = Array.from($("messages").children).indexOf(button.closest(".msg"));
        if (conv && conv.messages[index]) KilnAPI.copyFrom(button, conv.messages[index].content);
      }
    });
  }

  // A page closed mid-answer keeps what had arrived, marked as stopped.
  for (const c of conversations) {
    for (const m of c.messages) if (m.state === "streaming") m.state = "stopped";
  }
  bindSettings();
  bindChat();
  renderConversation();
  loadModels();
})();
