// shardwire web page: chat over /v1/chat/completions and the live cluster view.
// Plain ES2020, no build step. Text from the server or the user only reaches the page through
// textContent; the one innerHTML is the assistant's markdown after DOMPurify.
"use strict";

(() => {
  const STORE = {
    apiKey: "shardwire.apiKey",
    conversations: "shardwire.conversations",
    settings: "shardwire.settings",
  };
  const NUMERIC_SETTINGS = {
    temperature: "number",
    top_p: "number",
    top_k: "integer",
    min_p: "number",
    max_tokens: "integer",
    seed: "integer",
  };
  const ROLES = new Set(["system", "user", "assistant", "tool"]);
  const WORKER_STATES = new Set(["healthy", "recovering", "lost", "rejoined", "idle"]);
  const RECONNECT_MS = 1000;
  const DASH = "—";
  const SVG_NS = "http://www.w3.org/2000/svg";
  // A reply's raw HTML is shown as text (configureMarkdown); behind that, DOMPurify keeps it from
  // restyling the page, drawing forms or loading media. Its markdown images load only from data:
  // URLs, as an image's URL could carry the conversation to another host.
  const SANITIZE = {
    FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "audio", "video", "source", "picture"],
    FORBID_ATTR: ["style", "srcset"],
  };

  const byTestId = (id) => document.querySelector(`[data-testid="${id}"]`);
  const ui = {
    modelId: byTestId("model-id"),
    tabs: Array.from(document.querySelectorAll('[role="tab"]')),
    chatView: byTestId("chat-view"),
    clusterView: byTestId("cluster-view"),
    errorBar: byTestId("error-bar"),
    error: byTestId("error"),
    errorDismiss: byTestId("error-dismiss"),
    newChat: byTestId("new-chat"),
    exportButton: byTestId("export"),
    importButton: byTestId("import"),
    importFile: byTestId("import-file"),
    conversations: byTestId("conversations"),
    messages: byTestId("messages"),
    composer: byTestId("composer"),
    prompt: byTestId("prompt"),
    send: byTestId("send"),
    settingInputs: Array.from(document.querySelectorAll("[data-setting]")),
    connection: byTestId("cluster-connection"),
    summary: byTestId("cluster-summary"),
    ringBox: byTestId("ring-box"),
    workers: byTestId("workers"),
    recoveries: byTestId("recoveries"),
    keyDialog: byTestId("api-key-dialog"),
    keyForm: document.querySelector(".api-key-form"),
    keyInput: byTestId("api-key-input"),
    keyNote: byTestId("api-key-note"),
    keyCancel: byTestId("api-key-cancel"),
  };

  // ---------------------------------------------------------------- small helpers

  /** An element: props "text", "class", "testid", "onX" (listener), others as attributes. */
  function h(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    setProps(node, props);
    node.append(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
    return node;
  }

  function button(label, testid, onclick, props = {}) {
    return h("button", { type: "button", testid, onclick, ...props }, label);
  }

  function svg(tag, props = {}, ...children) {
    const node = document.createElementNS(SVG_NS, tag);
    setProps(node, props);
    node.append(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
    return node;
  }

  function setProps(node, props) {
    for (const [key, value] of Object.entries(props)) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "text") node.textContent = value;
      else if (key === "testid") node.setAttribute("data-testid", value);
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
  }

  const isNumber = (x) => typeof x === "number" && Number.isFinite(x);
  const isObject = (x) => x !== null && typeof x === "object" && !Array.isArray(x);
  const asArray = (x) => (Array.isArray(x) ? x : []);
  const firstNumber = (...xs) => {
    const found = xs.find(isNumber);
    return found === undefined ? null : found;
  };
  const format = (x, digits = 0, unit = "") => (isNumber(x) ? `${x.toFixed(digits)}${unit}` : DASH);
  const text = (x) => (x === null || x === undefined || x === "" ? DASH : String(x));

  function formatBytes(bytes) {
    if (!isNumber(bytes)) return DASH;
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let value = bytes;
    let unit = 0;
    while (Math.abs(value) >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return unit === 0 ? `${value} B` : `${value.toFixed(1)} ${units[unit]}`;
  }

  function newId() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
  }

  function readStored(key, fallback) {
    try {
      const raw = localStorage.getItem(key);
      return raw ? JSON.parse(raw) : fallback;
    } catch (error) {
      return fallback;
    }
  }

  function writeStored(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
    } catch (error) {
      showError(`Could not save in this browser's storage: ${error.message}`);
    }
  }

  function showError(message) {
    ui.error.textContent = message;
    ui.errorBar.hidden = false;
  }

  function clearError() {
    ui.error.textContent = "";
    ui.errorBar.hidden = true;
  }

  // ---------------------------------------------------------------- API and the API key

  class ApiError extends Error {
    constructor(message, status = 0) {
      super(message);
      this.status = status;
    }
  }

  const retriesAfterKey = new Set(); // what to run again once an API key is saved

  function authorization() {
    const key = localStorage.getItem(STORE.apiKey);
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  /** fetch with the API key; a 401 asks for a key (then runs `retry`), other errors throw. */
  async function api(path, init = {}, retry = null) {
    const response = await fetch(path, { ...init, headers: { ...authorization(), ...init.headers } });
    if (response.status === 401) {
      askForApiKey(retry);
      throw new ApiError(await errorMessageOf(response), 401);
    }
    if (!response.ok) throw new ApiError(await errorMessageOf(response), response.status);
    return response;
  }

  async function errorMessageOf(response) {
    const body = await response.text().catch(() => "");
    try {
      const parsed = JSON.parse(body);
      const message = isObject(parsed.error) ? parsed.error.message : parsed.error || parsed.message;
      if (message) return String(message);
    } catch (error) {
      // not JSON: described below
    }
    const detail = body.trim() ? `: ${body.trim().slice(0, 300)}` : "";
    return `HTTP ${response.status} ${response.statusText}`.trim() + detail;
  }

  function askForApiKey(retry) {
    if (retry) retriesAfterKey.add(retry);
    if (ui.keyDialog.open) return;
    ui.keyNote.textContent = localStorage.getItem(STORE.apiKey)
      ? "The server refused the saved API key. Enter another; it is kept in this browser only."
      : "The server asks for an API key. It is kept in this browser only.";
    ui.keyInput.value = "";
    if (typeof ui.keyDialog.showModal === "function") ui.keyDialog.showModal();
    else ui.keyDialog.setAttribute("open", "");
    ui.keyInput.focus();
  }

  function saveApiKey(event) {
    event.preventDefault();
    const key = ui.keyInput.value.trim();
    if (!key) return;
    localStorage.setItem(STORE.apiKey, key);
    const retries = Array.from(retriesAfterKey);
    retriesAfterKey.clear();
    ui.keyDialog.close();
    for (const retry of retries) retry();
  }

  /** Yields {event, data} for each server-sent event of a fetch response's body. */
  async function* readEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let event = "";
    let data = [];
    try {
      for (;;) {
        const { value, done } = await reader.read();
        buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
        const lines = buffer.split("\n");
        buffer = done ? "" : lines.pop();
        if (done) lines.push(""); // the last event may lack its blank line
        for (const raw of lines) {
          const line = raw.endsWith("\r") ? raw.slice(0, -1) : raw;
          if (line === "") {
            if (data.length) yield { event: event || "message", data: data.join("\n") };
            event = "";
            data = [];
          } else if (!line.startsWith(":")) {
            const colon = line.indexOf(":");
            const field = colon < 0 ? line : line.slice(0, colon);
            let value = colon < 0 ? "" : line.slice(colon + 1);
            if (value.startsWith(" ")) value = value.slice(1);
            if (field === "event") event = value;
            else if (field === "data") data.push(value);
          }
        }
        if (done) return;
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  async function loadModel() {
    try {
      const response = await api("/v1/models", {}, loadModel);
      const body = await response.json();
      const id = asArray(body && body.data).length ? body.data[0].id : null;
      chat.model = typeof id === "string" ? id : null;
      ui.modelId.textContent = chat.model || "no model";
      ui.modelId.title = chat.model ? `Model: ${chat.model}` : "The server lists no model";
    } catch (error) {
      ui.modelId.textContent = error.status === 401 ? "API key needed" : "model unavailable";
      ui.modelId.title = error.message;
    }
  }

  // ---------------------------------------------------------------- views

  function currentView() {
    return location.hash === "#cluster" ? "cluster" : "chat";
  }

  function showView() {
    const view = currentView();
    ui.chatView.hidden = view !== "chat";
    ui.clusterView.hidden = view !== "cluster";
    for (const tab of ui.tabs) {
      const selected = tab.dataset.view === view;
      tab.setAttribute("aria-selected", String(selected));
      tab.tabIndex = selected ? 0 : -1;
    }
    if (view === "cluster") startClusterFeed();
    else stopClusterFeed();
  }

  function onTabKey(event) {
    const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
    if (!step) return;
    const index = ui.tabs.indexOf(event.currentTarget);
    const next = ui.tabs[(index + step + ui.tabs.length) % ui.tabs.length];
    location.hash = `#${next.dataset.view}`;
    next.focus();
  }

  // ---------------------------------------------------------------- conversations

  const chat = {
    model: null,
    conversations: [],
    currentId: null,
    stream: null, // the reply being streamed: see streamReply
  };

  /** Why `item` is not a conversation, or null when it is one. */
  function conversationProblem(item) {
    if (!isObject(item)) return "expected an object with a \"messages\" array";
    if (!Array.isArray(item.messages)) return "it has no \"messages\" array";
    if (item.title !== undefined && typeof item.title !== "string") return "its \"title\" is not text";
    for (const [i, message] of item.messages.entries()) {
      const where = `message ${i + 1}`;
      if (!isObject(message)) return `${where} is not an object`;
      if (!ROLES.has(message.role)) return `${where} has an unknown role ${JSON.stringify(message.role)}`;
      const emptyAllowed = message.role === "assistant" && (message.content === null || message.content === undefined);
      if (typeof message.content !== "string" && !emptyAllowed) return `${where} has no text "content"`;
      if (message.reasoning !== undefined && typeof message.reasoning !== "string") return `${where} has a bad "reasoning"`;
      if (message.tool_calls !== undefined && !Array.isArray(message.tool_calls)) return `${where} has bad "tool_calls"`;
    }
    return null;
  }

  function normalizeConversation(item) {
    const created = isNumber(item.created) ? item.created : Date.parse(item.created) || Date.now();
    const conversation = {
      id: typeof item.id === "string" || isNumber(item.id) ? String(item.id) : newId(),
      title: "",
      created,
      messages: item.messages.map(normalizeMessage),
    };
    conversation.title = titleOf(conversation);
    return conversation;
  }

  function normalizeMessage(message) {
    const out = { role: message.role, content: message.content || "" };
    if (message.reasoning) out.reasoning = message.reasoning;
    const calls = asArray(message.tool_calls).filter((c) => isObject(c) && isObject(c.function));
    if (calls.length) out.tool_calls = calls;
    if (isObject(message.stats)) out.stats = message.stats;
    return out;
  }

  function loadConversations() {
    const stored = asArray(readStored(STORE.conversations, []));
    return stored.filter((c) => conversationProblem(c) === null).map(normalizeConversation);
  }

  function saveConversations() {
    for (const conversation of chat.conversations) conversation.title = titleOf(conversation);
    writeStored(STORE.conversations, chat.conversations);
  }

  function titleOf(conversation) {
    const first = conversation.messages.find((m) => m.role === "user");
    const words = (first ? first.content : "").replace(/\s+/g, " ").trim();
    if (!words) return conversation.title || "New chat";
    return words.length > 40 ? `${words.slice(0, 40)}…` : words;
  }

  function currentConversation() {
    return chat.conversations.find((c) => c.id === chat.currentId) || null;
  }

  function createConversation() {
    const conversation = { id: newId(), title: "New chat", created: Date.now(), messages: [] };
    chat.conversations.unshift(conversation);
    chat.currentId = conversation.id;
    saveConversations();
    return conversation;
  }

  function startNewChat() {
    const current = currentConversation();
    if (!current || current.messages.length) createConversation();
    renderChat();
    ui.prompt.focus();
  }

  function selectConversation(id) {
    chat.currentId = id;
    renderChat();
  }

  function deleteConversation(id) {
    if (chat.stream && chat.stream.conversation.id === id) chat.stream.controller.abort();
    chat.conversations = chat.conversations.filter((c) => c.id !== id);
    if (chat.currentId === id) chat.currentId = chat.conversations.length ? chat.conversations[0].id : null;
    saveConversations();
    renderChat();
  }

  function exportConversation() {
    const conversation = currentConversation();
    if (!conversation) {
      showError("There is no conversation to export.");
      return;
    }
    const blob = new Blob([JSON.stringify(conversation, null, 2)], { type: "application/json" });
    const url = URL.createObjectURL(blob);
    const slug = titleOf(conversation).toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-|-$/g, "");
    const link = h("a", { href: url, download: `shardwire-${slug || "chat"}.json`, hidden: true });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  }

  async function importConversations(file) {
    let parsed;
    try {
      parsed = JSON.parse(await file.text());
    } catch (error) {
      showError(`Could not import ${file.name}: it is not JSON (${error.message}).`);
      return;
    }
    const items = Array.isArray(parsed) ? parsed : [parsed];
    if (!items.length) {
      showError(`Could not import ${file.name}: it holds no conversation.`);
      return;
    }
    for (const [i, item] of items.entries()) {
      const problem = conversationProblem(item);
      if (problem) {
        const which = items.length > 1 ? ` (conversation ${i + 1})` : "";
        showError(`Could not import ${file.name}${which}: ${problem}.`);
        return;
      }
    }
    const taken = new Set(chat.conversations.map((c) => c.id));
    const imported = items.map(normalizeConversation);
    for (const conversation of imported) {
      if (taken.has(conversation.id)) conversation.id = newId();
      taken.add(conversation.id);
    }
    chat.conversations.unshift(...imported);
    chat.currentId = imported[0].id;
    saveConversations();
    clearError();
    renderChat();
  }

  // ---------------------------------------------------------------- chat rendering

  function renderChat() {
    renderConversationList();
    renderMessages();
  }

  function renderConversationList() {
    ui.conversations.replaceChildren(
      ...chat.conversations.map((conversation) => {
        const title = titleOf(conversation);
        const current = conversation.id === chat.currentId;
        return h(
          "li",
          { testid: "conversation", class: current ? "current" : null, "data-id": conversation.id },
          button(title, null, () => selectConversation(conversation.id), {
            class: "conversation-title",
            title,
            "aria-current": current ? "true" : null,
          }),
          button("Delete", "delete-conversation", () => deleteConversation(conversation.id), {
            class: "conversation-delete link-button",
            "aria-label": `Delete conversation: ${title}`,
          })
        );
      })
    );
  }

  function renderMessages() {
    const conversation = currentConversation();
    const messages = conversation ? conversation.messages : [];
    const nodes = messages.map((message, index) => renderMessage(conversation, message, index));
    if (!nodes.length) nodes.push(h("p", { class: "empty" }, "Ask something to start a conversation."));
    ui.messages.replaceChildren(...nodes);
    ui.messages.scrollTop = ui.messages.scrollHeight;
    updateSendButton();
  }

  function renderMessage(conversation, message, index) {
    const streaming = chat.stream !== null;
    const isLast = index === conversation.messages.length - 1;
    const node = h("div", { class: `message ${message.role}`, testid: "message", "data-role": message.role });
    node.append(h("div", { class: "message-role" }, message.role));
    const actions = h("div", { class: "message-actions" });

    if (message.role === "assistant") {
      const view = assistantView(message);
      node.append(view.progress, view.reasoning, view.toolCalls, view.content);
      if (chat.stream && chat.stream.message === message) chat.stream.view = view;
      else if (message.stats) node.append(h("div", { class: "stats", testid: "stats" }, formatStats(message.stats)));
      actions.append(button("Copy", "copy", (e) => copyText(message.content, e.currentTarget)));
      if (isLast && !streaming) {
        const regenerate = () => beginReply(conversation, () => conversation.messages.pop());
        actions.append(button("Regenerate", "regenerate", regenerate));
      }
    } else {
      node.append(h("div", { class: "message-text", testid: "message-content" }, message.content));
      if (message.role === "user") {
        const edit = () => startEdit(node, conversation, index);
        actions.append(button("Edit", "edit", edit, { disabled: streaming }));
        if (isLast && !streaming) actions.append(button("Retry", "retry", () => beginReply(conversation, () => {})));
      }
    }
    if (actions.childElementCount) node.append(actions);
    return node;
  }

  const openReasoning = new WeakSet(); // messages whose reasoning the user unfolded, kept across renders

  /** The parts of an assistant message that change while it streams. */
  function assistantView(message) {
    const view = {
      reasoningText: h("div", { class: "reasoning-text" }),
      reasoning: h("details", { class: "reasoning", testid: "reasoning", hidden: true, open: openReasoning.has(message) }),
      toolCalls: h("div", { class: "tool-calls" }),
      content: h("div", { class: "markdown", testid: "message-content" }),
      progress: h("div", { class: "prompt-progress", testid: "prompt-progress", hidden: true }),
      shown: { content: null, reasoning: null, toolCalls: null, progress: null },
    };
    view.reasoning.append(h("summary", {}, "Reasoning"), view.reasoningText);
    view.reasoning.addEventListener("toggle", () => {
      if (view.reasoning.open) openReasoning.add(message);
      else openReasoning.delete(message);
    });
    fillAssistant(view, message);
    return view;
  }

  function fillAssistant(view, message) {
    const shown = view.shown;
    const progress = promptProgressText(message.progress);
    if (progress !== shown.progress) {
      view.progress.textContent = progress;
      view.progress.hidden = !progress;
      shown.progress = progress;
    }
    if (message.reasoning !== shown.reasoning) {
      view.reasoningText.textContent = message.reasoning || "";
      view.reasoning.hidden = !message.reasoning;
      shown.reasoning = message.reasoning;
    }
    const calls = JSON.stringify(message.tool_calls || []);
    if (calls !== shown.toolCalls) {
      view.toolCalls.replaceChildren(...asArray(message.tool_calls).filter(Boolean).map(toolCallBlock));
      shown.toolCalls = calls;
    }
    if (message.content !== shown.content) {
      setMarkdown(view.content, message.content || "");
      shown.content = message.content;
    }
  }

  /** How far the server has read the prompt, before the first token: "" once it has. */
  function promptProgressText(progress) {
    if (!isObject(progress) || !isNumber(progress.total) || !isNumber(progress.processed)) return "";
    const cached = isNumber(progress.cache) && progress.cache > 0 ? `, ${progress.cache} from the cache` : "";
    return `Reading the prompt: ${progress.processed} of ${progress.total} tokens${cached}`;
  }

  function toolCallBlock(call) {
    const fn = call.function || {};
    let args = fn.arguments || "";
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch (error) {
      // still streaming, or not JSON: shown as it came
    }
    return h(
      "div",
      { class: "tool-call", testid: "tool-call" },
      h("div", { class: "tool-call-name" }, "Tool call: ", h("code", {}, fn.name || "?")),
      h("pre", {}, h("code", {}, args))
    );
  }

  function setMarkdown(node, markdown) {
    if (!window.marked || !window.DOMPurify) {
      node.classList.add("plain");
      node.textContent = markdown;
      return;
    }
    node.innerHTML = window.DOMPurify.sanitize(window.marked.parse(markdown, { async: false }), SANITIZE);
  }

  function formatStats(stats) {
    const parts = [];
    if (isNumber(stats.ttft_ms)) parts.push(`TTFT ${Math.round(stats.ttft_ms)} ms`);
    if (isNumber(stats.tokens_per_s)) parts.push(`${stats.tokens_per_s.toFixed(1)} tokens/s`);
    if (isNumber(stats.tokens)) parts.push(`${stats.tokens} tokens`);
    if (isNumber(stats.cached)) parts.push(`cached ${stats.cached}`);
    if (isNumber(stats.prompt_n) && isNumber(stats.prompt_ms)) {
      parts.push(`prompt ${stats.prompt_n} tokens in ${Math.round(stats.prompt_ms)} ms`);
    }
    let line = parts.join(" · ");
    if (stats.finish_reason === "length") line += " (cut at max tokens)";
    if (stats.stopped) line += " (stopped)";
    if (stats.failed) line += " (failed)";
    return line.trim();
  }

  function startEdit(node, conversation, index) {
    const message = conversation.messages[index];
    const area = h("textarea", { class: "edit-text", testid: "edit-text", rows: 3, "aria-label": "Edit message" });
    area.value = message.content;
    const save = () => {
      const edited = area.value.trim();
      if (!edited) {
        showError("A message cannot be empty.");
        return;
      }
      beginReply(conversation, () => {
        message.content = edited;
        conversation.messages.splice(index + 1);
      });
    };
    area.addEventListener("keydown", (event) => {
      if (event.key === "Escape") renderMessages();
      else if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) save();
    });
    const buttons = [button("Save", "edit-save", save, { class: "primary" }), button("Cancel", "edit-cancel", renderMessages)];
    const editor = h("div", { class: "edit" }, area, h("div", { class: "message-actions" }, buttons));
    node.querySelector(".message-text").replaceWith(editor);
    const actions = node.querySelector(":scope > .message-actions");
    if (actions) actions.remove();
    area.focus();
  }

  async function copyText(value, target) {
    try {
      await navigator.clipboard.writeText(value);
    } catch (error) {
      // no clipboard API outside secure contexts: the old way
      const area = h("textarea", { class: "visually-hidden", "aria-hidden": "true" });
      area.value = value;
      document.body.append(area);
      area.select();
      const copied = document.execCommand("copy");
      area.remove();
      if (!copied) {
        showError("Could not copy: the browser refused.");
        return;
      }
    }
    target.textContent = "Copied";
    setTimeout(() => (target.textContent = "Copy"), 1200);
  }

  function updateSendButton() {
    const streaming = chat.stream !== null;
    ui.send.textContent = streaming ? "Stop" : "Send";
    ui.send.setAttribute("data-testid", streaming ? "stop" : "send");
    ui.send.classList.toggle("danger", streaming);
    ui.send.classList.toggle("primary", !streaming);
  }

  // ---------------------------------------------------------------- settings

  function loadSettings() {
    const stored = readStored(STORE.settings, {});
    const settings = isObject(stored) ? stored : {};
    for (const input of ui.settingInputs) {
      const value = settings[input.dataset.setting];
      if (input.type === "checkbox") input.checked = Boolean(value);
      else input.value = value === undefined || value === null ? "" : String(value);
    }
  }

  /** The settings as the inputs show them: {system: "...", temperature: "0.7", json: true, ...}. */
  function currentSettings() {
    const settings = {};
    for (const input of ui.settingInputs) {
      settings[input.dataset.setting] = input.type === "checkbox" ? input.checked : input.value;
    }
    return settings;
  }

  function saveSettings() {
    writeStored(STORE.settings, currentSettings());
  }

  /** The request's sampling fields and system prompt; throws with a message on a bad setting. */
  function requestOptions() {
    const settings = currentSettings();
    const fields = {};
    for (const [name, kind] of Object.entries(NUMERIC_SETTINGS)) {
      const raw = String(settings[name] || "").trim();
      if (raw === "") continue;
      const value = Number(raw);
      if (!Number.isFinite(value) || (kind === "integer" && !Number.isInteger(value))) {
        throw new Error(`Setting ${name} must be ${kind === "integer" ? "a whole number" : "a number"}.`);
      }
      fields[name] = value;
    }
    const schema = jsonSetting(settings.schema, "JSON schema", isObject, "a JSON object");
    if (schema !== null) fields.response_format = { type: "json_schema", json_schema: { name: "schema", schema } };
    else if (settings.json) fields.response_format = { type: "json_object" };
    const isToolList = (x) => Array.isArray(x) && x.every(isObject);
    const tools = jsonSetting(settings.tools, "tools", isToolList, "a JSON array of objects");
    if (tools !== null) fields.tools = tools;
    return { system: String(settings.system || "").trim(), fields };
  }

  /** A setting written as JSON: null when empty; throws, naming it, when it does not parse or is
   * not what `valid` accepts. */
  function jsonSetting(raw, name, valid, what) {
    const source = String(raw || "").trim();
    if (!source) return null;
    let value;
    try {
      value = JSON.parse(source);
    } catch (error) {
      throw new Error(`Setting "${name}" is not JSON: ${error.message}`);
    }
    if (!valid(value)) throw new Error(`Setting "${name}" must be ${what}.`);
    return value;
  }

  // ---------------------------------------------------------------- sending and streaming

  function sendPrompt() {
    if (chat.stream) return;
    const prompt = ui.prompt.value.trim();
    const current = currentConversation();
    if (!prompt) {
      const last = current && current.messages[current.messages.length - 1];
      if (last && last.role === "user") beginReply(current, () => {}); // send the unanswered one again
      return;
    }
    const options = checkedOptions();
    if (!options) return;
    const conversation = current || createConversation();
    beginReply(
      conversation,
      () => {
        conversation.messages.push({ role: "user", content: prompt });
        ui.prompt.value = "";
      },
      options
    );
  }

  function checkedOptions() {
    try {
      return requestOptions();
    } catch (error) {
      showError(error.message);
      return null;
    }
  }

  /** Checks the settings, applies `change` to the conversation, then streams a reply to it. */
  function beginReply(conversation, change, options = checkedOptions()) {
    if (!options || chat.stream) return;
    clearError();
    change();
    saveConversations();
    if (chat.currentId !== conversation.id) chat.currentId = conversation.id;
    streamReply(conversation, options);
  }

  function requestBody(conversation, options) {
    const messages = options.system ? [{ role: "system", content: options.system }] : [];
    for (const message of conversation.messages) messages.push({ role: message.role, content: message.content || "" });
    // return_progress: while the prompt is read, chunks say how far (llama-server's prompt_progress)
    const body = { messages, stream: true, stream_options: { include_usage: true }, return_progress: true, ...options.fields };
    return chat.model ? { model: chat.model, ...body } : body;
  }

  async function streamReply(conversation, options) {
    const body = JSON.stringify(requestBody(conversation, options));
    const message = { role: "assistant", content: "" };
    conversation.messages.push(message);
    const stream = {
      conversation,
      message,
      controller: new AbortController(),
      started: performance.now(),
      firstToken: null,
      deltas: 0,
      usage: null,
      timings: null,
      finishReason: null,
      view: null,
      frame: 0,
    };
    chat.stream = stream;
    renderChat();

    let outcome = "done";
    try {
      const response = await api(
        "/v1/chat/completions",
        {
          method: "POST",
          headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
          body,
          signal: stream.controller.signal,
        },
        () => retryUnanswered(conversation)
      );
      for await (const { data } of readEvents(response.body)) {
        if (data === "[DONE]") break;
        applyChunk(stream, parseEventData(data));
      }
    } catch (error) {
      if (stream.controller.signal.aborted) outcome = "stopped";
      else {
        outcome = "failed";
        if (error.status !== 401) showError(error instanceof TypeError ? `Network error: ${error.message}` : error.message);
      }
    }
    finishReply(stream, outcome);
  }

  function retryUnanswered(conversation) {
    const last = conversation.messages[conversation.messages.length - 1];
    if (!chat.stream && last && last.role === "user") beginReply(conversation, () => {});
  }

  function parseEventData(data) {
    try {
      return JSON.parse(data);
    } catch (error) {
      throw new ApiError(`The server sent an event that is not JSON: ${data.slice(0, 200)}`);
    }
  }

  function applyChunk(stream, chunk) {
    if (!isObject(chunk)) return;
    if (chunk.error) {
      const error = chunk.error;
      throw new ApiError(isObject(error) ? String(error.message || JSON.stringify(error)) : String(error));
    }
    if (isObject(chunk.usage)) stream.usage = chunk.usage;
    if (isObject(chunk.timings)) stream.timings = chunk.timings;
    if (isObject(chunk.prompt_progress) && stream.firstToken === null) {
      stream.message.progress = chunk.prompt_progress;
      scheduleRender(stream);
    }
    const choice = asArray(chunk.choices).find((c) => isObject(c) && (c.index === 0 || c.index === undefined));
    if (!choice) return;
    if (choice.finish_reason) stream.finishReason = choice.finish_reason;
    const delta = isObject(choice.delta) ? choice.delta : {};
    const message = stream.message;
    let fresh = false;
    if (typeof delta.content === "string" && delta.content) {
      message.content += delta.content;
      fresh = true;
    }
    if (typeof delta.reasoning_content === "string" && delta.reasoning_content) {
      message.reasoning = (message.reasoning || "") + delta.reasoning_content;
      fresh = true;
    }
    if (Array.isArray(delta.tool_calls) && delta.tool_calls.length) {
      mergeToolCalls(message, delta.tool_calls);
      fresh = true;
    }
    if (!fresh) return;
    delete message.progress;
    stream.deltas += 1;
    if (stream.firstToken === null) stream.firstToken = performance.now();
    scheduleRender(stream);
  }

  /** As OpenAI streams tool calls: the entry at `index` grows, name and arguments by pieces. */
  function mergeToolCalls(message, deltas) {
    if (!message.tool_calls) message.tool_calls = [];
    for (const delta of deltas) {
      if (!isObject(delta)) continue;
      const index = Number.isInteger(delta.index) ? delta.index : message.tool_calls.length;
      if (!message.tool_calls[index]) {
        message.tool_calls[index] = { id: "", type: "function", function: { name: "", arguments: "" } };
      }
      const call = message.tool_calls[index];
      const fn = isObject(delta.function) ? delta.function : {};
      if (delta.id) call.id = delta.id;
      if (delta.type) call.type = delta.type;
      if (typeof fn.name === "string") call.function.name += fn.name;
      if (typeof fn.arguments === "string") call.function.arguments += fn.arguments;
    }
  }

  function scheduleRender(stream) {
    if (stream.frame) return;
    stream.frame = requestAnimationFrame(() => {
      stream.frame = 0;
      const view = stream.view;
      if (!view || !view.content.isConnected) return;
      const box = ui.messages;
      const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
      fillAssistant(view, stream.message);
      if (atBottom) box.scrollTop = box.scrollHeight;
    });
  }

  function finishReply(stream, outcome) {
    if (stream.frame) cancelAnimationFrame(stream.frame);
    if (chat.stream === stream) chat.stream = null;
    const { conversation, message } = stream;
    delete message.progress;
    if (message.tool_calls) message.tool_calls = message.tool_calls.filter(Boolean);
    const empty = !message.content && !message.reasoning && !(message.tool_calls && message.tool_calls.length);
    if (empty && outcome === "failed") {
      conversation.messages.splice(conversation.messages.indexOf(message), 1);
    } else {
      message.stats = replyStats(stream, outcome);
    }
    if (chat.conversations.includes(conversation)) saveConversations();
    renderChat();
  }

  function replyStats(stream, outcome) {
    const end = performance.now();
    const timings = stream.timings || {};
    const usage = stream.usage || {};
    const details = isObject(usage.prompt_tokens_details) ? usage.prompt_tokens_details : {};
    const tokens = firstNumber(timings.predicted_n, usage.completion_tokens, stream.deltas || null);
    let perSecond = timings.predicted_per_second > 0 ? timings.predicted_per_second : null;
    const decodeMs = stream.firstToken === null ? 0 : end - stream.firstToken;
    if (perSecond === null && isNumber(tokens) && tokens > 1 && decodeMs > 0) {
      perSecond = ((tokens - 1) * 1000) / decodeMs; // the first token came with the prompt
    }
    const stats = {
      ttft_ms: stream.firstToken === null ? null : Math.round(stream.firstToken - stream.started),
      tokens_per_s: perSecond === null ? null : Math.round(perSecond * 10) / 10,
      tokens,
      cached: firstNumber(timings.cache_n, details.cached_tokens),
      prompt_tokens: firstNumber(usage.prompt_tokens),
      prompt_n: firstNumber(timings.prompt_n),
      prompt_ms: firstNumber(timings.prompt_ms),
      finish_reason: stream.finishReason,
    };
    if (outcome === "stopped") stats.stopped = true;
    if (outcome === "failed") stats.failed = true;
    return stats;
  }

  // ---------------------------------------------------------------- cluster feed

  const feed = { controller: null, timer: 0 };

  function startClusterFeed() {
    if (!feed.controller && !feed.timer) connectCluster();
  }

  function stopClusterFeed() {
    clearTimeout(feed.timer);
    feed.timer = 0;
    if (feed.controller) feed.controller.abort();
    feed.controller = null;
  }

  function setConnection(label, state, detail = "") {
    ui.connection.textContent = label;
    ui.connection.dataset.state = state;
    ui.connection.title = detail;
  }

  async function connectCluster() {
    feed.timer = 0;
    const controller = new AbortController();
    feed.controller = controller;
    if (ui.connection.dataset.state !== "down") setConnection("connecting…", "connecting");
    let problem = "the stream ended";
    try {
      const response = await api(
        "/v1/cluster/events",
        { headers: { Accept: "text/event-stream" }, signal: controller.signal },
        () => currentView() === "cluster" && startClusterFeed()
      );
      setConnection("live", "live");
      for await (const { event, data } of readEvents(response.body)) {
        if (event === "cluster" || event === "message") renderSnapshot(data);
      }
    } catch (error) {
      if (controller.signal.aborted) return;
      if (error.status === 401) {
        if (feed.controller === controller) feed.controller = null;
        setConnection("API key needed", "down", error.message);
        return;
      }
      problem = error.message;
    }
    if (feed.controller !== controller) return; // stopped, or replaced meanwhile
    feed.controller = null;
    if (currentView() !== "cluster") return;
    setConnection("reconnecting…", "down", problem);
    feed.timer = setTimeout(connectCluster, RECONNECT_MS);
  }

  function renderSnapshot(data) {
    let snapshot;
    try {
      snapshot = JSON.parse(data);
    } catch (error) {
      return; // one bad event: the next snapshot replaces it
    }
    if (isObject(snapshot)) renderCluster(snapshot);
  }

  // ---------------------------------------------------------------- cluster rendering

  function renderCluster(snapshot) {
    const cluster = isObject(snapshot.cluster) ? snapshot.cluster : null;
    const workers = cluster ? asArray(cluster.workers).filter(isObject) : [];
    replaceIfChanged(ui.summary, summaryItems(snapshot, cluster, workers));
    replaceIfChanged(ui.ringBox, [ringDrawing(cluster, workers)]);
    replaceIfChanged(
      ui.workers,
      workers.length
        ? workers.map(workerCard)
        : [h("p", { class: "muted" }, cluster ? "No worker is connected." : "One process: the coordinator holds every block.")]
    );
    replaceIfChanged(ui.recoveries, [recoveryList(cluster ? cluster.recoveries : [])]);
  }

  const shownMarkup = new WeakMap(); // container -> the markup it shows

  /** Puts `nodes` in `container` only where they differ from what it shows: while a model decodes,
   * most snapshots change a figure or two, and the ring and the recoveries stay as they are, so
   * the browser lays out and paints only what changed. */
  function replaceIfChanged(container, nodes) {
    const markup = nodes.map((node) => node.outerHTML).join("");
    if (shownMarkup.get(container) === markup) return;
    shownMarkup.set(container, markup);
    container.replaceChildren(...nodes);
  }

  function stat(key, label, ...value) {
    return h("div", { class: "stat", testid: `stat-${key}` }, h("span", { class: "stat-label" }, label), h("span", { class: "stat-value" }, ...value));
  }

  function bar(used, total, label) {
    const fraction = isNumber(used) && isNumber(total) && total > 0 ? used / total : 0;
    const percent = Math.round(Math.min(1, Math.max(0, fraction)) * 100);
    const track = h("div", {
      class: `bar${fraction > 1 ? " over" : fraction > 0.9 ? " high" : ""}`,
      role: "progressbar",
      "aria-valuemin": 0,
      "aria-valuemax": 100,
      "aria-valuenow": percent,
      "aria-label": label,
    });
    const fill = h("div", { class: "bar-fill" });
    fill.style.width = `${percent}%`; // through CSSOM, which a Content-Security-Policy allows
    track.append(fill);
    return track;
  }

  function summaryItems(snapshot, cluster, workers) {
    const live = isObject(snapshot.live) ? snapshot.live : {};
    const slots = isObject(snapshot.slots) ? snapshot.slots : {};
    const kv = isObject(slots.kv) ? slots.kv : {};
    const requests = isObject(snapshot.requests) ? snapshot.requests : {};
    const problem = snapshot.problem || (cluster && cluster.broken) || null;
    const status = problem
      ? h("span", { class: "problem", testid: "cluster-problem" }, String(problem))
      : h("span", { class: snapshot.ready ? "ok" : "muted" }, snapshot.ready ? "ready" : "not ready");
    const serving = workers.filter((w) => asArray(w.stages).length).length;
    const others = workers.length - serving; // lost, or connected with no stage
    const mode = cluster
      ? `${serving} worker${serving === 1 ? "" : "s"}${others ? ` (+${others} without a stage)` : ""}`
      : "one process";
    const kvTitle = `${text(kv.page_tokens)} tokens a page · ${text(kv.cached)} cached · ${text(kv.hit_tokens)} hit / ${text(kv.miss_tokens)} missed tokens`;
    const items = [
      stat("model", "Model", text(snapshot.model)),
      stat("status", "Status", status),
      stat("mode", "Runs on", mode),
      cluster ? stat("plan", "Plan", h("code", {}, text(cluster.plan))) : null,
      stat("tokens", "Tokens/s", format(live.tokens_per_s, 1)),
      stat("prompt-tokens", "Prompt tokens/s", format(live.prompt_tokens_per_s, 1)),
      stat("step", "Step", format(live.step_ms, 1, " ms")),
      stat("running", "Running / waiting", `${text(live.running)} / ${text(live.waiting)}`),
      stat("slots", "Slots busy", `${text(slots.busy)} / ${text(slots.total)}`),
      stat(
        "kv",
        "KV pages in use",
        h("span", { title: kvTitle }, `${text(kv.in_use)} / ${text(kv.pages)}`),
        bar(kv.in_use, kv.pages, "KV pages in use")
      ),
      stat("requests", "Served / failed", `${text(requests.served)} / ${text(requests.failed)}`),
      stat("ctx", "Context", isNumber(snapshot.ctx) ? `${snapshot.ctx} tokens` : DASH),
    ];
    const load = cluster && isObject(cluster.load) ? cluster.load : {};
    if (Object.keys(load).length) {
      const loaded = `file ${formatBytes(load.file)} · cache ${formatBytes(load.cache)} · streamed ${formatBytes(load.streamed)}`;
      items.push(stat("load", "Weights loaded from", loaded));
    }
    return items.filter(Boolean);
  }

  function stateOf(worker) {
    if (WORKER_STATES.has(worker.state)) return worker.state;
    if (worker.alive === false) return "lost";
    return asArray(worker.stages).length ? "healthy" : "idle";
  }

  function blockRange(start, end) {
    if (!isNumber(start) || !isNumber(end)) return DASH;
    return end - start <= 1 ? `block ${start}` : `blocks ${start}–${end - 1}`; // [start, end)
  }

  function stageBlocks(stage) {
    const blocks = asArray(stage.blocks);
    return blockRange(blocks[0], blocks[1]);
  }

  function workerBlocks(worker) {
    const stages = asArray(worker.stages).filter(isObject);
    return stages.length ? stages.map(stageBlocks).join(", ") : "no blocks";
  }

  /** The ring the activations travel: coordinator → stage 0's worker → … → coordinator. */
  function ringDrawing(cluster, workers) {
    const stages = [];
    for (const worker of workers) {
      for (const stage of asArray(worker.stages).filter(isObject)) stages.push({ index: stage.index, worker });
    }
    stages.sort((a, b) => (a.index || 0) - (b.index || 0));
    const ring = [];
    for (const { worker } of stages) if (!ring.includes(worker)) ring.push(worker);
    const offRing = workers.filter((w) => !ring.includes(w));

    const coordinatorState = cluster && (cluster.broken || cluster.ready === false) ? "recovering" : "coordinator";
    const nodes = [
      { label: "coordinator", sub: cluster ? "" : "one process · every block", state: coordinatorState, mark: "C" },
      ...ring.map((w, i) => ({ label: text(w.name), sub: workerBlocks(w), state: stateOf(w), mark: String(i + 1) })),
    ];
    const width = 560;
    const radius = nodes.length > 1 ? 110 : 0;
    const cx = width / 2;
    const cy = radius + 60;
    const nodeR = 18;
    const angle = (i) => -Math.PI / 2 + (2 * Math.PI * i) / nodes.length;
    const at = (i, r = radius) => [cx + r * Math.cos(angle(i)), cy + r * Math.sin(angle(i))];

    const hops = [0, ...stages.map((s) => 1 + ring.indexOf(s.worker)), 0].filter((p, i, all) => i === 0 || p !== all[i - 1]);
    const arrows = [];
    for (let i = 1; i < hops.length && nodes.length > 1; i++) arrows.push(arc(hops[i - 1], hops[i]));

    function arc(from, to) {
      const gap = (nodeR + 6) / radius;
      let sweep = angle(to) - angle(from);
      while (sweep <= 0) sweep += 2 * Math.PI;
      const a0 = angle(from) + gap;
      const a1 = angle(from) + sweep - gap;
      const large = a1 - a0 > Math.PI ? 1 : 0;
      const point = (a) => `${(cx + radius * Math.cos(a)).toFixed(1)} ${(cy + radius * Math.sin(a)).toFixed(1)}`;
      return svg("path", { class: "ring-arrow", d: `M ${point(a0)} A ${radius} ${radius} 0 ${large} 1 ${point(a1)}`, "marker-end": "url(#ring-arrowhead)" });
    }

    const drawn = nodes.map((node, i) => {
      const [x, y] = at(i);
      const [lx, ly] = nodes.length > 1 ? at(i, radius + nodeR + 10) : [x, y + nodeR + 16];
      const cos = Math.cos(angle(i));
      const sin = Math.sin(angle(i));
      const anchor = nodes.length === 1 || Math.abs(cos) < 0.3 ? "middle" : cos > 0 ? "start" : "end";
      const top = sin < -0.3 && nodes.length > 1;
      const dy = top ? (node.sub ? -12 : 2) : sin > 0.3 ? 10 : 0; // labels clear of the circle
      return nodeGroup(node, x, y, lx, ly + dy, anchor, nodeR);
    });

    const rowY = cy + radius + nodeR + 70;
    const spacing = width / (offRing.length + 1);
    const idle = offRing.map((w, i) => {
      const x = spacing * (i + 1);
      const node = { label: text(w.name), sub: "not in the ring", state: stateOf(w), mark: "–" };
      return nodeGroup(node, x, rowY, x, rowY + nodeR + 16, "middle", nodeR - 4);
    });
    const height = (offRing.length ? rowY + nodeR + 46 : cy + radius + nodeR + 50) + (nodes.length > 1 ? 0 : 10);
    const order = ["coordinator", ...stages.map((s) => text(s.worker.name)), "coordinator"];
    return svg(
      "svg",
      { class: "ring", testid: "ring", viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": `Ring: ${order.join(" → ")}` },
      svg(
        "defs",
        {},
        svg(
          "marker",
          { id: "ring-arrowhead", viewBox: "0 0 10 10", refX: 8, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto" },
          svg("path", { d: "M 0 0 L 10 5 L 0 10 z", class: "ring-arrowhead" })
        )
      ),
      nodes.length > 1 ? svg("circle", { class: "ring-track", cx, cy, r: radius }) : null,
      arrows,
      drawn,
      idle
    );
  }

  function nodeGroup(node, x, y, lx, ly, anchor, r) {
    return svg(
      "g",
      { class: `ring-node state-${node.state}`, "data-name": node.label, "data-state": node.state },
      svg("title", {}, `${node.label} (${node.state})${node.sub ? `: ${node.sub}` : ""}`),
      svg("circle", { cx: x.toFixed(1), cy: y.toFixed(1), r }),
      svg("text", { class: "ring-mark", x: x.toFixed(1), y: (y + 4).toFixed(1), "text-anchor": "middle" }, node.mark),
      svg("text", { class: "ring-label", x: lx.toFixed(1), y: ly.toFixed(1), "text-anchor": anchor }, node.label),
      node.sub ? svg("text", { class: "ring-sub", x: lx.toFixed(1), y: (ly + 14).toFixed(1), "text-anchor": anchor }, node.sub) : null
    );
  }

  function workerCard(worker) {
    const name = text(worker.name);
    const state = typeof worker.state === "string" && worker.state ? worker.state : null;
    const stages = asArray(worker.stages).filter(isObject);
    return h(
      "article",
      { class: `worker state-${stateOf(worker)}`, testid: "worker", "data-name": worker.name || "", "data-state": state || "unknown" },
      h(
        "header",
        { class: "worker-head" },
        h("h4", { class: "worker-name" }, name),
        h("span", { class: `badge state-${stateOf(worker)}`, testid: "worker-state" }, state || DASH)
      ),
      h(
        "dl",
        { class: "facts" },
        fact("Worker id", text(worker.worker_id)),
        fact("Link round trip", format(worker.latency_ms, 2, " ms")),
        fact("TLS", tlsText(worker))
      ),
      asArray(worker.devices).filter(isObject).map((device) => deviceBlock(device, stages)),
      stages.length
        ? h("ul", { class: "stages" }, stages.map(stageLine))
        : h("p", { class: "muted" }, "Holds no stage.")
    );
  }

  function fact(label, ...value) {
    return h("div", { class: "fact" }, h("dt", {}, label), h("dd", {}, ...value));
  }

  function tlsText(worker) {
    if (!("tls" in worker)) return DASH;
    if (worker.tls === null) return "plain TCP";
    const full = String(worker.tls);
    const [scheme, digest] = full.includes(":") ? full.split(/:(.*)/s) : ["", full];
    const short = digest.length > 16 ? `${scheme ? `${scheme}:` : ""}${digest.slice(0, 16)}…` : full;
    return h("code", { class: "fingerprint", title: full, testid: "tls" }, short);
  }

  function deviceBlock(device, stages) {
    const here = stages.filter((s) => s.device === device.name);
    const used = here.reduce((sum, s) => sum + (s.weight_bytes || 0) + (s.kv_bytes || 0) + (s.workspace_bytes || 0), 0);
    const budget = isNumber(device.free) ? device.free : device.total;
    return h(
      "div",
      { class: "device", testid: "device" },
      h("div", { class: "device-head" }, h("strong", {}, text(device.name)), h("span", { class: "muted" }, ` ${text(device.compute)}`)),
      bar(used, budget, `Memory used on ${text(device.name)}`),
      h("div", { class: "device-memory", testid: "device-memory" }, `${formatBytes(used)} / ${formatBytes(budget)}`)
    );
  }

  function stageLine(stage) {
    const formats = isObject(stage.formats)
      ? Object.entries(stage.formats).map(([from, to]) => `${from} → ${to}`).join(", ")
      : "";
    const weights = [stage.weights, formats].filter(Boolean).join(" · ") || DASH;
    const memory = (stage.weight_bytes || 0) + (stage.kv_bytes || 0) + (stage.workspace_bytes || 0);
    return h(
      "li",
      { class: "stage", testid: "stage" },
      h("strong", {}, `Stage ${text(stage.index)}`),
      h("span", {}, text(stage.device)),
      h("span", {}, stageBlocks(stage)),
      h("span", { title: "Weight format" }, `weights ${weights}`),
      h("span", { title: "Step time" }, `step ${format(stage.step_ms, 1, " ms")}`),
      h(
        "span",
        { title: `weights ${formatBytes(stage.weight_bytes)}, KV ${formatBytes(stage.kv_bytes)}, workspace ${formatBytes(stage.workspace_bytes)}` },
        formatBytes(memory)
      )
    );
  }

  function recoveryList(recoveries) {
    const events = asArray(recoveries).filter(isObject).slice().reverse();
    events.sort((a, b) => (isNumber(b.at) ? b.at : 0) - (isNumber(a.at) ? a.at : 0)); // newest first
    if (!events.length) return h("p", { class: "muted" }, "No recoveries.");
    return h("ol", { class: "recovery-list" }, events.map(recoveryItem));
  }

  function recoveryItem(event) {
    const when = isNumber(event.at) ? new Date(event.at * 1000).toLocaleString() : DASH;
    const plan = asArray(event.plan)
      .filter(Array.isArray)
      .map(([where, start, end]) => `${text(where)} ${blockRange(start, end)}`)
      .join(", ");
    return h(
      "li",
      { class: `recovery ${event.recovered ? "recovered" : "failed"}`, testid: "recovery" },
      h(
        "div",
        { class: "recovery-head" },
        h("span", { class: `badge ${event.recovered ? "state-healthy" : "state-lost"}` }, event.recovered ? "recovered" : "failed"),
        h("span", {}, when),
        h("span", {}, format(event.seconds, 1, " s")),
        h("span", {}, `replayed ${text(event.replayed_tokens)} tokens`)
      ),
      h("div", { class: "recovery-reason" }, text(event.reason)),
      event.error ? h("div", { class: "problem" }, String(event.error)) : null,
      plan ? h("div", { class: "muted" }, `Now: ${plan}`) : null
    );
  }

  // ---------------------------------------------------------------- wiring

  function onPromptKey(event) {
    if (event.key !== "Enter" || event.shiftKey || event.isComposing) return;
    event.preventDefault();
    sendPrompt();
  }

  function onComposerSubmit(event) {
    event.preventDefault();
    if (chat.stream) chat.stream.controller.abort();
    else sendPrompt();
  }

  function configureMarkdown() {
    if (!window.marked || !window.DOMPurify) return;
    // Raw HTML in a reply is shown as text: it is more often code being discussed than markup, and
    // parsing its inline styles would trip the page's Content-Security-Policy (console errors).
    const escapeHtml = (raw) => raw.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
    window.marked.use({ gfm: true, breaks: false, renderer: { html: (token) => escapeHtml(token.text) } });
    window.DOMPurify.addHook("afterSanitizeAttributes", (node) => {
      if (node.tagName === "A" && node.getAttribute("href")) {
        node.setAttribute("target", "_blank");
        node.setAttribute("rel", "noopener noreferrer");
      }
      if (node.tagName === "IMG" && !/^data:image\//i.test(node.getAttribute("src") || "")) node.removeAttribute("src");
    });
  }

  function bindEvents() {
    for (const tab of ui.tabs) {
      tab.addEventListener("click", () => (location.hash = `#${tab.dataset.view}`));
      tab.addEventListener("keydown", onTabKey);
    }
    window.addEventListener("hashchange", showView);
    ui.errorDismiss.addEventListener("click", clearError);
    ui.newChat.addEventListener("click", startNewChat);
    ui.exportButton.addEventListener("click", exportConversation);
    ui.importButton.addEventListener("click", () => ui.importFile.click());
    ui.importFile.addEventListener("change", () => {
      const file = ui.importFile.files && ui.importFile.files[0];
      if (file) importConversations(file).finally(() => (ui.importFile.value = ""));
    });
    ui.composer.addEventListener("submit", onComposerSubmit);
    ui.prompt.addEventListener("keydown", onPromptKey);
    for (const input of ui.settingInputs) {
      input.addEventListener("input", saveSettings);
      input.addEventListener("change", saveSettings);
    }
    ui.keyForm.addEventListener("submit", saveApiKey);
    ui.keyCancel.addEventListener("click", () => ui.keyDialog.close());
    ui.keyDialog.addEventListener("close", () => retriesAfterKey.clear());
  }

  function start() {
    configureMarkdown();
    loadSettings();
    chat.conversations = loadConversations();
    chat.currentId = chat.conversations.length ? chat.conversations[0].id : null;
    bindEvents();
    renderChat();
    showView();
    loadModel();
  }

  start();
})();
