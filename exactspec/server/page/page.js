// exactspec's live page: sends the server's own OpenAI requests, streamed with stream_options.include_speculation,
// and shows how every token came. Everything the server says is shown as text (textContent), never as markup. The
// API key, where one is needed, is held in this script only and sent as a bearer token: never in a URL or storage.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  let apiKey = null;
  let info = null; // the server's GET v1/speculation
  let controller = null; // aborts the request in flight

  // --- talking to the server ---------------------------------------------------------------------------------

  function requestHeaders() {
    const headers = { "Content-Type": "application/json" };
    if (apiKey !== null) headers.Authorization = "Bearer " + apiKey;
    return headers;
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (_) { /* not JSON */ }
    return "the server answered HTTP " + response.status;
  }

  function setStatus(text, isError) {
    $("status").textContent = text;
    $("status").classList.toggle("error", Boolean(isError));
  }

  async function loadInfo() {
    let response;
    try {
      response = await fetch("v1/speculation", { headers: requestHeaders() });
    } catch (error) {
      setStatus("The server cannot be reached: " + error.message, true);
      return;
    }
    if (response.status === 401) {
      $("key-box").hidden = false;
      setStatus(apiKey === null ? "This server needs an API key." : "The server refused that key.", true);
      return;
    }
    if (!response.ok) {
      setStatus(await errorMessage(response), true);
      return;
    }
    info = await response.json();
    $("key-box").hidden = true;
    setStatus("");
    showInfo();
  }

  function option(select, value, label) {
    const element = document.createElement("option");
    element.value = value;
    element.textContent = label;
    select.appendChild(element);
  }

  function showInfo() {
    $("server-line").textContent = info.model + " · drafter " + (info.drafters.join(", ") || "none") +
      " · speculation " + info.speculation + " · up to " + info.num_draft_tokens + " draft tokens per round";
    const drafter = $("drafter");
    drafter.replaceChildren();
    for (const name of info.drafters) option(drafter, name, name);
    drafter.disabled = info.drafters.length < 2;
    const speculation = $("speculation");
    speculation.replaceChildren();
    for (const mode of info.modes) option(speculation, mode, mode);
    speculation.value = info.speculation;
    const k = $("k");
    k.replaceChildren();
    option(k, "auto", "auto");
    for (let n = 1; n <= info.num_draft_tokens; n++) option(k, String(n), String(n));
    const legend = $("legend");
    legend.replaceChildren();
    for (const [kind, style] of Object.entries(info.kinds)) {
      if (style.colour !== "transparent") document.documentElement.style.setProperty("--kind-" + kind, style.colour);
      const entry = document.createElement("span");
      entry.className = "tok tok-" + kind;
      entry.title = kind + ": " + style.legend;
      entry.textContent = kind + ": " + style.legend;
      legend.appendChild(entry);
    }
    for (const id of ["send", "compare"]) $(id).disabled = false;
  }

  function requestBody(speculation) {
    const chat = $("endpoint").value === "chat";
    const body = chat ? { messages: [{ role: "user", content: $("prompt").value }] } : { prompt: $("prompt").value };
    body.temperature = Number($("temperature").value);
    body.top_p = Number($("top-p").value);
    body.max_tokens = Number($("max-tokens").value);
    if ($("seed").value !== "") body.seed = Number($("seed").value);
    body.speculation = speculation;
    if ($("k").value !== "auto") body.num_draft_tokens = Number($("k").value);
    body.stream = true;
    body.stream_options = { include_usage: true, include_speculation: true };
    return { path: chat ? "v1/chat/completions" : "v1/completions", body };
  }

  // One streamed request: each token and round handed to `view` as it arrives. Returns what arrived, and an error
  // (the server's message, or that the connection ended mid-answer) if there was one.
  async function stream(request, view) {
    const result = { text: "", tokens: 0, started: performance.now(), finished: null, summary: null, error: null };
    let response;
    try {
      response = await fetch(request.path, { method: "POST", headers: requestHeaders(),
        body: JSON.stringify(request.body), signal: controller.signal });
    } catch (error) {
      result.error = error.name === "AbortError" ? "stopped" : "the server cannot be reached: " + error.message;
      return result;
    }
    if (!response.ok) {
      result.error = await errorMessage(response);
      if (response.status === 401) $("key-box").hidden = false;
      return result;
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let done = false;
    try {
      while (!done) {
        const { value, done: ended } = await reader.read();
        if (ended) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          if (!event.startsWith("data: ")) continue;
          const data = event.slice("data: ".length);
          if (data === "[DONE]") { done = true; break; }
          takeChunk(JSON.parse(data), result, view);
        }
      }
    } catch (error) {
      result.error = error.name === "AbortError" ? "stopped"
        : "the connection to the server ended mid-answer (" + error.message + "); what arrived is kept";
    }
    if (!done && result.error === null) {
      result.error = "the server ended the answer early; what arrived is kept";
    }
    result.finished = result.finished || performance.now();
    return result;
  }

  function takeChunk(chunk, result, view) {
    if (chunk.error) {
      result.error = chunk.error.message;
      return;
    }
    const extension = chunk.exactspec;
    if (extension) {
      for (const token of extension.tokens) {
        result.text += token.text;
        view.token(token.text, token.kind);
      }
      for (const round of extension.rounds) {
        result.tokens += round.tokens;
        result.finished = performance.now();
        view.round(round, result);
      }
      if (extension.summary) result.summary = extension.summary;
    }
  }

  // --- what the page shows ------------------------------------------------------------------------------------

  function appendToken(container, text, kind) {
    const span = document.createElement("span");
    span.className = "tok tok-" + kind;
    span.dataset.kind = kind;
    const legend = info && info.kinds[kind] ? info.kinds[kind].legend : kind;
    span.title = kind + ": " + legend;
    span.textContent = text;
    container.appendChild(span);
  }

  function tokensPerSecond(result) {
    const seconds = ((result.finished || performance.now()) - result.started) / 1000;
    return seconds > 0 ? result.tokens / seconds : 0;
  }

  class LiveFigures {
    constructor() {
      this.tokens = 0; this.drafted = 0; this.accepted = 0; this.passes = 0;
      this.ks = []; this.draftedAt = []; this.acceptedAt = [];
      this.bySource = new Map(); // a combined drafter's (the hybrid's) source -> its draft tokens accepted
    }

    round(round, result) {
      this.tokens += round.tokens;
      this.drafted += round.k;
      this.accepted += round.accepted;
      this.passes += 1;
      this.ks.push(round.k);
      if (round.source) this.bySource.set(round.source, (this.bySource.get(round.source) || 0) + round.accepted);
      for (let i = 0; i < round.k; i++) {
        this.draftedAt[i] = (this.draftedAt[i] || 0) + 1;
        if (i < round.accepted) this.acceptedAt[i] = (this.acceptedAt[i] || 0) + 1;
      }
      this.show(result);
    }

    show(result) {
      $("fig-tokens").textContent = String(this.tokens);
      $("fig-speed").textContent = tokensPerSecond(result).toFixed(1);
      $("fig-drafted").textContent = String(this.drafted);
      $("fig-accepted").textContent = String(this.accepted);
      $("fig-acceptance").textContent = this.drafted ? (100 * this.accepted / this.drafted).toFixed(1) + "%" : "–";
      $("fig-mean").textContent = this.passes ? (this.tokens / this.passes).toFixed(2) : "–";
      $("fig-passes").textContent = String(this.passes);
      $("fig-saved").textContent = String(this.tokens - this.passes);
      $("k-rounds").textContent = this.ks.join(" ");
      this.showSources();
      this.plot();
    }

    showSources() {
      const names = [...this.bySource.keys()].sort();
      $("sources-line").hidden = names.length === 0;
      $("sources").textContent = names.map((name) => {
        const accepted = this.bySource.get(name);
        const share = this.accepted ? (100 * accepted / this.accepted).toFixed(1) + "%" : "–";
        return name + " " + accepted + " (" + share + ")";
      }).join(" · ");
    }

    plot() {
      const canvas = $("position-plot");
      const context = canvas.getContext("2d");
      const width = canvas.width, height = canvas.height, left = 34, bottom = 22, top = 8;
      context.clearRect(0, 0, width, height);
      context.fillStyle = "#555";
      context.font = "11px sans-serif";
      context.fillText("100%", 2, top + 8);
      context.fillText("0%", 12, height - bottom);
      context.strokeStyle = "#999";
      context.beginPath();
      context.moveTo(left, top);
      context.lineTo(left, height - bottom);
      context.lineTo(width - 4, height - bottom);
      context.stroke();
      const positions = this.draftedAt.length;
      if (!positions) return;
      const slot = (width - left - 8) / positions;
      const rates = [];
      for (let i = 0; i < positions; i++) {
        const rate = (this.acceptedAt[i] || 0) / this.draftedAt[i];
        rates.push(rate);
        const barHeight = rate * (height - bottom - top);
        context.fillStyle = "#66bb6a";
        context.fillRect(left + i * slot + slot * 0.15, height - bottom - barHeight, slot * 0.7, barHeight);
        context.fillStyle = "#333";
        context.fillText(String(i + 1), left + i * slot + slot * 0.45, height - 6);
      }
      const described = rates.map((rate, i) => "position " + (i + 1) + ": " + (100 * rate).toFixed(0) + "%");
      canvas.setAttribute("aria-label", "Acceptance by draft position: " + described.join(", "));
      $("position-caption").textContent = "Acceptance by draft position (" + described.join(", ") + ")";
    }
  }

  function describeSummary(summary) {
    return "The server counted " + summary.completion_tokens + " tokens, " + summary.draft_tokens +
      " draft tokens scored, " + summary.accepted_tokens + " accepted, in " + summary.target_passes +
      " target passes (speculation " + summary.speculation + ").";
  }

  function busy(on) {
    $("send").disabled = on;
    $("compare").disabled = on;
    $("stop").disabled = !on;
  }

  async function generate() {
    const figures = new LiveFigures();
    const answer = $("answer");
    answer.replaceChildren();
    $("server-summary").textContent = "";
    figures.show({ started: performance.now(), finished: null, tokens: 0 });
    controller = new AbortController();
    busy(true);
    setStatus("Generating…");
    const view = { token: (text, kind) => appendToken(answer, text, kind), round: (r, result) => figures.round(r, result) };
    const result = await stream(requestBody($("speculation").value), view);
    busy(false);
    figures.show(result);
    if (result.summary) $("server-summary").textContent = describeSummary(result.summary);
    if (result.error) setStatus(result.error, true);
    else setStatus("Done: " + result.tokens + " tokens at " + tokensPerSecond(result).toFixed(1) + " tokens/s.");
  }

  function speculatingMode() {
    const chosen = $("speculation").value;
    if (chosen !== "never") return chosen;
    return info.modes.find((mode) => mode !== "never") || null;
  }

  async function compare() {
    const on = speculatingMode();
    if (on === null) {
      setStatus("This server does not speculate: there is nothing to compare.", true);
      return;
    }
    if ($("seed").value === "") $("seed").value = String(Math.floor(Math.random() * 2 ** 31));
    $("comparison").hidden = false;
    $("compare-on-mode").textContent = on;
    $("compare-verdict").textContent = "";
    $("compare-verdict").className = "";
    controller = new AbortController();
    busy(true);
    const results = {};
    for (const [side, mode] of [["off", "never"], ["on", on]]) {
      const container = $("compare-" + side);
      container.replaceChildren();
      $("compare-" + side + "-speed").textContent = "";
      setStatus("Comparing: speculation " + side + "…");
      const view = { token: (text, kind) => appendToken(container, text, kind), round: () => {} };
      const result = await stream(requestBody(mode), view);
      results[side] = result;
      $("compare-" + side + "-speed").textContent = result.tokens + " tokens, " +
        tokensPerSecond(result).toFixed(1) + " tokens/s" + (result.summary ? ", " + result.summary.target_passes +
        " target passes" : "");
      if (result.error) {
        busy(false);
        setStatus("Speculation " + side + ": " + result.error, true);
        return;
      }
    }
    busy(false);
    setStatus("Compared with seed " + $("seed").value + ".");
    const same = results.off.text === results.on.text;
    const speedup = tokensPerSecond(results.on) / Math.max(tokensPerSecond(results.off), 1e-9);
    const verdict = $("compare-verdict");
    verdict.className = same ? "identical" : "different";
    verdict.textContent = same
      ? "identical: the same " + results.on.tokens + " tokens; speculation on ran at " + speedup.toFixed(2) +
        "x the speed of speculation off"
      : "different: the answers part at character " + firstDifference(results.off.text, results.on.text);
  }

  function firstDifference(a, b) {
    let i = 0;
    while (i < a.length && i < b.length && a[i] === b[i]) i++;
    return i;
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("send").addEventListener("click", generate);
    $("compare").addEventListener("click", compare);
    $("stop").addEventListener("click", () => controller && controller.abort());
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      apiKey = $("api-key").value;
      $("api-key").value = "";
      loadInfo();
    });
    loadInfo();
  });
})();
